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
		{name: "private peer", peer: "10.1.2.3", want: true},
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
			p := New(prefixes(t, c.allow...), prefixes(t, c.deny...), c.allowlist, quiet)
			p.ownAddrs = own
			if got, why := p.Allowed(netip.MustParseAddr(c.peer)); got != c.want {
				t.Fatalf("Allowed(%s) = %v (%s), want %v", c.peer, got, why, c.want)
			}
		})
	}
}

func TestPeerPolicyKeepsOwnAddressesWhenListingFails(t *testing.T) {
	p := New(nil, nil, false, slog.New(slog.NewTextHandler(io.Discard, nil)))
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
