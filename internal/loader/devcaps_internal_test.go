package loader

import (
	"net"
	"testing"

	"github.com/vishvananda/netlink"

	"github.com/l7mp/stunnerd-xdp/bpf"
)

// TestXmitNeedsRoute: the IP tunnels without a fixed remote end (tunl0, an
// NBMA GRE, sit0, ip6tnl0) get DEV_XMIT_NEEDS_ROUTE; with a remote, and any
// other device (WireGuard, VXLAN, gretap, a veth), not.
func TestXmitNeedsRoute(t *testing.T) {
	attrs := netlink.LinkAttrs{Name: "t", MTU: 1480}
	for _, c := range []struct {
		name string
		link netlink.Link
		want bool
	}{
		{"ipip/no-remote", &netlink.Iptun{LinkAttrs: attrs, Remote: net.IPv4zero}, true},
		{"ipip/remote-nil", &netlink.Iptun{LinkAttrs: attrs}, true},
		{"ipip/remote", &netlink.Iptun{LinkAttrs: attrs, Remote: net.ParseIP("192.0.2.1")}, false},
		{"gre/no-remote", &netlink.Gretun{LinkAttrs: attrs, Local: net.IPv4zero, Remote: net.IPv4zero}, true},
		{"gre/remote", &netlink.Gretun{LinkAttrs: attrs, Local: net.IPv4zero, Remote: net.ParseIP("192.0.2.1")}, false},
		{"ip6gre/no-remote", &netlink.Gretun{LinkAttrs: attrs, Remote: net.IPv6zero}, true},
		{"sit/no-remote", &netlink.Sittun{LinkAttrs: attrs, Remote: net.IPv4zero}, true},
		{"ip6tnl/no-remote", &netlink.Ip6tnl{LinkAttrs: attrs, Remote: net.IPv6zero}, true},
		{"ip6tnl/remote", &netlink.Ip6tnl{LinkAttrs: attrs, Remote: net.ParseIP("2001:db8::1")}, false},
		{"gretap/no-remote", &netlink.Gretap{LinkAttrs: attrs, Remote: net.IPv4zero}, false},
		{"wireguard", &netlink.Wireguard{LinkAttrs: attrs}, false},
		{"vxlan", &netlink.Vxlan{LinkAttrs: attrs}, false},
		{"veth", &netlink.Veth{LinkAttrs: attrs}, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			if got := xmitNeedsRoute(c.link); got != c.want {
				t.Fatalf("xmitNeedsRoute %v, want %v", got, c.want)
			}
			v := capOf(c.link, ModeOff, 0, false)
			if got := v.Flags&bpf.RelayDevFlagDEV_XMIT_NEEDS_ROUTE != 0; got != c.want || v.Mtu != 1480 {
				t.Fatalf("capOf: %+v", v)
			}
		})
	}
}

// TestRPFlags: the mode fib_validate_source applies, from the larger of
// conf.all and conf.<dev> (and, for 2, whether the device has an IPv4
// address); unknown settings and devices are strict.
func TestRPFlags(t *testing.T) {
	const strict, loose = bpf.RelayDevFlagDEV_RP_STRICT, bpf.RelayDevFlagDEV_RP_LOOSE
	for _, c := range []struct {
		name      string
		all, dev  int
		addr      bool
		want      bpf.RelayDevFlag
		unlisted  bool // the device is not in the netconf dump
		unknownRP bool // the settings could not be read
	}{
		{name: "off", all: 0, dev: 0, addr: true, want: 0},
		{name: "dev-strict", all: 0, dev: 1, addr: true, want: strict},
		{name: "dev-loose", all: 0, dev: 2, addr: true, want: loose},
		{name: "dev-loose/no-address", all: 0, dev: 2, addr: false, want: strict},
		{name: "all-loose/dev-strict", all: 2, dev: 1, addr: true, want: loose},
		{name: "all-strict/dev-off", all: 1, dev: 0, addr: true, want: strict},
		{name: "all-loose/no-address", all: 2, dev: 0, addr: false, want: strict},
		{name: "off/no-address", all: 0, dev: 0, addr: false, want: 0},
		{name: "unlisted", unlisted: true, want: strict},
		{name: "unknown", unknownRP: true, want: strict},
	} {
		t.Run(c.name, func(t *testing.T) {
			conf := &rpConf{all: c.all, dev: map[int]int{7: c.dev}, v4Addr: map[int]bool{7: c.addr}}
			if c.unlisted {
				conf.dev = map[int]int{}
			}
			if c.unknownRP {
				conf = nil
			}
			if got := conf.rpFlags(7); got != c.want {
				t.Fatalf("rpFlags %d, want %d", got, c.want)
			}
		})
	}
}
