package control

import (
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"sync"
	"time"
)

// PeerPolicy decides which peers clients may get permissions for. It runs in
// pion/turn's permission handler, so a refused peer never gets a permission
// or a channel and never reaches the XDP maps: neither path relays to it.
//
// The rules, first match wins:
//  1. the most specific --deny-peer or --allow-peer prefix that contains the
//     peer decides (on a tie, deny);
//  2. else peers on loopback, link-local (169.254.0.0/16, fe80::/10, which
//     hold cloud metadata services), multicast, unspecified addresses, and
//     the node's own addresses are refused;
//  3. else, when --allow-peer prefixes were given, the peer is refused (they
//     are an allowlist, like STUNner's clusters); without them it is allowed.
type PeerPolicy struct {
	allow, deny []netip.Prefix
	log         *slog.Logger
	// ownAddrs lists the node's addresses; refreshed at most every ownTTL.
	ownAddrs func() ([]netip.Addr, error)

	mu       sync.Mutex
	own      map[netip.Addr]bool
	ownUntil time.Time
}

const ownTTL = 5 * time.Second

// NewPeerPolicy builds a policy from --allow-peer and --deny-peer prefixes.
func NewPeerPolicy(allow, deny []netip.Prefix, log *slog.Logger) *PeerPolicy {
	return &PeerPolicy{allow: allow, deny: deny, log: log, ownAddrs: interfaceAddrs}
}

// ParsePrefix parses a CIDR or a bare address (a /32 or /128).
func ParsePrefix(s string) (netip.Prefix, error) {
	if p, err := netip.ParsePrefix(s); err == nil {
		if p != p.Masked() {
			return netip.Prefix{}, fmt.Errorf("%q has host bits set; did you mean %v?", s, p.Masked())
		}
		return netip.PrefixFrom(p.Addr().Unmap(), p.Bits()-unmapBits(p.Addr())), nil
	}
	a, err := netip.ParseAddr(s)
	if err != nil {
		return netip.Prefix{}, fmt.Errorf("%q is neither an address nor a CIDR prefix", s)
	}
	a = a.Unmap()
	return netip.PrefixFrom(a, a.BitLen()), nil
}

func unmapBits(a netip.Addr) int {
	if a.Is4In6() {
		return 96
	}
	return 0
}

func interfaceAddrs() ([]netip.Addr, error) {
	as, err := net.InterfaceAddrs()
	if err != nil {
		return nil, err
	}
	out := make([]netip.Addr, 0, len(as))
	for _, a := range as {
		if ipn, ok := a.(*net.IPNet); ok {
			if ip, ok := netip.AddrFromSlice(ipn.IP); ok {
				out = append(out, ip.Unmap())
			}
		}
	}
	return out, nil
}

// Allowed reports whether a permission to peer may be granted, and why not.
func (p *PeerPolicy) Allowed(peer netip.Addr) (bool, string) {
	peer = peer.Unmap()
	if !peer.IsValid() {
		return false, "invalid address"
	}
	best, allowed := -1, false
	for _, d := range p.deny {
		if d.Contains(peer) && d.Bits() >= best {
			best, allowed = d.Bits(), false
		}
	}
	for _, a := range p.allow {
		if a.Contains(peer) && a.Bits() > best {
			best, allowed = a.Bits(), true
		}
	}
	if best >= 0 {
		if allowed {
			return true, ""
		}
		return false, "denied by --deny-peer"
	}
	switch {
	case peer.IsLoopback():
		return false, "loopback"
	case peer.IsLinkLocalUnicast():
		return false, "link-local"
	case peer.IsMulticast() || peer.IsLinkLocalMulticast() || peer.IsInterfaceLocalMulticast():
		return false, "multicast"
	case peer.IsUnspecified():
		return false, "unspecified"
	case peer == netip.AddrFrom4([4]byte{255, 255, 255, 255}):
		return false, "broadcast"
	case p.isOwn(peer):
		return false, "an address of this node"
	case len(p.allow) > 0:
		return false, "not in --allow-peer"
	}
	return true, ""
}

func (p *PeerPolicy) isOwn(a netip.Addr) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if time.Now().After(p.ownUntil) {
		addrs, err := p.ownAddrs()
		if err != nil {
			// Keep the last known set; an empty one would open the node.
			p.log.Warn("cannot list the node's addresses", "error", err)
		} else {
			p.own = make(map[netip.Addr]bool, len(addrs))
			for _, o := range addrs {
				p.own[o] = true
			}
			p.ownUntil = time.Now().Add(ownTTL)
		}
	}
	return p.own[a]
}

// Handler is the pion/turn PermissionHandler (turn.PermissionHandler).
func (p *PeerPolicy) Handler(client net.Addr, peer net.IP) bool {
	ip, ok := netip.AddrFromSlice(peer)
	allowed, why := p.Allowed(ip)
	if !ok {
		allowed, why = false, "invalid address"
	}
	if !allowed {
		p.log.Info("permission refused", "client", client.String(), "peer", peer.String(), "reason", why)
	}
	return allowed
}
