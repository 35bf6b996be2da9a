package e2e

import (
	"encoding/binary"
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/l7mp/stunnerd-xdp/test/netns"
	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// The next-hop cache's twin tests (issue 23): a cached next hop follows what
// the node's routing says now, as pion/turn's sends through the stack do.

// farPeer is a peer address on the peer's host that the server reaches
// through a gateway (the peer's host, 10.200.0.2) rather than on the link.
const farPeer = "10.201.0.2"

// farListener admits the rig's peers and the far peer.
var farListener = []nodeListener{{addr: "10.100.0.1", peers: []string{"10.200.0.0/24", "10.201.0.0/24"}}}

// farRig builds the rig with the far peer on the peer's host, lets routes
// set the server's routes to it, starts the node and an echoing peer at
// farPeer:5002, and allocates on the listener.
func farRig(t *testing.T, mode string, routes func(r *netns.Rig)) (*netns.Rig, *udpPeer, *clientSocket, net.PacketConn) {
	t.Helper()
	r := netns.NewRouted(t)
	r.Peer.IP(t, "addr", "add", farPeer+"/32", "dev", r.PeerIf.Name)
	routes(r)
	startNode(t, r, mode, farListener)
	peer := startPeer(t, r.Peer, farPeer+":5002", true, 0)
	sock := newClientSocket(t, r.Client, 0)
	relay, err := sock.allocate(t, listenAddr)
	if err != nil {
		t.Fatal(err)
	}
	return r, peer, sock, relay
}

// TestContractNexthopDeleted: the route to the far peer goes through a
// nexthop object; a less specific route sends the far peer's subnet to the
// client's side, whose host drops what is not its own. Deleting the nexthop
// object removes the route (with no route notification): from then on,
// datagrams to the far peer leave toward the client's side, in every mode,
// and none reaches the peer through the deleted next hop.
func TestContractNexthopDeleted(t *testing.T) {
	eachMode(t, func(t *testing.T, mode string) {
		r, peer, sock, relay := farRig(t, mode, func(r *netns.Rig) {
			r.Server.IP(t, "nexthop", "add", "id", "7", "via", r.PeerIf.Addr.String(), "dev", r.ServerPeerIf.Name)
			r.Server.IP(t, "route", "add", farPeer+"/32", "nhid", "7")
			r.Server.IP(t, "route", "add", "10.201.0.0/24", "via", r.ClientIf.Addr.String(), "dev", r.ServerClientIf.Name)
		})
		s := &taggedSession{peer: mustUDPAddr(farPeer + ":5002")}
		before := scrape(t, r.Server)
		s.run(t, relay, 0xB1, 300, time.Second)
		after := scrape(t, r.Server)
		checkSession(t, "through the nexthop object", s)
		if mode == "native" {
			wantKernelShare(t, before, after, "through the nexthop object, the")
		}

		r.Server.IP(t, "nexthop", "del", "id", "7")
		time.Sleep(200 * time.Millisecond)
		s2 := &taggedSession{peer: mustUDPAddr(farPeer + ":5002")}
		s2.run(t, relay, 0xB2, 300, time.Second)
		if n := peer.got(0xB2); n != 0 {
			t.Errorf("%d of %d datagrams sent after the nexthop's deletion reached the peer through it", n, s2.sent.Load())
		}
		checkReplySource(t, sock)
	})
}

// TestContractPMTUException: the far peer is behind a gateway route. Large
// datagrams (1,300 bytes of data) flow both ways, then a router on the path
// reports an MTU of 1,200 toward the far peer (ICMP fragmentation needed about
// the relay socket's datagrams): the kernel makes a path-MTU exception. The
// large datagrams sent after it still reach the peer (the stack fragments
// them, DF or not, as pion's socket does), and the kernel path no longer
// relays them: they pass to userspace as pass_fib_frag_needed.
func TestContractPMTUException(t *testing.T) {
	eachMode(t, func(t *testing.T, mode string) {
		r, peer, sock, relay := farRig(t, mode, func(r *netns.Rig) {
			r.Server.IP(t, "route", "add", "10.201.0.0/24", "via", r.PeerIf.Addr.String(), "dev", r.ServerPeerIf.Name)
		})
		to := mustUDPAddr(farPeer + ":5002")
		big := func(tag uint64, n int) int {
			msg := make([]byte, 1300)
			binary.BigEndian.PutUint64(msg, tag)
			for i := 0; i < n; i++ {
				if _, err := relay.WriteTo(msg, to); err != nil {
					t.Fatal(err)
				}
				time.Sleep(2 * time.Millisecond)
			}
			return drainRelay(relay, tag, 500*time.Millisecond)
		}
		before := scrape(t, r.Server)
		echoed := big(0xC1, 300)
		after := scrape(t, r.Server)
		atLeast99(t, "large datagrams at the peer before the exception", peer.got(0xC1), 300)
		atLeast99(t, "large echoes at the client before the exception", echoed, 300)
		if mode == "native" {
			wantKernelShare(t, before, after, "large datagrams before the exception, the")
		}

		src := netip.MustParseAddrPort(relay.LocalAddr().String())
		if err := r.Peer.Do(func() error {
			return testenv.SendICMP(src.Addr(), testenv.FragNeeded(src, netip.MustParseAddrPort(to.String()), 1200))
		}); err != nil {
			t.Fatal(err)
		}
		time.Sleep(200 * time.Millisecond)
		if route := r.Server.IP(t, "route", "get", farPeer); !strings.Contains(route, "mtu 1200") {
			t.Fatalf("no path-MTU exception after the ICMP error: %s", route)
		}

		before = scrape(t, r.Server)
		echoed = big(0xC2, 100)
		after = scrape(t, r.Server)
		atLeast99(t, "large datagrams at the peer after the exception", peer.got(0xC2), 100)
		atLeast99(t, "large echoes at the client after the exception", echoed, 100)
		if mode == "native" {
			if x := after.grew(t, before, relayed("xdp", "client_to_peer")); x != 0 {
				t.Errorf("the kernel relayed %.0f client->peer datagrams above the path MTU", x)
			}
			if x := after.grew(t, before, verdict("pass_fib_frag_needed")); x < 99 {
				t.Errorf("pass_fib_frag_needed grew by %.0f for 100 datagrams above the path MTU", x)
			}
		}
		checkReplySource(t, sock)
	})
}
