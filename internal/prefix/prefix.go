// Package prefix parses the address prefixes every input uses (flags, the
// STUNner config's STATIC endpoints, Service CIDRs), so they all accept the
// same forms and say the same things about the ones they refuse.
package prefix

import (
	"fmt"
	"net/netip"
)

// Parse parses a CIDR or a bare address (a /32 or /128). IPv4-mapped IPv6
// forms are unmapped, and host bits set are an error: "10.0.0.1/8" is more
// likely a typo than a wish for 10.0.0.0/8.
func Parse(s string) (netip.Prefix, error) {
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
