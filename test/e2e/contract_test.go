package e2e

import (
	"encoding/binary"
	"fmt"
	"net"
	"net/netip"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/l7mp/stunnerd-xdp/test/netns"
)

// The contract tests (issue 9): deployments a node really has, each run in
// every mode (see modes). The kernel path and the userspace shortcut are
// accelerators: whatever pion/turn alone and the node's own stack do (off) is
// what the other runs must do too; native-only checks say where the packets
// were relayed.

const (
	clusterIP = "10.96.0.10"   // a Service ClusterIP kube-proxy translates to the peer
	vip       = "10.100.0.100" // a load-balancer VIP the node answers for and DNATs to the listener
)

// defaultListener is the rig's listener, admitting the peer subnet.
var defaultListener = []nodeListener{{addr: "10.100.0.1", peers: []string{"10.200.0.0/24"}}}

// checkReplySource fails the test when the client socket got datagrams from an
// address it never sent to: a reply must come from where the client's packets went.
func checkReplySource(t *testing.T, sock *clientSocket) {
	t.Helper()
	if s := sock.strays(); len(s) != 0 {
		t.Errorf("the client got datagrams from addresses it never sent to (count by source): %v", s)
	}
}

// atLeast99 fails the test unless got is at least 99 % of want.
func atLeast99(t *testing.T, what string, got, want int) {
	t.Helper()
	if want == 0 || float64(got) < 0.99*float64(want) {
		t.Errorf("%s: %d of %d, want at least 99%%", what, got, want)
	}
}

// TestContractTwoListenersOnePort: a STUNner config with two UDP listeners on
// one port and two addresses, each with a cluster of its own. One client
// address:port (one socket, as libwebrtc shares it across TURN servers)
// allocates on both, and each allocation binds channel 0x4000 (pion's first)
// to its own peer. What goes through a listener reaches only its peer, and
// deleting one allocation leaves the other relaying.
func TestContractTwoListenersOnePort(t *testing.T) {
	eachMode(t, func(t *testing.T, mode string) {
		r := netns.NewRouted(t)
		listener2 := netip.MustParseAddrPort("10.100.0.3:3478")
		r.Server.IP(t, "addr", "add", "10.100.0.3/24", "dev", r.ServerClientIf.Name)
		r.Client.IP(t, "neigh", "replace", "10.100.0.3", "lladdr", r.ServerClientIf.MAC.String(), "dev", r.ClientIf.Name, "nud", "permanent")
		r.Peer.IP(t, "addr", "add", "10.200.0.3/24", "dev", r.PeerIf.Name)
		r.Server.IP(t, "neigh", "replace", "10.200.0.3", "lladdr", r.PeerIf.MAC.String(), "dev", r.ServerPeerIf.Name, "nud", "permanent")
		startNode(t, r, mode, []nodeListener{
			{addr: "10.100.0.1", peers: []string{"10.200.0.2/32"}},
			{addr: "10.100.0.3", peers: []string{"10.200.0.3/32"}},
		})
		peers := []*udpPeer{
			startPeer(t, r.Peer, "10.200.0.2:5001", true, 0),
			startPeer(t, r.Peer, "10.200.0.3:5002", true, 0),
		}
		sessions := []*taggedSession{{peer: mustUDPAddr("10.200.0.2:5001")}, {peer: mustUDPAddr("10.200.0.3:5002")}}
		tags := []uint64{0xA1, 0xA2}

		sock := newClientSocket(t, r.Client, 0)
		relay1, err := sock.allocate(t, listenAddr)
		if err != nil {
			t.Fatalf("allocation on listener 1: %v", err)
		}
		relay2, err := sock.allocate(t, listener2)
		if err != nil {
			t.Fatalf("allocation on listener 2: %v", err)
		}

		before := scrape(t, r.Server)
		var wg sync.WaitGroup
		for i, relay := range []net.PacketConn{relay1, relay2} {
			wg.Add(1)
			go func() {
				defer wg.Done()
				sessions[i].run(t, relay, tags[i], 300, time.Second)
			}()
		}
		wg.Wait()
		after := scrape(t, r.Server)
		for i := range sessions {
			other := 1 - i
			sent := int(sessions[i].sent.Load())
			if n := peers[other].got(tags[i]); n != 0 {
				t.Errorf("%d of %d datagrams sent through listener %d reached listener %d's peer", n, sent, i+1, other+1)
			}
			atLeast99(t, fmt.Sprintf("datagrams through listener %d at its own peer", i+1), peers[i].got(tags[i]), sent)
			checkSession(t, fmt.Sprintf("listener %d", i+1), sessions[i])
		}
		checkReplySource(t, sock)
		if mode == "native" {
			if sh := kernelShare(t, before, after, "client_to_peer"); sh < 0.9 {
				t.Errorf("the kernel relayed %.0f%% of the client->peer packets of both listeners, want at least 90%%", 100*sh)
			}
		}

		// Refresh with lifetime 0 deletes listener 2's allocation; listener 1's binding relays on.
		if err := relay2.Close(); err != nil {
			t.Fatalf("deleting the allocation on listener 2: %v", err)
		}
		waitFor(t, "one allocation left", 5*time.Second, func() bool {
			return scrape(t, r.Server).get(t, "stunnerd_xdp_allocations_active") == 1
		})
		before = scrape(t, r.Server)
		s := &taggedSession{peer: mustUDPAddr("10.200.0.2:5001")}
		s.run(t, relay1, 0xA3, 300, time.Second)
		after = scrape(t, r.Server)
		atLeast99(t, "after the other allocation's deletion, datagrams through listener 1 at its peer", peers[0].got(0xA3), int(s.sent.Load()))
		if n := peers[1].got(0xA3); n != 0 {
			t.Errorf("after the deletion, %d datagrams through listener 1 reached listener 2's peer", n)
		}
		checkSession(t, "listener 1 after the deletion on listener 2", s)
		checkReplySource(t, sock)
		if mode == "native" {
			wantKernelShare(t, before, after, "after the deletion on listener 2, listener 1's")
		}
	})
}

// TestContractTransitNotRelayed: the client routes the peer subnet through
// the server, which forwards it as a router does. ChannelData on the client's
// bound channel but addressed beyond the node (the peer's address on the
// listener port) is the node's to forward, not the relay's: it reaches that
// address, never the bound peer, and the peer's replies keep coming from the
// listener address the client uses.
func TestContractTransitNotRelayed(t *testing.T) {
	eachMode(t, func(t *testing.T, mode string) {
		r := netns.NewRouted(t)
		r.Client.IP(t, "route", "add", "10.200.0.0/24", "via", r.ServerClientIf.Addr.String())
		startNode(t, r, mode, defaultListener)
		echo := startPeer(t, r.Peer, peerAddr+":5002", true, 0)
		transit := startPeer(t, r.Peer, peerAddr+":3478", false, 0)
		sock := newClientSocket(t, r.Client, 0)
		relay, err := sock.allocate(t, listenAddr)
		if err != nil {
			t.Fatal(err)
		}
		s1 := &taggedSession{}
		s1.run(t, relay, 0xB1, 300, time.Second)
		checkSession(t, "before the transit ChannelData", s1)

		// ChannelData on the bound channel (pion's first, 0x4000) carrying a
		// tagged datagram, from the client's socket to the peer's listener port.
		const transitTag, n = 0xB2, 300
		frame := make([]byte, 4+16)
		binary.BigEndian.PutUint16(frame, 0x4000)
		binary.BigEndian.PutUint16(frame[2:], 16)
		binary.BigEndian.PutUint64(frame[4:], transitTag)
		dst := mustUDPAddr(peerAddr + ":3478")
		for i := 0; i < n; i++ {
			binary.BigEndian.PutUint64(frame[12:], uint64(i))
			if _, err := sock.conn.WriteTo(frame, dst); err != nil {
				t.Fatal(err)
			}
			time.Sleep(time.Millisecond)
		}
		before := scrape(t, r.Server)
		s2 := &taggedSession{}
		s2.run(t, relay, 0xB3, 300, time.Second)
		after := scrape(t, r.Server)

		if got := echo.got(transitTag); got != 0 {
			t.Errorf("%d of %d ChannelData addressed to %v were relayed to the bound peer", got, n, dst)
		}
		atLeast99(t, "transit datagrams the node forwarded to "+dst.String(), transit.received(), n)
		checkSession(t, "after the transit ChannelData", s2)
		checkReplySource(t, sock)
		// What the kernel path passed, it passed by choice: it relays the bound session itself.
		if sh := kernelShare(t, before, after, "client_to_peer"); mode == "native" && sh < 0.9 {
			t.Errorf("the kernel relayed %.0f%% of the session's client->peer packets, want at least 90%%", 100*sh)
		}
	})
}

// TestContractClusterIPPeer: the peer is a Service ClusterIP, and the server
// has a default route, so that a packet to the ClusterIP nobody translated
// leaves the wrong way (to the peer side, which drops it). The client binds a
// channel to the ClusterIP; the echoes of 500 datagrams come back, and the
// kernel path relays none of them. Two translations: kube-proxy's iptables
// DNAT (nat OUTPUT and PREROUTING), which the daemon finds by itself in
// conntrack; and a socket load balancer as Cilium's (cgroup sendmsg/recvmsg
// hooks of the daemon's sockets), which conntrack never shows, so the Service
// range is given with --no-offload-peer. A second allocation to a peer nobody
// translates is the control: the kernel path relays it.
func TestContractClusterIPPeer(t *testing.T) {
	service := netip.MustParseAddrPort(clusterIP + ":5001")
	backend := netip.MustParseAddrPort(peerAddr + ":5001")
	for _, tc := range []struct {
		name      string
		args      []string
		translate func(t *testing.T, r *netns.Rig, daemon *netns.Proc)
	}{
		{"kube-proxy", nil, func(t *testing.T, r *netns.Rig, _ *netns.Proc) {
			for _, chain := range []string{"OUTPUT", "PREROUTING"} {
				r.Server.Run(t, "iptables", "-t", "nat", "-A", chain, "-d", service.Addr().String()+"/32", "-p", "udp",
					"--dport", strconv.Itoa(int(service.Port())), "-j", "DNAT", "--to-destination", backend.String())
			}
		}},
		{"socket-lb", []string{"--no-offload-peer=10.96.0.0/12"}, func(t *testing.T, _ *netns.Rig, daemon *netns.Proc) {
			netns.SocketLB(t, daemon.PID(), service, backend)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			eachMode(t, func(t *testing.T, mode string) {
				r := netns.NewRouted(t)
				node := startNode(t, r, mode, []nodeListener{{addr: "10.100.0.1", peers: []string{"10.96.0.0/12", "10.200.0.0/24"}}}, tc.args...)
				tc.translate(t, r, node)
				startEcho(t, r.Peer, backend)
				startPeer(t, r.Peer, peerAddr+":5002", true, 0)
				relay, err := allocateFrom(t, r.Client)
				if err != nil {
					t.Fatal(err)
				}
				peerBefore := r.Peer.Snmp(t)
				before := scrape(t, r.Server)
				s := &taggedSession{peer: net.UDPAddrFromAddrPort(service)}
				s.run(t, relay, 0xC1, 500, time.Second)
				after := scrape(t, r.Server)
				t.Logf("datagrams the peer namespace dropped as not its own (left the server untranslated): %d",
					r.Peer.Snmp(t)["Ip.InAddrErrors"]-peerBefore["Ip.InAddrErrors"])
				t.Logf("the server's conntrack:\n%s", r.Server.Run(t, "conntrack", "-L", "-p", "udp"))
				checkSession(t, "echoes through the ClusterIP", s)
				if mode == "native" {
					if x := after.grew(t, before, relayed("xdp", "client_to_peer")); x != 0 {
						t.Errorf("the kernel relayed %.0f packets to the ClusterIP", x)
					}
					if n := after.get(t, "stunnerd_xdp_bindings_offloaded"); n != 0 {
						t.Errorf("%.0f bindings to the ClusterIP are in the kernel's maps", n)
					}
				}

				// The control: a peer nobody translates, on an allocation of its own.
				plain, err := allocateFrom(t, r.Client)
				if err != nil {
					t.Fatal(err)
				}
				before = scrape(t, r.Server)
				c := &taggedSession{}
				c.run(t, plain, 0xC2, 500, 2*time.Second)
				after = scrape(t, r.Server)
				checkSession(t, "echoes from the peer nobody translates", c)
				if sh := kernelShare(t, before, after, "client_to_peer"); mode == "native" && sh < 0.9 {
					t.Errorf("the kernel relayed %.0f%% of the client->peer packets to the peer nobody translates, want at least 90%%", 100*sh)
				}
			})
		})
	}
}

// TestContractVIPToListener: the client reaches the listener through a VIP
// the node answers for (a permanent neighbour, as a MetalLB speaker's ARP
// reply makes it) and DNATs to the listener address. The session relays, the
// replies come from the VIP, and in native mode the kernel relays the client's
// ChannelData.
func TestContractVIPToListener(t *testing.T) {
	eachMode(t, func(t *testing.T, mode string) {
		r := netns.NewRouted(t)
		r.Client.IP(t, "neigh", "replace", vip, "lladdr", r.ServerClientIf.MAC.String(), "dev", r.ClientIf.Name, "nud", "permanent")
		r.Server.Run(t, "iptables", "-t", "nat", "-A", "PREROUTING", "-d", vip+"/32", "-p", "udp", "--dport", "3478",
			"-j", "DNAT", "--to-destination", listenAddr.String())
		startNode(t, r, mode, defaultListener)
		peer := startPeer(t, r.Peer, peerAddr+":5002", true, 0)
		sock := newClientSocket(t, r.Client, 0)
		relay, err := sock.allocate(t, netip.MustParseAddrPort(vip+":3478"))
		if err != nil {
			t.Fatal(err)
		}

		// The peer speaks first, on a channel bound before any ChannelData
		// of the client's arrived: the replies come from the VIP all the same.
		if _, err := relay.WriteTo(make([]byte, 16), mustUDPAddr(peerAddr+":5002")); err != nil {
			t.Fatal(err)
		}
		waitFor(t, "the channel binding", 5*time.Second, func() bool {
			return scrape(t, r.Server).get(t, "stunnerd_xdp_channels_active") == 1
		})
		time.Sleep(200 * time.Millisecond)
		drainRelay(relay, 0, 300*time.Millisecond) // the echo of the datagram that made the binding
		const first, n = 0xD0, 100
		peer.send(t, relay.LocalAddr(), first, n)
		atLeast99(t, "datagrams the peer sent first, at the client", drainRelay(relay, first, time.Second), n)
		checkReplySource(t, sock)

		before := scrape(t, r.Server)
		s := &taggedSession{}
		s.run(t, relay, 0xD1, 500, 2*time.Second)
		after := scrape(t, r.Server)
		checkSession(t, "echoes through the VIP", s)
		checkReplySource(t, sock)
		if mode == "native" {
			x := after.grew(t, before, verdict("relay_client_to_peer_tx")) + after.grew(t, before, verdict("relay_client_to_peer_redirect"))
			if sent := float64(s.sent.Load()); x < 0.9*sent {
				t.Errorf("the kernel relayed %.0f of %.0f client->peer datagrams sent to the VIP, want at least 90%%", x, sent)
			}
		}
	})
}

// TestContractTxChecksumOffload: client and peer send with tx checksum offload
// on (the veth default, as in containers): their frames carry only the
// pseudo-header sum. Relayed both ways, every datagram reaches a socket on the
// other side, whose kernel drops any with a wrong checksum.
func TestContractTxChecksumOffload(t *testing.T) {
	eachMode(t, func(t *testing.T, mode string) {
		r := netns.NewRouted(t)
		if err := r.SendersOffloadChecksums(); err != nil {
			t.Fatalf("the test needs the default: %v", err)
		}
		startNode(t, r, mode, defaultListener)
		startEcho(t, r.Peer, echoPeer)
		relay, err := allocateFrom(t, r.Client)
		if err != nil {
			t.Fatal(err)
		}
		clientBefore, peerBefore := r.Client.Snmp(t), r.Peer.Snmp(t)
		before := scrape(t, r.Server)
		s := &taggedSession{}
		s.run(t, relay, 0xE1, 500, 2*time.Second)
		after := scrape(t, r.Server)
		clientAfter, peerAfter := r.Client.Snmp(t), r.Peer.Snmp(t)
		for _, side := range []struct {
			name          string
			before, after map[string]int64
		}{{"client", clientBefore, clientAfter}, {"peer", peerBefore, peerAfter}} {
			if n := side.after["Udp.InCsumErrors"] - side.before["Udp.InCsumErrors"]; n != 0 {
				t.Errorf("the %s's kernel dropped %d datagrams with a bad UDP checksum", side.name, n)
			}
		}
		atLeast99(t, "datagrams at the peer's socket", int(peerAfter["Udp.InDatagrams"]-peerBefore["Udp.InDatagrams"]), int(s.sent.Load()))
		checkSession(t, "echoes with tx checksum offload on", s)
		if mode == "native" {
			wantKernelShare(t, before, after, "with tx checksum offload on, the")
		}
	})
}

// TestContractTTLOne: a datagram that arrives with TTL 1 is not relayed (RFC
// 8656 section 14, preferred behaviour: its TTL would reach 0), in either
// direction, on either path: the kernel path leaves them to userspace
// (pass_ttl_expired), which drops them (userspace_ttl_expired). The client
// sends with TTL 1: nothing reaches the peer. Then the client sends with the
// default TTL and the peer echoes with TTL 1: everything reaches the peer, no
// echo the client. Another port of the peer's host (under the same
// permission) sends with the default TTL: that reaches the client.
func TestContractTTLOne(t *testing.T) {
	eachMode(t, func(t *testing.T, mode string) {
		r := netns.NewRouted(t)
		startNode(t, r, mode, defaultListener)
		peer := startPeer(t, r.Peer, peerAddr+":5002", true, 1)
		other := startPeer(t, r.Peer, peerAddr+":5003", false, 0)
		sock := newClientSocket(t, r.Client, 1)
		relay, err := sock.allocate(t, listenAddr)
		if err != nil {
			t.Fatal(err)
		}
		before := scrape(t, r.Server)
		s1 := &taggedSession{}
		s1.run(t, relay, 0xF1, 300, time.Second)
		if n := peer.got(0xF1); n != 0 {
			t.Errorf("%d of %d TTL 1 datagrams from the client reached the peer", n, s1.sent.Load())
		}
		if err := setTTL(sock.conn, 64); err != nil {
			t.Fatal(err)
		}
		s2 := &taggedSession{}
		s2.run(t, relay, 0xF4, 300, time.Second)
		atLeast99(t, "TTL 64 datagrams from the client at the peer", peer.got(0xF4), int(s2.sent.Load()))
		if n := s2.received.Load(); n != 0 {
			t.Errorf("%d of the peer's TTL 1 echoes reached the client", n)
		}
		other.send(t, relay.LocalAddr(), 0xF3, 100)
		control := drainRelay(relay, 0xF3, 500*time.Millisecond)
		after := scrape(t, r.Server)
		atLeast99(t, "default-TTL datagrams from the peer's other port at the client", control, 100)
		checkReplySource(t, sock)
		expired := float64(s1.sent.Load() + int64(peer.got(0xF4)))
		if x := after.grew(t, before, "stunnerd_xdp_userspace_ttl_expired_total"); x < 0.99*expired {
			t.Errorf("userspace_ttl_expired grew by %.0f for %.0f TTL 1 datagrams", x, expired)
		}
		if mode == "native" {
			if x := after.grew(t, before, relayed("xdp", "peer_to_client")); x != 0 {
				t.Errorf("the kernel relayed %.0f peer->client packets, all with TTL 1", x)
			}
			if x := after.grew(t, before, relayed("xdp", "client_to_peer")); x > float64(s2.sent.Load()) {
				t.Errorf("the kernel relayed %.0f client->peer packets, %d of them with TTL 64", x, s2.sent.Load())
			}
			if x := after.grew(t, before, verdict("pass_ttl_expired")); x < 0.9*expired {
				t.Errorf("pass_ttl_expired grew by %.0f for %.0f TTL 1 datagrams", x, expired)
			}
		}
	})
}
