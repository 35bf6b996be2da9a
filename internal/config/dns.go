package config

import (
	"context"
	"fmt"
	"net/netip"
	"slices"
	"sync"
	"time"
)

// DNSInterval is how often STRICT_DNS names are resolved again, as stunnerd's
// resolver does (net.Resolver does not tell the records' TTL).
const DNSInterval = 5 * time.Second

// Resolver looks names up; *net.Resolver is one.
type Resolver interface {
	LookupNetIP(ctx context.Context, network, host string) ([]netip.Addr, error)
}

// DNSCache resolves the STRICT_DNS endpoints of a configuration. A name that
// fails to resolve keeps the addresses it last had (a DNS hiccup must not cut
// a live peer off); a name never resolved admits nothing.
type DNSCache struct {
	res  Resolver
	mu   sync.Mutex
	last map[string][]netip.Addr
}

// NewDNSCache returns a cache over res.
func NewDNSCache(res Resolver) *DNSCache {
	return &DNSCache{res: res, last: map[string][]netip.Addr{}}
}

// HasDNS reports whether any listener routes to a STRICT_DNS cluster.
func (r *Resolved) HasDNS() bool {
	for _, l := range r.Listeners {
		if len(l.DNSNames) > 0 {
			return true
		}
	}
	return false
}

// Apply returns a copy of r whose listeners admit the current addresses of
// their STRICT_DNS names (on every port), and the lookups that failed.
func (c *DNSCache) Apply(ctx context.Context, r *Resolved) (*Resolved, []error) {
	out := *r
	out.Listeners = slices.Clone(r.Listeners)
	var errs []error
	resolved := map[string][]netip.Addr{}
	for i, l := range out.Listeners {
		if len(l.DNSNames) == 0 {
			continue
		}
		l.AllowPeers, l.PeerPorts = slices.Clone(l.AllowPeers), slices.Clone(l.PeerPorts)
		for _, name := range l.DNSNames {
			addrs, ok := resolved[name]
			if !ok {
				var err error
				if addrs, err = c.lookup(ctx, name); err != nil {
					errs = append(errs, err)
				}
				resolved[name] = addrs
			}
			for _, a := range addrs {
				p := netip.PrefixFrom(a, a.BitLen())
				l.AllowPeers = append(l.AllowPeers, p)
				l.PeerPorts = append(l.PeerPorts, Endpoint{Prefix: p, MinPort: 1, MaxPort: 65535})
			}
		}
		out.Listeners[i] = l
	}
	return &out, errs
}

func (c *DNSCache) lookup(ctx context.Context, name string) ([]netip.Addr, error) {
	ctx, cancel := context.WithTimeout(ctx, DNSInterval)
	defer cancel()
	addrs, err := c.res.LookupNetIP(ctx, "ip", name)
	c.mu.Lock()
	defer c.mu.Unlock()
	if err != nil {
		return c.last[name], fmt.Errorf("STRICT_DNS %q: %w (keeping its last %d addresses)", name, err, len(c.last[name]))
	}
	for i, a := range addrs {
		addrs[i] = a.Unmap()
	}
	slices.SortFunc(addrs, netip.Addr.Compare)
	addrs = slices.Compact(addrs)
	c.last[name] = addrs
	return addrs, nil
}
