package natcheck_test

import (
	"net"
	"net/netip"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/pion/turn/v4"

	"github.com/l7mp/stunnerd-xdp/internal/natcheck"
	"github.com/l7mp/stunnerd-xdp/test/netns"
	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// The rig: a server namespace whose default route leads to a peer namespace,
// as on a node:
//
//	Server srv0 10.210.0.1/24 (+ 10.210.0.9) <-> peer0 10.210.0.2/24 Peer; default via 10.210.0.2
//
// With nat rules (as kube-proxy's): the ClusterIP 10.96.0.10:5001 is DNATed in
// OUTPUT to 10.210.0.2:5001, and what goes to 10.210.0.3 is SNATed to
// 10.210.0.9; a VIP 10.96.1.50 in front of the relay address is DNATed in
// PREROUTING to 10.210.0.1 (the peer routes 10.96.1.0/24 to the server). The
// pion/turn server runs in the server namespace (the test re-executes itself
// there), relays from 10.210.0.1, and its client talks to it over loopback.
const (
	relayIP   = "10.210.0.1"
	clusterIP = "10.96.0.10:5001"
	plainPeer = "10.210.0.2:5002"
	snatPeer  = "10.210.0.3:5003"
	relayVIP  = "10.96.1.50"

	peerNSEnv = "NATCHECK_PEER_NS"
)

func TestCheckRoot(t *testing.T) {
	if !testenv.InNetns() {
		netns.RequirePrivileged(t, "iptables")
	}
	for _, scenario := range []struct {
		name  string
		nat   bool
		child func(*testing.T)
	}{
		{"nat", true, checkWithNAT},
		// No rules: conntrack is not hooked into the namespace.
		{"no-nat", false, checkWithoutNAT},
	} {
		t.Run(scenario.name, func(t *testing.T) {
			if testenv.InNetns() {
				scenario.child(t)
				return
			}
			srv, peer := netns.NewNS(t, "nat-srv"), netns.NewNS(t, "nat-peer")
			srv.IP(t, "link", "add", "srv0", "type", "veth", "peer", "name", "peer0", "netns", peer.Name)
			srv.IP(t, "addr", "add", relayIP+"/24", "dev", "srv0")
			srv.IP(t, "addr", "add", "10.210.0.9/24", "dev", "srv0")
			peer.IP(t, "addr", "add", "10.210.0.2/24", "dev", "peer0")
			srv.IP(t, "link", "set", "srv0", "up")
			peer.IP(t, "link", "set", "peer0", "up")
			srv.IP(t, "route", "add", "default", "via", "10.210.0.2")
			if scenario.nat {
				srv.Run(t, "iptables", "-t", "nat", "-A", "OUTPUT", "-p", "udp", "-d", "10.96.0.10", "--dport", "5001",
					"-j", "DNAT", "--to-destination", "10.210.0.2:5001")
				srv.Run(t, "iptables", "-t", "nat", "-A", "POSTROUTING", "-p", "udp", "-d", "10.210.0.3",
					"-j", "SNAT", "--to-source", "10.210.0.9")
				srv.Run(t, "iptables", "-t", "nat", "-A", "PREROUTING", "-p", "udp", "-d", relayVIP,
					"-j", "DNAT", "--to-destination", relayIP)
				peer.IP(t, "route", "add", "10.96.1.0/24", "via", relayIP)
			}
			testenv.RunInNetns(t, srv.Name, time.Minute, peerNSEnv+"="+peer.Name)
		})
	}
}

// relayTo starts a pion/turn server and a client allocation; send makes pion
// relay one datagram to a peer, as it does for the client's first ChannelData.
func relayTo(t *testing.T) (relay netip.AddrPort, send func(peer string)) {
	t.Helper()
	listener, err := net.ListenPacket("udp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv, err := turn.NewServer(turn.ServerConfig{
		Realm: "natcheck",
		AuthHandler: func(username, realm string, _ net.Addr) ([]byte, bool) {
			return turn.GenerateAuthKey(username, realm, "p"), true
		},
		PacketConnConfigs: []turn.PacketConnConfig{{
			PacketConn: listener,
			RelayAddressGenerator: &turn.RelayAddressGeneratorStatic{
				RelayAddress: net.ParseIP(relayIP), Address: relayIP,
			},
		}},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = srv.Close() })
	conn, err := net.ListenPacket("udp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	rc, err := testenv.Allocate(t, &turn.ClientConfig{
		TURNServerAddr: listener.LocalAddr().String(), STUNServerAddr: listener.LocalAddr().String(),
		Username: "u", Password: "p", Realm: "natcheck", Conn: conn,
	})
	if err != nil {
		t.Fatalf("allocate: %v", err)
	}
	relay = rc.LocalAddr().(*net.UDPAddr).AddrPort()
	return relay, func(peer string) {
		t.Helper()
		if _, err := rc.WriteTo([]byte("first"), net.UDPAddrFromAddrPort(netip.MustParseAddrPort(peer))); err != nil {
			t.Fatalf("relay to %s: %v", peer, err)
		}
	}
}

// check asks the checker about relay->peer until the verdict is not Unknown
// (pion's datagram is on its way) or 5 s have passed.
func check(t *testing.T, c *natcheck.Checker, relay netip.AddrPort, peer string) natcheck.Result {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		r, err := c.Check(relay, netip.MustParseAddrPort(peer))
		if err != nil {
			t.Fatalf("Check(%v, %s): %v", relay, peer, err)
		}
		if r.Verdict != natcheck.Unknown || time.Now().After(deadline) {
			return r
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func newChecker(t *testing.T) *natcheck.Checker {
	t.Helper()
	c, err := natcheck.New()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return c
}

func checkWithNAT(t *testing.T) {
	relay, send := relayTo(t)
	c := newChecker(t)
	for _, tc := range []struct {
		peer, want, why string
	}{
		{clusterIP, "nat", "DNAT"},
		{plainPeer, "direct", "not translated"},
		// pion's flow source NATed (to 10.210.0.9): translatable, from there.
		{snatPeer, "snat", "source NAT of the relay to 10.210.0.9:"},
	} {
		// The allocation's own TURN traffic is tracked, so before pion relays
		// anything there is no evidence either way.
		if r, err := c.Check(relay, netip.MustParseAddrPort(tc.peer)); err != nil || r.Verdict != natcheck.Unknown {
			t.Fatalf("%s before pion's first datagram: %v (%s), %v; want unknown", tc.peer, r.Verdict, r.Why, err)
		}
		send(tc.peer)
		r := check(t, c, relay, tc.peer)
		t.Logf("%s: %v (%s)", tc.peer, r.Verdict, r.Why)
		if r.Verdict.String() != tc.want || !strings.HasPrefix(r.Why, tc.why) {
			t.Errorf("%s after pion's first datagram: %v (%s); want %s (%s...)", tc.peer, r.Verdict, r.Why, tc.want, tc.why)
		}
		if r.Verdict == natcheck.Translated && r.Wire.Addr() != netip.MustParseAddr("10.210.0.9") {
			t.Errorf("%s: translated to %v, want 10.210.0.9", tc.peer, r.Wire)
		}
	}

	// The peer sends first: straight to the relay address, or to a VIP the
	// node DNATs to it (pion's replies would then leave from the VIP).
	peerNS := &netns.NS{Name: os.Getenv(peerNSEnv)}
	for _, tc := range []struct {
		peer, to, want, why string
	}{
		{"10.210.0.2:6001", relay.String(), "direct", "not translated"},
		{"10.210.0.2:6002", netip.AddrPortFrom(netip.MustParseAddr(relayVIP), relay.Port()).String(), "nat", "DNAT"},
	} {
		if err := peerNS.Do(func() error {
			conn, err := net.ListenUDP("udp4", net.UDPAddrFromAddrPort(netip.MustParseAddrPort(tc.peer)))
			if err != nil {
				return err
			}
			defer conn.Close()
			_, err = conn.WriteToUDPAddrPort([]byte("peer first"), netip.MustParseAddrPort(tc.to))
			return err
		}); err != nil {
			t.Fatalf("send from %s to %s: %v", tc.peer, tc.to, err)
		}
		r := check(t, c, relay, tc.peer)
		t.Logf("%s first, to %s: %v (%s)", tc.peer, tc.to, r.Verdict, r.Why)
		if r.Verdict.String() != tc.want || !strings.HasPrefix(r.Why, tc.why) {
			t.Errorf("%s sent first to %s: %v (%s); want %s (%s...)", tc.peer, tc.to, r.Verdict, r.Why, tc.want, tc.why)
		}
	}
}

func checkWithoutNAT(t *testing.T) {
	relay, send := relayTo(t)
	c := newChecker(t)
	for _, sent := range []bool{false, true} {
		if sent {
			send(plainPeer)
			time.Sleep(100 * time.Millisecond)
		}
		r, err := c.Check(relay, netip.MustParseAddrPort(plainPeer))
		if err != nil || r.Verdict != natcheck.Direct {
			t.Fatalf("sent=%v: %v (%s), %v; want direct", sent, r.Verdict, r.Why, err)
		}
		t.Logf("sent=%v: %v (%s)", sent, r.Verdict, r.Why)
	}
}
