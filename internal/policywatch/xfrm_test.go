package policywatch

import (
	"net/netip"
	"testing"
)

func TestPoliciesRefuse(t *testing.T) {
	relay := netip.MustParseAddrPort("192.168.77.10:50000")
	peer := netip.MustParseAddrPort("192.168.77.11:5002")
	host := func(a netip.AddrPort) netip.Prefix { return netip.PrefixFrom(a.Addr(), 32) }
	any4 := netip.MustParsePrefix("0.0.0.0/0")
	for _, c := range []struct {
		name   string
		ps     Policies
		local  netip.AddrPort
		refuse bool
	}{
		{"none", nil, relay, false},
		{"block out", Policies{{Dir: DirOut, Src: host(relay), Dst: host(peer), Block: true}}, relay, true},
		{"block in", Policies{{Dir: DirIn, Src: host(peer), Dst: host(relay), Block: true}}, relay, true},
		{"block in, the wrong way round", Policies{{Dir: DirIn, Src: host(relay), Dst: host(peer), Block: true}}, relay, false},
		{"block fwd", Policies{{Dir: DirFwd, Src: any4, Dst: any4, Block: true}}, relay, false},
		{"ipsec out", Policies{{Dir: DirOut, Src: any4, Dst: host(peer), Templates: 2}}, relay, true},
		{"bypass", Policies{{Dir: DirOut, Src: any4, Dst: any4}}, relay, false},
		{"any family", Policies{{Dir: DirOut, Block: true}}, relay, true},
		{"other prefix", Policies{{Dir: DirOut, Src: any4, Dst: netip.MustParsePrefix("10.0.0.0/8"), Block: true}}, relay, false},
		{"IPv6 policy", Policies{{Dir: DirOut, Src: netip.MustParsePrefix("::/0"), Dst: netip.MustParsePrefix("::/0"), Block: true}}, relay, false},
		{"TCP only", Policies{{Dir: DirOut, Proto: 6, Block: true}}, relay, false},
		{"UDP", Policies{{Dir: DirOut, Proto: 17, Block: true}}, relay, true},
		{"the peer's port", Policies{{Dir: DirOut, DstPort: 5002, DstPortMask: 0xffff, Block: true}}, relay, true},
		{"another port", Policies{{Dir: DirOut, DstPort: 5003, DstPortMask: 0xffff, Block: true}}, relay, false},
		{"a port range by mask", Policies{{Dir: DirOut, SrcPort: 49152, SrcPortMask: 0xc000, Block: true}}, relay, true},
		{"bypass before block", Policies{{Dir: DirOut, Priority: 10, Block: true}, {Dir: DirOut, Priority: 5}}, relay, false},
		{"block before bypass", Policies{{Dir: DirOut, Priority: 5, Block: true}, {Dir: DirOut, Priority: 10}}, relay, true},
		{"same priority", Policies{{Dir: DirOut, Priority: 5}, {Dir: DirOut, Priority: 5, Block: true}}, relay, true},
		{"wildcard local", Policies{{Dir: DirOut, Src: netip.MustParsePrefix("192.168.77.99/32"), Block: true}},
			netip.MustParseAddrPort("0.0.0.0:50000"), true},
		{"refuse all", Policies{RefuseAll}, relay, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			if _, got := c.ps.Refuses(c.local, peer); got != c.refuse {
				t.Fatalf("Refuses(%v, %v) = %v, want %v", c.local, peer, got, c.refuse)
			}
		})
	}
}
