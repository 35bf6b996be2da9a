package peerpolicy

import (
	"errors"
	"io"
	"log/slog"
	"net/netip"
	"testing"

	"github.com/l7mp/stunnerd-xdp/internal/prefix"
)

func prefixes(t *testing.T, ss ...string) []netip.Prefix {
	var out []netip.Prefix
	for _, s := range ss {
		p, err := prefix.Parse(s)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, p)
	}
	return out
}

func TestPeerPolicy(t *testing.T) {
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	own := func() ([]netip.Addr, error) {
		return []netip.Addr{netip.MustParseAddr("10.0.0.5"), netip.MustParseAddr("192.0.2.1")}, nil
	}
	for _, c := range []struct {
		name        string
		allow, deny []string
		allowlist   bool
		peer        string
		want        bool
	}{
		{name: "public peer", peer: "198.51.100.7", want: true},
		{name: "private peer", peer: "10.1.2.3", want: false},
		{name: "private 172.16/12", peer: "172.20.0.1", want: false},
		{name: "private 192.168/16", peer: "192.168.1.1", want: false},
		{name: "shared address space", peer: "100.64.0.1", want: false},
		{name: "benchmarking network", peer: "198.19.0.1", want: false},
		{name: "unique local v6", peer: "fd00::1", want: false},
		{name: "4-in-6 private", peer: "::ffff:10.1.2.3", want: false},
		{name: "just outside 172.16/12", peer: "172.32.0.1", want: true},
		{name: "just outside 100.64/10", peer: "100.128.0.1", want: true},
		{name: "allow inside a private range opens it", allow: []string{"10.0.0.0/8"}, peer: "10.1.2.3", want: true},
		{name: "a cluster endpoint opens its address", allow: []string{"10.244.1.7/32"}, peer: "10.244.1.7", want: true},
		{name: "a cluster endpoint opens no other", allow: []string{"10.244.1.7/32"}, peer: "10.244.1.8", want: false},
		{name: "allow-any does not open private ranges", allow: []string{"0.0.0.0/0"}, peer: "192.168.1.1", want: false},
		{name: "allow-any v6 does not open ULA", allow: []string{"::/0"}, peer: "fd00::1", want: false},
		{name: "learned service network refused", peer: "10.96.0.10", want: false},
		{name: "a wide private allow does not open the service network", allow: []string{"10.0.0.0/8"}, peer: "10.96.0.10", want: false},
		{name: "an allow inside the service network opens it", allow: []string{"10.96.0.10/32"}, peer: "10.96.0.10", want: true},
		{name: "a public learned network is refused too", peer: "203.0.113.9", want: false},
		{name: "cloud metadata", peer: "169.254.169.254", want: false},
		{name: "ipv6 link-local", peer: "fe80::1", want: false},
		{name: "loopback", peer: "127.0.0.1", want: false},
		{name: "loopback v6", peer: "::1", want: false},
		{name: "4-in-6 loopback", peer: "::ffff:127.0.0.1", want: false},
		{name: "multicast", peer: "224.0.0.251", want: false},
		{name: "multicast v6", peer: "ff02::1", want: false},
		{name: "unspecified", peer: "0.0.0.0", want: false},
		{name: "broadcast", peer: "255.255.255.255", want: false},
		{name: "node's own address", peer: "10.0.0.5", want: false},
		{name: "own address allowed explicitly", allow: []string{"10.0.0.5"}, peer: "10.0.0.5", want: true},
		{name: "metadata allowed explicitly", allow: []string{"169.254.169.254/32"}, peer: "169.254.169.254", want: true},
		{name: "allowlist admits", allow: []string{"10.200.0.0/16"}, peer: "10.200.3.4", want: true},
		{name: "allowlist refuses the rest", allow: []string{"10.200.0.0/16"}, peer: "198.51.100.7", want: false},
		{name: "deny", deny: []string{"198.51.100.0/24"}, peer: "198.51.100.7", want: false},
		{name: "more specific allow beats deny", allow: []string{"198.51.100.7"}, deny: []string{"198.51.100.0/24"}, peer: "198.51.100.7", want: true},
		{name: "more specific deny beats allow", allow: []string{"10.0.0.0/8"}, deny: []string{"10.9.0.0/16"}, peer: "10.9.1.1", want: false},
		{name: "allow-any does not open link-local", allow: []string{"0.0.0.0/0"}, peer: "169.254.169.254", want: false},
		{name: "allow-any does not open loopback", allow: []string{"0.0.0.0/0"}, peer: "127.0.0.1", want: false},
		{name: "a wide allow does not open the node", allow: []string{"10.0.0.0/8"}, peer: "10.0.0.5", want: false},
		{name: "allow-any admits the rest", allow: []string{"0.0.0.0/0"}, peer: "198.51.100.7", want: true},
		{name: "empty allowlist refuses all", allowlist: true, peer: "198.51.100.7", want: false},
		{name: "tie goes to deny", allow: []string{"10.9.0.0/16"}, deny: []string{"10.9.0.0/16"}, peer: "10.9.1.1", want: false},
	} {
		t.Run(c.name, func(t *testing.T) {
			learned := new(Learned)
			learned.Set(prefixes(t, "10.96.0.0/12", "203.0.113.0/24"))
			p := New(prefixes(t, c.allow...), prefixes(t, c.deny...), c.allowlist, learned, quiet)
			p.ownAddrs = own
			if got, why := p.Allowed(netip.MustParseAddr(c.peer)); got != c.want {
				t.Fatalf("Allowed(%s) = %v (%s), want %v", c.peer, got, why, c.want)
			}
		})
	}
}

func TestPeerPolicyKeepsOwnAddressesWhenListingFails(t *testing.T) {
	p := New(nil, nil, false, nil, slog.New(slog.NewTextHandler(io.Discard, nil)))
	calls := 0
	p.ownAddrs = func() ([]netip.Addr, error) {
		calls++
		if calls == 1 {
			return []netip.Addr{netip.MustParseAddr("10.0.0.5")}, nil
		}
		return nil, errors.New("netlink down")
	}
	if ok, _ := p.Allowed(netip.MustParseAddr("10.0.0.5")); ok {
		t.Fatal("own address allowed")
	}
	p.ownUntil = p.ownUntil.Add(-ownTTL * 2) // force a refresh, which fails
	if ok, _ := p.Allowed(netip.MustParseAddr("10.0.0.5")); ok {
		t.Fatal("own address allowed after a failed refresh")
	}
}
