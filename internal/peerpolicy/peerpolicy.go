// Package peerpolicy decides which peers TURN clients may relay to: the
// allow and deny prefixes, the clusters' allowlists, and the internal and
// special-purpose networks refused unless opened.
package peerpolicy

import (
	"log/slog"
	"net"
	"net/netip"
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// Policy decides which peers clients may get permissions for. It runs in
// pion/turn's permission handler, so a refused peer never gets a permission
// or a channel and never reaches the XDP maps: neither path relays to it.
//
// The rules, in order:
//  1. the most specific --deny-peer or allow prefix that contains the peer
//     decides; on a tie, deny;
//  2. peers on loopback, link-local (169.254.0.0/16, fe80::/10: cloud metadata
//     lives there), multicast, unspecified or broadcast addresses, in internal
//     and special-purpose networks (RFC 1918, 100.64.0.0/10, 198.18.0.0/15,
//     fc00::/7), in the cluster's networks (Learned: its Service CIDRs) and
//     the node's own addresses are refused unless an allow prefix INSIDE that
//     range admits them (--allow-peer 10.0.0.0/8 or a cluster endpoint
//     10.244.1.7/32 does, 0.0.0.0/0 does not): a TURN server is a gateway
//     from the internet into the node's networks (RFC 8656 section 21);
//  3. with an allowlist (STUNner clusters, or --allow-peer), a peer no allow
//     prefix contains is refused; without one it is allowed.
type Policy struct {
	allow, deny []netip.Prefix
	allowlist   bool
	learned     *Learned
	log         *slog.Logger
	// ownAddrs lists the node's addresses; refreshed at most every ownTTL.
	ownAddrs func() ([]netip.Addr, error)

	mu       sync.Mutex
	own      map[netip.Addr]bool
	ownUntil time.Time
}

const ownTTL = 5 * time.Second

// New builds a policy from allow and deny prefixes. allowlist makes
// the allow prefixes the only peers admitted (it is implied by a non-empty
// allow); with allowlist and no allow prefixes every peer is refused, as
// STUNner refuses peers on a listener without routes.
// learned (may be nil) holds the cluster networks the daemon learns while it
// runs; they are refused like the fixed ranges.
func New(allow, deny []netip.Prefix, allowlist bool, learned *Learned, log *slog.Logger) *Policy {
	return &Policy{allow: allow, deny: deny, allowlist: allowlist || len(allow) > 0, learned: learned, log: log, ownAddrs: interfaceAddrs}
}

// Learned is a set of cluster networks learned at run time (the Service
// CIDRs the Kubernetes API lists), shared by every listener's policy.
type Learned struct {
	p atomic.Pointer[[]netip.Prefix]
}

// Set replaces the learned networks.
func (l *Learned) Set(ps []netip.Prefix) {
	c := slices.Clone(ps)
	l.p.Store(&c)
}

func (l *Learned) get() []netip.Prefix {
	if l == nil {
		return nil
	}
	if p := l.p.Load(); p != nil {
		return *p
	}
	return nil
}

// refusedRanges are refused by default; see Policy.
var refusedRanges = []struct {
	prefix netip.Prefix
	why    string
}{
	{netip.MustParsePrefix("127.0.0.0/8"), "loopback"},
	{netip.MustParsePrefix("::1/128"), "loopback"},
	{netip.MustParsePrefix("169.254.0.0/16"), "link-local"},
	{netip.MustParsePrefix("fe80::/10"), "link-local"},
	{netip.MustParsePrefix("224.0.0.0/4"), "multicast"},
	{netip.MustParsePrefix("ff00::/8"), "multicast"},
	{netip.MustParsePrefix("0.0.0.0/8"), "unspecified"},
	{netip.MustParsePrefix("::/128"), "unspecified"},
	{netip.MustParsePrefix("255.255.255.255/32"), "broadcast"},
	// Internal and special-purpose networks: the node's, the cluster's and
	// the provider's networks live here (IANA special-purpose registries).
	{netip.MustParsePrefix("10.0.0.0/8"), "private network (RFC 1918)"},
	{netip.MustParsePrefix("172.16.0.0/12"), "private network (RFC 1918)"},
	{netip.MustParsePrefix("192.168.0.0/16"), "private network (RFC 1918)"},
	{netip.MustParsePrefix("100.64.0.0/10"), "shared address space (RFC 6598)"},
	{netip.MustParsePrefix("198.18.0.0/15"), "benchmarking network (RFC 2544)"},
	{netip.MustParsePrefix("fc00::/7"), "unique local network (RFC 4193)"},
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
func (p *Policy) Allowed(peer netip.Addr) (bool, string) {
	return p.allowed(peer, true)
}

// Relayable reports whether datagrams to and from peer may still be relayed
// on a permission granted earlier: Allowed without the node's own addresses,
// which were refused when the permission was asked for and which a reload
// does not change. It runs per datagram, on the relay sockets, after a
// reload or a learned network changed the policy (the daemon's revocation):
// no lock, no logging.
func (p *Policy) Relayable(peer netip.Addr) bool {
	ok, _ := p.allowed(peer, false)
	return ok
}

func (p *Policy) allowed(peer netip.Addr, own bool) (bool, string) {
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
	if best >= 0 && !allowed {
		return false, "denied by --deny-peer"
	}
	for _, r := range refusedRanges {
		if r.prefix.Contains(peer) && !p.admitsInside(peer, r.prefix) {
			return false, r.why
		}
	}
	for _, r := range p.learned.get() {
		if r.Contains(peer) && !p.admitsInside(peer, r) {
			return false, "a cluster network (learned)"
		}
	}
	if own && p.isOwn(peer) && !p.admitsInside(peer, netip.PrefixFrom(peer, peer.BitLen())) {
		return false, "an address of this node"
	}
	if !allowed && p.allowlist {
		return false, "not in the allowed peers (clusters or --allow-peer)"
	}
	return true, ""
}

// admitsInside reports whether an allow prefix within the refused range r
// contains peer: only such a narrow, deliberate allow overrides a default.
func (p *Policy) admitsInside(peer netip.Addr, r netip.Prefix) bool {
	for _, a := range p.allow {
		if a.Contains(peer) && a.Bits() >= r.Bits() && r.Contains(a.Addr()) {
			return true
		}
	}
	return false
}

func (p *Policy) isOwn(a netip.Addr) bool {
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
func (p *Policy) Handler(client net.Addr, peer net.IP) bool {
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
