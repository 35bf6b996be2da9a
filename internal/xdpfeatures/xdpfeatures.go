// Package xdpfeatures reads what each network device of a namespace does with
// XDP frames, as the kernel reports it through the `netdev` generic-netlink
// family (Linux 6.3+: NETDEV_A_DEV_XDP_FEATURES), and follows the family's
// change notifications (multicast group "mgmt": a device added, deleted, or its
// features changed). The bit that matters most is NDOXmit: a frame another
// device XDP_REDIRECTs to this one is transmitted. A veth sets it only while
// its peer can receive XDP frames (an XDP program or GRO on the peer, 6.4+);
// bridges, VLAN, macvlan and tunnel devices never do.
package xdpfeatures

import (
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/mdlayher/genetlink"
	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"
)

// Act is a set of the XDP features of a device (enum netdev_xdp_act).
type Act uint64

// The features (include/uapi/linux/netdev.h).
const (
	Basic       Act = 1 << 0 // XDP_ABORTED, XDP_DROP, XDP_PASS, XDP_TX in the driver
	Redirect    Act = 1 << 1 // XDP_REDIRECT from the driver
	NDOXmit     Act = 1 << 2 // ndo_xdp_xmit: redirected frames are transmitted
	XSKZeroCopy Act = 1 << 3
	HWOffload   Act = 1 << 4
	RXSG        Act = 1 << 5
	NDOXmitSG   Act = 1 << 6
)

// The netdev family's commands, attributes and multicast group.
const (
	familyName = "netdev"
	mgmtGroup  = "mgmt"

	cmdDevGet       = 1
	cmdDevAddNtf    = 2
	cmdDevDelNtf    = 3
	cmdDevChangeNtf = 4

	attrDevIfindex     = 1
	attrDevXDPFeatures = 3
)

// Errors callers branch on.
var (
	// ErrUnsupported: the kernel has no netdev family (before 6.3), or it
	// has no "mgmt" group: nothing is known of any device's XDP features.
	ErrUnsupported = errors.New("the kernel does not report XDP features (netdev generic netlink family, Linux 6.3+)")
	// ErrNoDevice: no device has that ifindex in the namespace.
	ErrNoDevice = errors.New("no such network device")
)

// Client queries the features of the devices of the network namespace it was
// created in (the calling thread's).
type Client struct {
	c      *genetlink.Conn
	family genetlink.Family
}

// Dial opens a client in the calling thread's network namespace. It returns
// ErrUnsupported (wrapped) on kernels without the netdev family.
func Dial() (*Client, error) {
	c, err := genetlink.Dial(nil)
	if err != nil {
		return nil, fmt.Errorf("generic netlink: %w", err)
	}
	f, err := c.GetFamily(familyName)
	if err != nil {
		c.Close()
		if errors.Is(err, os.ErrNotExist) {
			return nil, ErrUnsupported
		}
		return nil, fmt.Errorf("generic netlink family %s: %w", familyName, err)
	}
	return &Client{c: c, family: f}, nil
}

// Close closes the client.
func (c *Client) Close() error { return c.c.Close() }

// Get returns the XDP features of the device with that ifindex.
func (c *Client) Get(ifindex int) (Act, error) {
	ae := netlink.NewAttributeEncoder()
	ae.Uint32(attrDevIfindex, uint32(ifindex))
	b, err := ae.Encode()
	if err != nil {
		return 0, err
	}
	msgs, err := c.c.Execute(genetlink.Message{Header: genetlink.Header{Command: cmdDevGet, Version: c.family.Version}, Data: b},
		c.family.ID, netlink.Request)
	if err != nil {
		if errors.Is(err, unix.ENODEV) || errors.Is(err, os.ErrNotExist) {
			return 0, fmt.Errorf("ifindex %d: %w", ifindex, ErrNoDevice)
		}
		return 0, fmt.Errorf("xdp-features of ifindex %d: %w", ifindex, err)
	}
	for _, m := range msgs {
		if d, err := parseDev(m.Data); err == nil && d.Ifindex == ifindex {
			return d.Features, nil
		}
	}
	return 0, fmt.Errorf("ifindex %d: %w", ifindex, ErrNoDevice)
}

// Dump returns the XDP features of every device of the namespace, by ifindex.
func (c *Client) Dump() (map[int]Act, error) {
	msgs, err := c.c.Execute(genetlink.Message{Header: genetlink.Header{Command: cmdDevGet, Version: c.family.Version}},
		c.family.ID, netlink.Request|netlink.Dump)
	if err != nil {
		return nil, fmt.Errorf("xdp-features dump: %w", err)
	}
	out := make(map[int]Act, len(msgs))
	for _, m := range msgs {
		d, err := parseDev(m.Data)
		if err != nil {
			return nil, err
		}
		out[d.Ifindex] = d.Features
	}
	return out, nil
}

// Kind is what a notification says happened to a device.
type Kind int

const (
	Added   Kind = iota // NETDEV_CMD_DEV_ADD_NTF
	Deleted             // NETDEV_CMD_DEV_DEL_NTF
	Changed             // NETDEV_CMD_DEV_CHANGE_NTF: its XDP features changed
	// Lost: notifications may have been lost (a socket overrun, a read
	// error): what the caller knows may be stale; read everything again.
	Lost
)

// Event is one notification: a device's ifindex and its features now.
type Event struct {
	Kind     Kind
	Ifindex  int
	Features Act
}

// Watcher delivers the family's notifications; Close ends it.
type Watcher struct {
	c    *genetlink.Conn
	stop chan struct{}
	done chan struct{}
}

// Watch calls fn for every notification of the family in the calling thread's
// network namespace, from a goroutine of its own (never concurrently), until
// Close. It returns once subscribed: a change after Watch returned is seen.
// ErrUnsupported (wrapped): the kernel sends none.
func Watch(fn func(Event)) (*Watcher, error) {
	c, err := genetlink.Dial(nil)
	if err != nil {
		return nil, fmt.Errorf("generic netlink: %w", err)
	}
	f, err := c.GetFamily(familyName)
	if err != nil {
		c.Close()
		if errors.Is(err, os.ErrNotExist) {
			return nil, ErrUnsupported
		}
		return nil, fmt.Errorf("generic netlink family %s: %w", familyName, err)
	}
	joined := false
	for _, g := range f.Groups {
		if g.Name == mgmtGroup {
			if err := c.JoinGroup(g.ID); err != nil {
				c.Close()
				return nil, fmt.Errorf("join %s/%s: %w", familyName, mgmtGroup, err)
			}
			joined = true
		}
	}
	if !joined {
		c.Close()
		return nil, ErrUnsupported
	}
	w := &Watcher{c: c, stop: make(chan struct{}), done: make(chan struct{})}
	go w.run(fn)
	return w, nil
}

// Close stops the watcher and waits for its goroutine: fn is not called after
// Close returned.
func (w *Watcher) Close() error {
	close(w.stop)
	err := w.c.Close() // a blocked Receive returns
	<-w.done
	return err
}

func (w *Watcher) run(fn func(Event)) {
	defer close(w.done)
	for {
		msgs, _, err := w.c.Receive()
		select {
		case <-w.stop:
			return
		default:
		}
		if err != nil {
			fn(Event{Kind: Lost})
			if !errors.Is(err, unix.ENOBUFS) {
				select { // a broken socket: do not spin
				case <-w.stop:
					return
				case <-time.After(time.Second):
				}
			}
			continue
		}
		for _, m := range msgs {
			var k Kind
			switch m.Header.Command {
			case cmdDevAddNtf:
				k = Added
			case cmdDevDelNtf:
				k = Deleted
			case cmdDevChangeNtf:
				k = Changed
			default:
				continue
			}
			d, err := parseDev(m.Data)
			if err != nil {
				fn(Event{Kind: Lost})
				continue
			}
			fn(Event{Kind: k, Ifindex: d.Ifindex, Features: d.Features})
		}
	}
}

type dev struct {
	Ifindex  int
	Features Act
}

func parseDev(b []byte) (dev, error) {
	var d dev
	ad, err := netlink.NewAttributeDecoder(b)
	if err != nil {
		return d, fmt.Errorf("netdev message: %w", err)
	}
	for ad.Next() {
		switch ad.Type() {
		case attrDevIfindex:
			d.Ifindex = int(ad.Uint32())
		case attrDevXDPFeatures:
			d.Features = Act(ad.Uint64())
		}
	}
	if err := ad.Err(); err != nil {
		return d, fmt.Errorf("netdev message: %w", err)
	}
	if d.Ifindex == 0 {
		return d, errors.New("netdev message without an ifindex")
	}
	return d, nil
}
