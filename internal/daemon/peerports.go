package daemon

import (
	"errors"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"

	"github.com/pion/turn/v4"

	"github.com/l7mp/stunnerd-xdp/internal/config"
)

// ErrPeerPort is what a relay socket returns for a write to a peer port the
// listener's cluster endpoints do not admit (STUNner's ErrPortProhibited).
var ErrPeerPort = errors.New("peer port outside the cluster endpoint's port range")

// peerPorts are a listener's STATIC endpoints with their port ranges. pion's
// permission handler sees only the peer's address, so the port is checked
// where STUNner checks it: on every datagram through the relay socket
// (userspace), and before a channel binding reaches the mirror (kernel: a
// binding to a port outside the range is never installed, so XDP never
// relays to or from it; no BPF change is needed, its bindings are exact
// peer address:port pairs).
type peerPorts []config.Endpoint

// allowed reports whether the peer may be relayed to: a peer address no
// endpoint covers is the peer policy's business alone (--allow-peer); one that
// endpoints cover must be on a port of one of them.
func (pp peerPorts) allowed(peer netip.AddrPort) bool {
	a := peer.Addr().Unmap()
	covered := false
	for _, e := range pp {
		if e.Prefix.Contains(a) {
			if peer.Port() >= e.MinPort && peer.Port() <= e.MaxPort {
				return true
			}
			covered = true
		}
	}
	return !covered
}

// portState is a listener's port ranges and the channels pion holds on it,
// with whether each was handed to the mirror.
type portState struct {
	ports atomic.Pointer[peerPorts]

	mu       sync.Mutex
	channels map[channelKey]*channel
	// replay hands a channel to the mirror (created) or withdraws it.
	replay func(created bool, c *channel)
}

// channelKey identifies one of pion's channels by its hook arguments.
type channelKey struct {
	src, dst, relay, peer string
	ch                    uint16
}

// channel is what pion's OnChannelCreated said, and whether the mirror has it.
type channel struct {
	src, dst, relay, peer net.Addr
	proto, user, realm    string
	ch                    uint16
	forwarded             bool
}

func newChannelKey(src, dst, relay, peer net.Addr, ch uint16) channelKey {
	return channelKey{src.String(), dst.String(), relay.String(), peer.String(), ch}
}

func (ps *portState) allowed(a net.Addr) bool {
	p, ok := udpAddrPort(a)
	if !ok {
		return true // not a UDP peer: nothing to range-check
	}
	return ps.ports.Load().allowed(p)
}

// withPeerPorts lets only channels to admitted peer ports reach h (the
// mirror) and keeps what it let through, so that a reload that changes the
// ranges can install or withdraw bindings (setPeerPorts).
func withPeerPorts(ps *portState, h turn.EventHandler) turn.EventHandler {
	created, deleted := h.OnChannelCreated, h.OnChannelDeleted
	if created == nil || deleted == nil {
		return h
	}
	ps.channels = map[channelKey]*channel{}
	h.OnChannelCreated = func(src, dst net.Addr, proto, user, realm string, relay, peer net.Addr, ch uint16) {
		c := &channel{src: src, dst: dst, relay: relay, peer: peer, proto: proto, user: user, realm: realm, ch: ch}
		ps.mu.Lock()
		defer ps.mu.Unlock()
		c.forwarded = ps.allowed(peer)
		ps.channels[newChannelKey(src, dst, relay, peer, ch)] = c
		if c.forwarded {
			created(src, dst, proto, user, realm, relay, peer, ch)
		}
	}
	h.OnChannelDeleted = func(src, dst net.Addr, proto, user, realm string, relay, peer net.Addr, ch uint16) {
		k := newChannelKey(src, dst, relay, peer, ch)
		ps.mu.Lock()
		defer ps.mu.Unlock()
		c, known := ps.channels[k]
		delete(ps.channels, k)
		if !known || c.forwarded {
			deleted(src, dst, proto, user, realm, relay, peer, ch)
		}
	}
	ps.replay = func(on bool, c *channel) {
		if on {
			created(c.src, c.dst, c.proto, c.user, c.realm, c.relay, c.peer, c.ch)
		} else {
			deleted(c.src, c.dst, c.proto, c.user, c.realm, c.relay, c.peer, c.ch)
		}
	}
	return h
}

// setPeerPorts installs a listener's new port ranges: channels now outside
// them leave the kernel path (and the relay socket drops their datagrams),
// channels now inside them are offered to the mirror.
func (d *Daemon) setPeerPorts(ps *portState, pp []config.Endpoint) {
	next := peerPorts(pp)
	ps.mu.Lock()
	defer ps.mu.Unlock()
	ps.ports.Store(&next)
	if ps.replay == nil || !d.hooks.enter() {
		return
	}
	defer d.hooks.exit()
	for _, c := range ps.channels {
		if ok := ps.allowed(c.peer); ok != c.forwarded {
			c.forwarded = ok
			ps.replay(ok, c)
		}
	}
}

// portFilterGenerator allocates relay sockets that enforce the listener's
// peer port ranges.
type portFilterGenerator struct {
	turn.RelayAddressGenerator
	ps *portState
}

func (g *portFilterGenerator) AllocatePacketConn(network string, requestedPort int) (net.PacketConn, net.Addr, error) {
	c, a, err := g.RelayAddressGenerator.AllocatePacketConn(network, requestedPort)
	if err != nil {
		return nil, nil, err
	}
	return &portFilterConn{PacketConn: c, ps: g.ps}, a, nil
}

// portFilterConn drops datagrams to and from peer ports outside the ranges,
// as STUNner's PortRangePacketConn.
type portFilterConn struct {
	net.PacketConn
	ps *portState
}

func (c *portFilterConn) WriteTo(p []byte, addr net.Addr) (int, error) {
	if !c.ps.allowed(addr) {
		return 0, ErrPeerPort
	}
	return c.PacketConn.WriteTo(p, addr)
}

func (c *portFilterConn) ReadFrom(p []byte) (int, net.Addr, error) {
	for {
		n, addr, err := c.PacketConn.ReadFrom(p)
		if err != nil || c.ps.allowed(addr) {
			return n, addr, err
		}
	}
}
