package destinations

import (
	"maps"
	"net/netip"
	"testing"
)

func TestCompute(t *testing.T) {
	ap := netip.MustParseAddrPort
	a := netip.MustParseAddr
	var (
		spec1    = ap("10.0.0.1:3478")
		spec3    = ap("10.0.0.3:3478")
		wild4    = ap("0.0.0.0:3478")
		wild6    = ap("[::]:3478")
		nodeAddr = []netip.Addr{a("10.0.0.1"), a("10.0.0.2"), a("10.0.0.3"), a("127.0.0.1"),
			a("fd00::1"), a("fe80::1%eth0"), a("::1")}
	)
	for _, tc := range []struct {
		name      string
		listeners []netip.AddrPort
		local     []netip.Addr
		learned   []Learned
		want      Table
	}{
		{name: "nothing", local: nodeAddr, want: Table{}},
		{name: "specific listener accepts its own address only",
			listeners: []netip.AddrPort{spec1}, local: nodeAddr,
			want: Table{spec1: spec1}},
		{name: "two specific listeners share a port",
			listeners: []netip.AddrPort{spec1, spec3}, local: nodeAddr,
			want: Table{spec1: spec1, spec3: spec3}},
		{name: "specific listener on an address the node lacks (nonlocal bind)",
			listeners: []netip.AddrPort{ap("192.0.2.1:3478")}, local: nodeAddr,
			want: Table{ap("192.0.2.1:3478"): ap("192.0.2.1:3478")}},
		{name: "IPv4 wildcard takes the IPv4 addresses but loopback",
			listeners: []netip.AddrPort{wild4}, local: nodeAddr,
			want: Table{spec1: wild4, ap("10.0.0.2:3478"): wild4, spec3: wild4}},
		{name: "IPv6 wildcard takes the IPv6 addresses but loopback, zones dropped",
			listeners: []netip.AddrPort{wild6}, local: nodeAddr,
			want: Table{ap("[fd00::1]:3478"): wild6, ap("[fe80::1]:3478"): wild6}},
		{name: "a specific bind on the wildcard's port owns its address",
			listeners: []netip.AddrPort{wild4, spec1}, local: nodeAddr,
			want: Table{spec1: spec1, ap("10.0.0.2:3478"): wild4, spec3: wild4}},
		{name: "a specific bind on another port leaves the wildcard's alone",
			listeners: []netip.AddrPort{wild4, ap("10.0.0.1:3479")}, local: nodeAddr,
			want: Table{spec1: wild4, ap("10.0.0.2:3478"): wild4, spec3: wild4, ap("10.0.0.1:3479"): ap("10.0.0.1:3479")}},
		{name: "both wildcards",
			listeners: []netip.AddrPort{wild4, wild6}, local: []netip.Addr{a("10.0.0.2"), a("fd00::1")},
			want: Table{ap("10.0.0.2:3478"): wild4, ap("[fd00::1]:3478"): wild6}},
		{name: "mapped, duplicate and invalid inputs",
			listeners: []netip.AddrPort{ap("[::ffff:10.0.0.1]:3478"), spec1, {}, ap("10.0.0.9:0"), ap("[::ffff:0.0.0.0]:3478")},
			local:     []netip.Addr{a("::ffff:10.0.0.2"), {}},
			want:      Table{spec1: spec1, ap("10.0.0.2:3478"): wild4}},
		{name: "loopback and multicast listeners are never reached from the wire",
			listeners: []netip.AddrPort{ap("127.0.0.1:3478"), ap("[::1]:3478"), ap("224.0.0.1:3478")}, local: nodeAddr,
			want: Table{}},
		{name: "no local addresses: the wildcard accepts nothing",
			listeners: []netip.AddrPort{wild4}, want: Table{}},

		{name: "VIP learned for a specific listener",
			listeners: []netip.AddrPort{spec1}, local: nodeAddr,
			learned: []Learned{{Dest: ap("192.0.2.10:3478"), Listener: spec1}},
			want:    Table{spec1: spec1, ap("192.0.2.10:3478"): spec1}},
		{name: "VIP learned for a wildcard listener",
			listeners: []netip.AddrPort{wild4}, local: []netip.Addr{a("10.0.0.2")},
			learned: []Learned{{Dest: ap("192.0.2.10:3478"), Listener: wild4}},
			want:    Table{ap("10.0.0.2:3478"): wild4, ap("192.0.2.10:3478"): wild4}},
		{name: "learned entries the XDP program cannot use are ignored",
			listeners: []netip.AddrPort{spec1}, local: nodeAddr,
			learned: []Learned{
				{Dest: ap("192.0.2.10:0"), Listener: spec1},             // no port
				{Dest: ap("192.0.2.11:3478"), Listener: spec3},          // no such listener
				{Dest: ap("[fd00::10]:3478"), Listener: spec1},          // another family
				{Dest: ap("127.0.0.2:3478"), Listener: spec1},           // loopback
				{Dest: ap("[::ffff:192.0.2.12]:3478"), Listener: spec1}, // mapped: unmapped and kept
			},
			want: Table{spec1: spec1, ap("192.0.2.12:3478"): spec1}},
		{name: "a VIP learned for two listeners goes to userspace",
			listeners: []netip.AddrPort{spec1, spec3}, local: nodeAddr,
			learned: []Learned{
				{Dest: ap("192.0.2.10:3478"), Listener: spec1},
				{Dest: ap("192.0.2.10:3478"), Listener: spec3},
				{Dest: ap("192.0.2.11:3478"), Listener: spec3},
			},
			want: Table{spec1: spec1, spec3: spec3, ap("192.0.2.11:3478"): spec3}},
		{name: "a local address DNATed to another listener goes to userspace",
			listeners: []netip.AddrPort{spec1, spec3}, local: nodeAddr,
			learned: []Learned{{Dest: spec1, Listener: spec3}},
			want:    Table{spec3: spec3}},
		{name: "a wildcard's address DNATed to a specific listener goes to userspace",
			listeners: []netip.AddrPort{wild4, spec1}, local: nodeAddr,
			learned: []Learned{{Dest: ap("10.0.0.2:3478"), Listener: spec1}},
			want:    Table{spec1: spec1, spec3: wild4}},
		{name: "a NodePort learned for a wildcard listener",
			listeners: []netip.AddrPort{wild4}, local: []netip.Addr{a("10.0.0.2")},
			learned: []Learned{{Dest: ap("10.0.0.2:31478"), Listener: wild4}, {Dest: ap("192.0.2.10:443"), Listener: wild4}},
			want:    Table{ap("10.0.0.2:3478"): wild4, ap("10.0.0.2:31478"): wild4, ap("192.0.2.10:443"): wild4}},
		{name: "a NodePort on another listener's port at an address it takes goes to userspace",
			listeners: []netip.AddrPort{wild4, ap("0.0.0.0:3479")}, local: []netip.Addr{a("10.0.0.2")},
			learned: []Learned{{Dest: ap("10.0.0.2:3479"), Listener: wild4}},
			want:    Table{ap("10.0.0.2:3478"): wild4}},
		{name: "a VIP on another listener's port at an address it does not take",
			listeners: []netip.AddrPort{wild4, ap("10.0.0.3:3479")}, local: []netip.Addr{a("10.0.0.2"), a("10.0.0.3")},
			learned: []Learned{{Dest: ap("192.0.2.10:3479"), Listener: wild4}},
			want: Table{ap("10.0.0.2:3478"): wild4, spec3: wild4, ap("10.0.0.3:3479"): ap("10.0.0.3:3479"),
				ap("192.0.2.10:3479"): wild4}},
		{name: "a learned entry agreeing with the static one changes nothing",
			listeners: []netip.AddrPort{wild4}, local: []netip.Addr{a("10.0.0.2"), a("10.0.0.3")},
			learned: []Learned{{Dest: ap("10.0.0.2:3478"), Listener: wild4}},
			want:    Table{ap("10.0.0.2:3478"): wild4, spec3: wild4}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := Compute(tc.listeners, tc.local, tc.learned)
			if !maps.Equal(got, tc.want) {
				t.Errorf("Compute() = %v\nwant %v", got, tc.want)
			}
		})
	}
}
