package listener

import (
	"errors"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"

	"github.com/pion/turn/v4"

	"github.com/l7mp/stunnerd-xdp/internal/config"
	"github.com/l7mp/stunnerd-xdp/internal/peerpolicy"
)

// ErrPeerPort is what a relay socket returns for a write to a peer port the
// listener's cluster endpoints do not admit (STUNner's ErrPortProhibited).
var ErrPeerPort = errors.New("peer port outside the cluster endpoint's port range")

// ErrPeerRefused is what a relay socket returns for a write to a peer the
// listener's peer policy refuses now: a reload or a learned cluster network
// took it away after pion granted the permission (pion/turn v4 cannot take a
// permission back, so the relay socket stops its traffic).
var ErrPeerRefused = errors.New("peer refused by the peer policy")

// ErrUserRemoved is what the relay socket of an allocation whose user a
// reload removed returns for a write: its traffic stops at once, and the
// allocation ends when its client fails to refresh it.
var ErrUserRemoved = errors.New("the allocation's user is no longer configured")

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
// with whether each was handed to the mirror. With policy set, a peer the
// listener's peer policy no longer admits is out as well: a reload that
// narrows the policy revokes on both paths the way one that narrows the
// ranges does.
type portState struct {
	ports  atomic.Pointer[peerPorts]
	policy *atomic.Pointer[peerpolicy.Policy]
	// userOK, when set, says whether a username is still in the
	// configuration: a reload that removes a user revokes its channels
	// (kernel) and its relay sockets' traffic (userspace).
	userOK func(user string) bool
	// conns are the listener's relay sockets by relay address, so that the
	// allocation's username (OnAllocationCreated) reaches its socket.
	conns sync.Map

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

func (ps *portState) allowed(a net.Addr) bool { return ps.check(a) == nil }

func (ps *portState) userKnown(user string) bool { return ps.userOK == nil || ps.userOK(user) }

// withAllocationUsers tells each relay socket of ps the username of its
// allocation, before h's hooks run.
func (ps *portState) withAllocationUsers(h turn.EventHandler) turn.EventHandler {
	created := h.OnAllocationCreated
	h.OnAllocationCreated = func(src, dst net.Addr, proto, user, realm string, relay net.Addr, port int) {
		if c, ok := ps.conns.Load(relay.String()); ok {
			c.(*portFilterConn).user.Store(&user)
		}
		if created != nil {
			created(src, dst, proto, user, realm, relay, port)
		}
	}
	return h
}

// check says why datagrams to or from a may not be relayed (nil: they may).
func (ps *portState) check(a net.Addr) error {
	p, ok := udpAddrPort(a)
	if !ok {
		return nil // not a UDP peer: nothing to range-check
	}
	return ps.verdict(ps.ports.Load(), ps.currentPolicy(), p)
}

func (ps *portState) currentPolicy() *peerpolicy.Policy {
	if ps.policy == nil {
		return nil
	}
	return ps.policy.Load()
}

func (ps *portState) verdict(ports *peerPorts, pol *peerpolicy.Policy, p netip.AddrPort) error {
	if !ports.allowed(p) {
		return ErrPeerPort
	}
	if pol != nil && !pol.Relayable(p.Addr().Unmap()) {
		return ErrPeerRefused
	}
	return nil
}

// verdictCache remembers a relay socket's last peer and its verdict under
// the ranges and policy in force then: most relay sockets talk to one peer,
// and the policy's prefixes (a cluster's endpoints) would be walked per
// datagram. A reload replaces the ranges or the policy, which misses it.
type verdictCache struct {
	ports *peerPorts
	pol   *peerpolicy.Policy
	peer  netip.AddrPort
	err   error
}

func (ps *portState) cachedCheck(c *atomic.Pointer[verdictCache], a net.Addr) error {
	p, ok := udpAddrPort(a)
	if !ok {
		return nil
	}
	ports, pol := ps.ports.Load(), ps.currentPolicy()
	if v := c.Load(); v != nil && v.ports == ports && v.pol == pol && v.peer == p {
		return v.err
	}
	err := ps.verdict(ports, pol, p)
	c.Store(&verdictCache{ports: ports, pol: pol, peer: p, err: err})
	return err
}

// withPeerPorts lets only channels to admitted peer ports reach h (the
// mirror) and keeps what it let through, so that a reload that changes the
// ranges can install or withdraw bindings (setPeerPorts).
func (ps *portState) withPeerPorts(h turn.EventHandler) turn.EventHandler {
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

// setPeerPorts installs a listener's new port ranges (and re-reads its peer
// policy, which the caller may have replaced): channels now outside them
// leave the kernel path (and the relay socket drops their datagrams),
// channels now inside them are offered to the mirror.
func (s *Set) setPeerPorts(ps *portState, pp []config.Endpoint) {
	next := peerPorts(pp)
	ps.mu.Lock()
	defer ps.mu.Unlock()
	ps.ports.Store(&next)
	if ps.replay == nil || !s.gate.enter() {
		return
	}
	defer s.gate.exit()
	for _, c := range ps.channels {
		if ok := ps.allowed(c.peer) && ps.userKnown(c.user); ok != c.forwarded {
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
	fc := &portFilterConn{PacketConn: c, ps: g.ps, key: a.String()}
	g.ps.conns.Store(fc.key, fc)
	return fc, a, nil
}

// portFilterConn drops datagrams to and from peer ports outside the ranges,
// as STUNner's PortRangePacketConn, and to and from peers the peer policy
// refuses now.
type portFilterConn struct {
	net.PacketConn
	ps *portState
	// The last verdicts of each direction (pion reads in the allocation's
	// loop and writes from the listener's).
	reads, writes atomic.Pointer[verdictCache]
	// key is the relay address in ps.conns; user the allocation's username
	// once pion reported it.
	key  string
	user atomic.Pointer[string]
}

// revoked says whether the allocation's user was removed.
func (c *portFilterConn) revoked() bool {
	u := c.user.Load()
	return u != nil && !c.ps.userKnown(*u)
}

func (c *portFilterConn) WriteTo(p []byte, addr net.Addr) (int, error) {
	if err := c.ps.cachedCheck(&c.writes, addr); err != nil {
		return 0, err
	}
	if c.revoked() {
		return 0, ErrUserRemoved
	}
	return c.PacketConn.WriteTo(p, addr)
}

func (c *portFilterConn) ReadFrom(p []byte) (int, net.Addr, error) {
	for {
		n, addr, err := c.PacketConn.ReadFrom(p)
		if err != nil || (c.ps.cachedCheck(&c.reads, addr) == nil && !c.revoked()) {
			return n, addr, err
		}
	}
}

func (c *portFilterConn) Close() error {
	c.ps.conns.CompareAndDelete(c.key, c)
	return c.PacketConn.Close()
}

// configure puts l's peer policy under st and its port ranges in force on
// ls (a listener that starts, or one a reload changes in place).
func (s *Set) configure(st Settings, ls *Listener, l config.ResolvedListener) {
	ls.l = l
	ls.policy.Store(s.policy(st, l))
	s.setPeerPorts(&ls.ports, l.PeerPorts)
}

// policy is the peer policy of l under st.
func (s *Set) policy(st Settings, l config.ResolvedListener) *peerpolicy.Policy {
	allow := append(append([]netip.Prefix(nil), l.AllowPeers...), st.AllowPeers...)
	return peerpolicy.New(allow, st.DenyPeers, l.Allowlist, s.deps.ClusterNets, s.strangerLog)
}

func udpAddrPort(a net.Addr) (netip.AddrPort, bool) {
	u, ok := a.(*net.UDPAddr)
	if !ok {
		return netip.AddrPort{}, false
	}
	return u.AddrPort(), true
}
