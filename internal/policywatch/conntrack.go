package policywatch

import (
	"errors"
	"fmt"
	"net/netip"
	"os"

	"github.com/mdlayher/netlink"
	"github.com/ti-mo/conntrack"
	"github.com/ti-mo/netfilter"
	"golang.org/x/sys/unix"

	"github.com/l7mp/stunnerd-xdp/internal/natcheck"
)

// Removed is a UDP conntrack entry the kernel removed: its original and reply
// tuples as it held them.
type Removed struct {
	OrigSrc, OrigDst, ReplySrc, ReplyDst netip.AddrPort
	// Deleted tells a removal a netlink request asked for (conntrack -D or
	// -F, kube-proxy's and CNIs' clean-ups: the notification carries the
	// requester's port id) from one the kernel made itself (port id 0: the
	// timeout ran out, an early drop, a NAT clean-up when an address went).
	// Both evict: after either the stack meets the flow's next packet as new.
	Deleted bool
}

// ErrEventsLost is returned by ConntrackEvents.Next when the kernel dropped
// notifications (the socket's buffer overflowed, ENOBUFS): entries may have
// been removed unseen, and the caller looks at its flows itself.
var ErrEventsLost = errors.New("conntrack notifications were lost")

// ErrNoConntrack: conntrack is not loaded in the network namespace, so no
// entry exists and none is removed (and subscribing would load it).
var ErrNoConntrack = errors.New("conntrack is not loaded in this network namespace")

// eventBuffer is the receive buffer asked for (SO_RCVBUFFORCE): a flush of
// a busy node's table sends one notification per entry at once.
const eventBuffer = 8 << 20

// ConntrackEvents is a subscription to the destroy notifications of the
// network namespace it was opened in.
type ConntrackEvents struct {
	conn *netlink.Conn
}

// ListenConntrack subscribes to conntrack's destroy notifications in the
// calling thread's network namespace; ErrNoConntrack while conntrack is not
// loaded there.
func ListenConntrack() (*ConntrackEvents, error) {
	if _, err := os.Stat(natcheck.CountSysctl); err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil, ErrNoConntrack
		}
		return nil, err
	}
	c, err := netlink.Dial(unix.NETLINK_NETFILTER, &netlink.Config{})
	if err != nil {
		return nil, fmt.Errorf("ctnetlink: %w", err)
	}
	if err := c.JoinGroup(uint32(netfilter.GroupCTDestroy)); err != nil {
		c.Close()
		return nil, fmt.Errorf("ctnetlink: joining the destroy group: %w", err)
	}
	growBuffer(c)
	return &ConntrackEvents{conn: c}, nil
}

// growBuffer raises the socket's receive buffer past net.core.rmem_max where
// the daemon may (CAP_NET_ADMIN), else as far as rmem_max lets it.
func growBuffer(c *netlink.Conn) {
	raw, err := c.SyscallConn()
	if err == nil {
		var serr error
		if err := raw.Control(func(fd uintptr) {
			serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_RCVBUFFORCE, eventBuffer)
		}); err == nil && serr == nil {
			return
		}
	}
	_ = c.SetReadBuffer(eventBuffer)
}

// Close ends the subscription; a Next waiting returns an error.
func (e *ConntrackEvents) Close() error { return e.conn.Close() }

// Next waits for the next notifications and returns the UDP entries they
// removed. ErrEventsLost says some were dropped; the subscription goes on.
func (e *ConntrackEvents) Next() ([]Removed, error) {
	msgs, err := e.conn.Receive()
	if err != nil {
		if errors.Is(err, unix.ENOBUFS) {
			return nil, ErrEventsLost
		}
		return nil, err
	}
	out := make([]Removed, 0, len(msgs))
	for _, m := range msgs {
		if r, ok := parseRemoved(m); ok {
			out = append(out, r)
		}
	}
	return out, nil
}

// parseRemoved decodes one destroy notification of a UDP entry.
func parseRemoved(m netlink.Message) (Removed, bool) {
	var ev conntrack.Event
	if err := ev.Unmarshal(m); err != nil || ev.Type != conntrack.EventDestroy || ev.Flow == nil {
		return Removed{}, false
	}
	f := ev.Flow
	if f.TupleOrig.Proto.Protocol != unix.IPPROTO_UDP {
		return Removed{}, false
	}
	ap := func(a netip.Addr, port uint16) netip.AddrPort { return netip.AddrPortFrom(a.Unmap(), port) }
	o, r := f.TupleOrig, f.TupleReply
	return Removed{
		OrigSrc: ap(o.IP.SourceAddress, o.Proto.SourcePort), OrigDst: ap(o.IP.DestinationAddress, o.Proto.DestinationPort),
		ReplySrc: ap(r.IP.SourceAddress, r.Proto.SourcePort), ReplyDst: ap(r.IP.DestinationAddress, r.Proto.DestinationPort),
		Deleted: m.Header.PID != 0,
	}, true
}
