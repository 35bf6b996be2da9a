package destinations

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"

	"github.com/mdlayher/netlink"
	"github.com/ti-mo/conntrack"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// maxWildcardProbes bounds the conntrack look-ups for one allocation on a
// wildcard listener: the flow's local address is one of the node's, which
// pion/turn does not report. A node with more addresses than this (IPVS puts
// every ClusterIP on kube-ipvs0) may miss a VIP, which then stays on the
// userspace path.
const maxWildcardProbes = 64

// ErrNoConntrack is what a look-up reports when the namespace has no
// connection tracking (module not loaded, or nothing hooked it): then there
// is no NAT, and nothing to learn.
var ErrNoConntrack = errors.New("no connection tracking in this network namespace")

// conntrackConn is a lazily dialled ctnetlink socket, re-dialled after an
// error.
type conntrackConn struct {
	netNS netns.NsHandle
	conn  *conntrack.Conn
}

func (c *conntrackConn) close() {
	if c.conn != nil {
		_ = c.conn.Close()
		c.conn = nil
	}
}

// get looks up the UDP flow whose reply goes from local to client. It
// returns found=false when there is no such entry.
func (c *conntrackConn) get(local, client netip.AddrPort) (conntrack.Flow, bool, error) {
	if c.conn == nil {
		cfg := &netlink.Config{}
		if c.netNS.IsOpen() {
			cfg.NetNS = int(c.netNS)
		}
		conn, err := conntrack.Dial(cfg)
		if err != nil {
			if errors.Is(err, unix.EPROTONOSUPPORT) {
				return conntrack.Flow{}, false, fmt.Errorf("%w: %w", ErrNoConntrack, err)
			}
			return conntrack.Flow{}, false, fmt.Errorf("conntrack: %w", err)
		}
		c.conn = conn
	}
	var q conntrack.Flow
	q.TupleReply.IP = conntrack.IPTuple{SourceAddress: local.Addr(), DestinationAddress: client.Addr()}
	q.TupleReply.Proto = conntrack.ProtoTuple{Protocol: unix.IPPROTO_UDP, SourcePort: local.Port(), DestinationPort: client.Port()}
	f, err := c.conn.Get(q)
	switch {
	case err == nil:
		return f, true, nil
	case errors.Is(err, unix.ENOENT):
		return conntrack.Flow{}, false, nil
	case errors.Is(err, unix.EOPNOTSUPP), errors.Is(err, unix.EPROTONOSUPPORT):
		// nf_conntrack_netlink absent: nfnetlink has no such subsystem.
		return conntrack.Flow{}, false, fmt.Errorf("%w: %w", ErrNoConntrack, err)
	default:
		c.close()
		return conntrack.Flow{}, false, fmt.Errorf("conntrack get %v -> %v: %w", local, client, err)
	}
}

// learn looks the allocation's flow up in conntrack and returns the
// destination its client's packets carry on the wire when the kernel
// translated it to the listener (a VIP), or an invalid AddrPort. Only the
// kernel's own entry is believed: nothing here comes from the client.
func (t *Tracker) learn(a allocation, listeners []netip.AddrPort) netip.AddrPort {
	if a.client.Addr().Is4() != a.listener.Addr().Is4() {
		return netip.AddrPort{}
	}
	var locals []netip.AddrPort
	if !a.listener.Addr().IsUnspecified() {
		locals = []netip.AddrPort{a.listener}
	} else {
		// A wildcard socket: the flow's local address is one of those the
		// listener owns.
		for d, l := range Compute(listeners, t.local, nil) {
			if l == a.listener {
				locals = append(locals, d)
			}
		}
		slices.SortFunc(locals, netip.AddrPort.Compare)
		if len(locals) > maxWildcardProbes {
			locals = locals[:maxWildcardProbes]
		}
	}
	for _, local := range locals {
		f, found, err := t.conn.get(local, a.client)
		if errors.Is(err, ErrNoConntrack) {
			t.log.Debug("no conntrack: nothing to learn", "client", a.client.String(), "error", err)
			return netip.AddrPort{}
		}
		t.report(problemConntrack, err)
		if err != nil || !found {
			continue
		}
		orig := f.TupleOrig
		wire := netip.AddrPortFrom(orig.IP.DestinationAddress.Unmap(), orig.Proto.DestinationPort)
		if wire == local {
			return netip.AddrPort{} // not translated
		}
		if wire.Port() != a.listener.Port() {
			// A NodePort: the wire port is the node's own; a socket
			// bound there makes it a second claimant (sockets.go).
			other, bound, err := t.socks.bound(wire)
			t.report(problemSockets, err)
			if err != nil {
				return netip.AddrPort{}
			}
			if bound {
				t.log.Debug("not learning a port-translated destination: a local socket is bound to it",
					"dest", wire.String(), "socket", other.String(), "listener", a.listener.String())
				return netip.AddrPort{}
			}
		}
		t.log.Debug("learned a VIP from conntrack", "vip", wire.String(), "listener", a.listener.String(),
			"local", local.String(), "client", a.client.String())
		return wire
	}
	return netip.AddrPort{}
}
