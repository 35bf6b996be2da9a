package natcheck_test

import (
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/l7mp/stunnerd-xdp/internal/natcheck"
	"github.com/l7mp/stunnerd-xdp/test/netns"
	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// TestCheckClientRoot: a namespace with the listener 10.0.0.1:3478 and the
// client 10.0.0.2 on its loopback, and kube-proxy-like DNATs for local
// traffic: the VIP 10.96.1.1:3478 to the listener, 10.96.1.2:3478 to another
// socket (10.0.0.1:3479, standing for another node's listener).
func TestCheckClientRoot(t *testing.T) {
	if !testenv.InNetns() {
		netns.RequirePrivileged(t, "iptables")
		ns := netns.NewNS(t, "natcheck-client")
		ns.IP(t, "link", "set", "lo", "up")
		for _, a := range []string{"10.0.0.1/32", "10.0.0.2/32"} {
			ns.IP(t, "addr", "add", a, "dev", "lo")
		}
		ns.IP(t, "route", "add", "10.96.1.0/24", "dev", "lo")
		for vip, to := range map[string]string{"10.96.1.1": "10.0.0.1:3478", "10.96.1.2": "10.0.0.1:3479"} {
			ns.Run(t, "iptables", "-t", "nat", "-A", "OUTPUT", "-p", "udp", "-d", vip, "--dport", "3478",
				"-j", "DNAT", "--to-destination", to)
		}
		testenv.RunInNetns(t, ns.Name, time.Minute)
		return
	}
	client := netip.MustParseAddrPort("10.0.0.2:40000")
	listener := netip.MustParseAddrPort("10.0.0.1:3478")
	here, elsewhere := netip.MustParseAddrPort("10.96.1.1:3478"), netip.MustParseAddrPort("10.96.1.2:3478")
	c, err := net.ListenUDP("udp4", net.UDPAddrFromAddrPort(client))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	for _, vip := range []netip.AddrPort{here, elsewhere} {
		if _, err := c.WriteToUDPAddrPort([]byte("x"), vip); err != nil {
			t.Fatal(err)
		}
	}
	checker, err := natcheck.New()
	if err != nil {
		t.Fatal(err)
	}
	defer checker.Close()
	for _, tc := range []struct {
		client, wire, listener netip.AddrPort
		want                   natcheck.ClientVerdict
	}{
		{client, here, listener, natcheck.ClientHere},
		{client, here, netip.MustParseAddrPort("0.0.0.0:3478"), natcheck.ClientHere},
		{client, elsewhere, listener, natcheck.ClientElsewhere},
		{netip.MustParseAddrPort("10.0.0.2:40001"), here, listener, natcheck.ClientNone},
	} {
		if v, err := checker.CheckClient(tc.client, tc.wire, tc.listener); err != nil || v != tc.want {
			t.Errorf("CheckClient(%v, %v, %v) = %v, %v; want %v", tc.client, tc.wire, tc.listener, v, err, tc.want)
		}
	}
}
