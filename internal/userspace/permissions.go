package userspace

import (
	"maps"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"

	"github.com/pion/turn/v4"
)

// What pion/turn relays from a peer: its allocation's packet handler reads
// every datagram that reaches the relay socket and relays one from a peer it
// holds a channel to (the exact address) or a permission for (the IP), and
// drops anything else. A relay socket charges the allocation's rate limit
// only for what pion will relay, so that a stranger's datagrams to a relay
// port (no permission: pion drops them) cannot spend the allocation's budget
// and mute its session. The set follows pion's own events (PeerHooks).

// peerSet is one allocation's peers as pion holds them. Immutable: replaced
// as a whole on an event, read per datagram without a lock.
type peerSet struct {
	perms map[netip.Addr]struct{}
	chans map[netip.AddrPort]uint16 // the peer's channel number
}

// relays tells whether pion relays a datagram from src.
func (s *peerSet) relays(src netip.AddrPort) bool {
	if s == nil {
		return false
	}
	if _, ok := s.chans[src]; ok {
		return true
	}
	_, ok := s.perms[src.Addr()]
	return ok
}

// peers is a relay socket's peerSet and its writers' lock.
type peers struct {
	mu  sync.Mutex
	set atomic.Pointer[peerSet]
}

// change applies f to a copy of the set.
func (p *peers) change(f func(*peerSet)) {
	p.mu.Lock()
	defer p.mu.Unlock()
	next := &peerSet{perms: map[netip.Addr]struct{}{}, chans: map[netip.AddrPort]uint16{}}
	if cur := p.set.Load(); cur != nil {
		next.perms, next.chans = maps.Clone(cur.perms), maps.Clone(cur.chans)
	}
	f(next)
	p.set.Store(next)
}

// relays tells whether pion relays a datagram from src.
func (p *peers) relays(src net.Addr) bool {
	k, ok := udpAddrPort(src)
	return ok && p.set.Load().relays(k)
}

// PeerHooks wraps h with the hooks that tell each relay socket of the set
// which peers pion relays from (h's hooks run first). pion reports every
// permission and channel with the allocation's relay address, whatever the
// listener's protocol.
func (s *RelaySockets) PeerHooks(h turn.EventHandler) turn.EventHandler {
	permCreated, permDeleted := h.OnPermissionCreated, h.OnPermissionDeleted
	chCreated, chDeleted := h.OnChannelCreated, h.OnChannelDeleted
	h.OnPermissionCreated = func(src, dst net.Addr, proto, user, realm string, relay net.Addr, peer net.IP) {
		if permCreated != nil {
			permCreated(src, dst, proto, user, realm, relay, peer)
		}
		s.permission(relay, peer, true)
	}
	h.OnPermissionDeleted = func(src, dst net.Addr, proto, user, realm string, relay net.Addr, peer net.IP) {
		if permDeleted != nil {
			permDeleted(src, dst, proto, user, realm, relay, peer)
		}
		s.permission(relay, peer, false)
	}
	h.OnChannelCreated = func(src, dst net.Addr, proto, user, realm string, relay, peer net.Addr, ch uint16) {
		if chCreated != nil {
			chCreated(src, dst, proto, user, realm, relay, peer, ch)
		}
		s.channel(relay, peer, ch, true)
	}
	h.OnChannelDeleted = func(src, dst net.Addr, proto, user, realm string, relay, peer net.Addr, ch uint16) {
		if chDeleted != nil {
			chDeleted(src, dst, proto, user, realm, relay, peer, ch)
		}
		s.channel(relay, peer, ch, false)
	}
	return h
}

func (s *RelaySockets) permission(relay net.Addr, peer net.IP, on bool) {
	_, raw := s.get(relay)
	ip, ok := netip.AddrFromSlice(peer)
	if raw == nil || !ok {
		return
	}
	ip = ip.Unmap()
	raw.peers.change(func(p *peerSet) {
		if on {
			p.perms[ip] = struct{}{}
		} else {
			delete(p.perms, ip)
		}
	})
}

func (s *RelaySockets) channel(relay, peer net.Addr, ch uint16, on bool) {
	_, raw := s.get(relay)
	k, ok := udpAddrPort(peer)
	if raw == nil || !ok {
		return
	}
	raw.peers.change(func(p *peerSet) {
		if on {
			p.chans[k] = ch
		} else {
			delete(p.chans, k)
		}
	})
}
