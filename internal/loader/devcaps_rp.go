package loader

import (
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netlink/nl"
	"golang.org/x/sys/unix"

	"github.com/l7mp/stunnerd-xdp/bpf"
)

// The stack's reverse-path filter, as dev_caps tells it to the program
// (DEV_RP_STRICT, DEV_RP_LOOSE): the program relays only what the stack would
// have delivered to pion/turn, and the stack drops, on a device that filters,
// a packet whose source it would not route back (issue 35).
//
// What the kernel does (net/ipv4/fib_frontend.c, fib_validate_source and
// __fib_validate_source, called per packet from ip_route_input_slow for a
// local destination, before the input route cache):
//
//   - the mode is IN_DEV_RPFILTER(idev) = IN_DEV_MAXCONF(idev, RP_FILTER):
//     the larger of net.ipv4.conf.all.rp_filter and net.ipv4.conf.<dev>.
//     So all=2 with dev=1 filters loosely, all=1 with dev=0 strictly.
//     (conf.default only seeds the value of devices made later: each has
//     its own, reported on its own.)
//   - 0: no reverse-path check (only the martian checks every mode has).
//   - a route back to the source (the first lookup) whose nexthop uses the
//     device: accepted in every mode.
//   - no route back at all (the lookup fails, which includes unreachable,
//     prohibit and blackhole routes): last_resort, rejected in modes 1 and 2.
//   - a route back through another device: rejected in mode 1 (e_rpf). In
//     mode 2 the device's having no IPv4 address (no_addr: idev->ifa_list
//     empty) sends it to last_resort first, rejected as well; with an
//     address the second lookup (oif = the device) decides, and accepts
//     even when it finds nothing: only "no route back at all" is rejected.
//
// Hence mode 1, and mode 2 on a device without an IPv4 address, behave as
// strict (DEV_RP_STRICT); mode 2 with an address is loose (DEV_RP_LOOSE).
// The check is skipped for IPsec-protected packets (secpath): nothing the
// program relays.

// Netconf message layout (linux/netconf.h); x/sys/unix does not carry it.
const (
	netconfaIfindex  = 1 // NETCONFA_IFINDEX, s32
	netconfaRPFilter = 3 // NETCONFA_RP_FILTER, s32

	netconfIfindexAll = -1 // NETCONFA_IFINDEX_ALL: net.ipv4.conf.all

	// struct netconfmsg is one byte (the family), padded to NLMSG_ALIGNTO.
	sizeofNetconfmsg = 4
)

// rpConf is what the stack's reverse-path filter decides from in one
// namespace.
type rpConf struct {
	all    int          // net.ipv4.conf.all.rp_filter
	dev    map[int]int  // net.ipv4.conf.<dev>.rp_filter by ifindex
	v4Addr map[int]bool // the devices that have an IPv4 address
}

// rpFlags is the reverse-path mode of a device as dev_caps tells it. A nil
// conf (not readable) and a device without an IPv4 configuration (not in the
// dump: the stack takes no IPv4 there, or it is newer than the dump and the
// next read knows it) get DEV_RP_STRICT: the program then checks every
// packet from there and passes what fails to the stack, which at worst
// relays in userspace what the kernel path could have.
func (c *rpConf) rpFlags(ifindex int) bpf.RelayDevFlag {
	if c == nil {
		return bpf.RelayDevFlagDEV_RP_STRICT
	}
	dev, ok := c.dev[ifindex]
	if !ok {
		return bpf.RelayDevFlagDEV_RP_STRICT
	}
	switch max(c.all, dev) {
	case 0:
		return 0
	case 2:
		if c.v4Addr[ifindex] {
			return bpf.RelayDevFlagDEV_RP_LOOSE
		}
		// no_addr: __fib_validate_source's last_resort rejects what does
		// not route back through the device, as strict does.
		return bpf.RelayDevFlagDEV_RP_STRICT
	default:
		// 1, and any larger value (the sysctl takes 0..2; a newer kernel's
		// mode is unknown here): strict is what passes most to the stack.
		return bpf.RelayDevFlagDEV_RP_STRICT
	}
}

// rpWatch reads the reverse-path settings of the namespace its sockets were
// opened in (sysctls in /proc/sys are those of the reading thread's
// namespace, which sync's goroutines need not be in) and tells of changes.
type rpWatch struct {
	dump   *nl.SocketHandle  // RTM_GETNETCONF dumps; in no group
	events *nl.NetlinkSocket // netconf and IPv4 address notifications
}

// dialRPWatch opens the sockets in the calling thread's namespace.
func dialRPWatch() (*rpWatch, error) {
	d, err := nl.Subscribe(unix.NETLINK_ROUTE)
	if err != nil {
		return nil, fmt.Errorf("netconf socket: %w", err)
	}
	// A dump that does not answer must not stall sync.
	_ = d.SetReceiveTimeout(&unix.Timeval{Sec: 1})
	_ = d.SetSendTimeout(&unix.Timeval{Sec: 1})
	// net.ipv4.conf.*.rp_filter changes come as RTM_NEWNETCONF with
	// NETCONFA_RP_FILTER (devinet_conf_proc); an address added or removed
	// changes no_addr.
	e, err := nl.Subscribe(unix.NETLINK_ROUTE, unix.RTNLGRP_IPV4_NETCONF, unix.RTNLGRP_IPV4_IFADDR)
	if err != nil {
		d.Close()
		return nil, fmt.Errorf("netconf and address events: %w", err)
	}
	// Receive returns at least this often to look at stop.
	_ = e.SetReceiveTimeout(&unix.Timeval{Usec: 200000})
	return &rpWatch{dump: &nl.SocketHandle{Socket: d}, events: e}, nil
}

func (w *rpWatch) close() {
	w.dump.Socket.Close()
	w.events.Close()
}

// follow calls changed after every notification, and when some may have been
// lost, until stop is closed.
func (w *rpWatch) follow(stop <-chan struct{}, changed func(), log *slog.Logger) {
	for {
		select {
		case <-stop:
			return
		default:
		}
		msgs, _, err := w.events.Receive()
		switch {
		case err == nil:
			if len(msgs) > 0 {
				changed()
			}
		case errors.Is(err, unix.EAGAIN), errors.Is(err, unix.EINTR):
		case errors.Is(err, unix.ENOBUFS):
			changed() // overrun: something changed that was not read
		default:
			log.Warn("reading netconf and address events for the reverse-path filter; reading on in a second", "error", err)
			changed()
			select {
			case <-stop:
				return
			case <-time.After(time.Second):
			}
		}
	}
}

// read dumps the IPv4 rp_filter settings (all and every device) and, through
// rtnl (a handle of the same namespace), the devices with an IPv4 address. A
// dump the kernel interrupted (something changed meanwhile) is read again.
func (w *rpWatch) read(rtnl *netlink.Handle) (*rpConf, error) {
	var err error
	for range 3 {
		var c *rpConf
		if c, err = w.readOnce(rtnl); !errors.Is(err, netlink.ErrDumpInterrupted) {
			return c, err
		}
	}
	return nil, err
}

func (w *rpWatch) readOnce(rtnl *netlink.Handle) (*rpConf, error) {
	c := &rpConf{all: -1, dev: map[int]int{}, v4Addr: map[int]bool{}}
	req := nl.NewNetlinkRequest(unix.RTM_GETNETCONF, unix.NLM_F_DUMP)
	req.AddRawData([]byte{unix.AF_INET, 0, 0, 0})
	req.Sockets = map[int]*nl.SocketHandle{unix.NETLINK_ROUTE: w.dump}
	var parseErr error
	err := req.ExecuteIter(unix.NETLINK_ROUTE, unix.RTM_NEWNETCONF, func(m []byte) bool {
		if len(m) < sizeofNetconfmsg || m[0] != unix.AF_INET {
			return true
		}
		attrs, err := nl.ParseRouteAttr(m[sizeofNetconfmsg:])
		if err != nil {
			parseErr = err
			return false
		}
		ifindex, rp, hasIdx, hasRP := 0, 0, false, false
		for _, a := range attrs {
			if len(a.Value) < 4 {
				continue
			}
			v := int(int32(binary.NativeEndian.Uint32(a.Value)))
			switch a.Attr.Type {
			case netconfaIfindex:
				ifindex, hasIdx = v, true
			case netconfaRPFilter:
				rp, hasRP = v, true
			}
		}
		switch {
		case !hasIdx || !hasRP:
			// A kernel whose dump does not carry it: unknown.
			parseErr = errors.New("netconf dump without NETCONFA_RP_FILTER")
			return false
		case ifindex == netconfIfindexAll:
			c.all = rp
		case ifindex > 0:
			c.dev[ifindex] = rp
		}
		return true
	})
	if err != nil {
		return nil, fmt.Errorf("netconf dump: %w", err)
	}
	if parseErr != nil {
		return nil, fmt.Errorf("netconf dump: %w", parseErr)
	}
	if c.all < 0 {
		return nil, errors.New("netconf dump: no entry for net.ipv4.conf.all")
	}
	// One dump for every device (a nil link filters nothing).
	addrs, err := rtnl.AddrList(nil, netlink.FAMILY_V4)
	if err != nil {
		return nil, fmt.Errorf("IPv4 addresses: %w", err)
	}
	for _, a := range addrs {
		c.v4Addr[a.LinkIndex] = true
	}
	return c, nil
}
