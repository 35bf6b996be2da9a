package e2e

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/pion/stun/v3"
	"github.com/pion/turn/v4"

	"github.com/l7mp/stunnerd-xdp/internal/config"
	"github.com/l7mp/stunnerd-xdp/test/netns"
	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// otherNode is the DNAT's second endpoint: another node's listener, reached
// through the peer side, where nothing listens on 3478 (a request DNATed there
// gets no answer, where a node without the allocation would answer 437).
var otherNode = peerAddr + ":3478"

// TestConntrackKeptAliveForKernelRelayedMedia (issue 23, item 3): the VIP in
// front of the node is DNATed, as kube-proxy does for a Service with two
// endpoints, to this node's listener and to another node (twoEndpointVIP:
// the first new flow to the VIP comes here, the second goes to the other
// node; UDP conntrack timeouts of 3 s and 5 s). A pion/turn client allocates
// through the VIP, binds a channel and sends media for 22 s, echoed by the
// peer, then refreshes its allocation: the Refresh
// meets the client's conntrack entry made by the Allocate, which must still
// be there, and reaches this node. With pion alone (off) the media pass
// netfilter and keep the entry alive; in native mode the kernel relays them
// and the daemon refreshes the entry from the binding counters. Without that
// the entry expires after 5 s and the Refresh, a new flow, is DNATed to the
// other node, every time.
func TestConntrackKeptAliveForKernelRelayedMedia(t *testing.T) {
	eachMode(t, func(t *testing.T, mode string) {
		r := twoEndpointVIP(t)
		startNode(t, r, mode, defaultListener)
		up := time.Now()
		peer := startPeer(t, r.Peer, peerAddr+":5002", true, 0)
		client, relay := boundThroughVIP(t, r, mode)

		t.Logf("media start %v after the node came up", time.Since(up).Round(time.Millisecond))
		before := scrape(t, r.Server)
		s := &taggedSession{peer: mustUDPAddr(peerAddr + ":5002")}
		s.run(t, relay, 0xF1, 100, 22*time.Second)
		after := scrape(t, r.Server)
		checkSession(t, "media through the VIP", s)
		t.Logf("peer got %d datagrams; kernel share c2p %.3f p2c %.3f; conntrack refreshes %.0f",
			peer.received(), kernelShare(t, before, after, "client_to_peer"), kernelShare(t, before, after, "peer_to_client"),
			after["stunnerd_xdp_conntrack_refreshed_total"]-before["stunnerd_xdp_conntrack_refreshed_total"])
		if mode == "native" {
			wantKernelShare(t, before, after, "media through the VIP")
		}

		// The entry the Allocate made still leads here, and so does the
		// relay's to the peer.
		entries := clientEntries(t, r)
		t.Logf("client entries after the media: %q", entries)
		if len(entries) != 1 || !strings.Contains(entries[0], "src="+listenAddr.Addr().String()) {
			t.Errorf("client entries after %v of media %q: want the Allocate's, DNATed to this node", 22*time.Second, entries)
		}
		if out := r.Server.Run(t, "conntrack", "-L", "-p", "udp", "--orig-src", "10.200.0.1", "--orig-dst", peerAddr); !strings.Contains(out, "dport=5002") {
			t.Errorf("no relay->peer entry after the media: %q", out)
		}

		refreshed := time.Now()
		defer func() { t.Logf("the Refresh took %v", time.Since(refreshed).Round(time.Millisecond)) }()
		if err := refresh(client, server()); err != nil {
			t.Errorf("Refresh through the VIP after %v of media: %v", 22*time.Second, err)
			t.Logf("the server's conntrack:\n%s", r.Server.Run(t, "conntrack", "-L", "-p", "udp"))
		}
	})
}

// TestConntrackFlushedLikeKubeProxy: on the same rig, kube-proxy's cleanup
// for an endpoint it removed (this node's: conntrack -D --orig-dst VIP
// --reply-src listener, as pkg/proxy/conntrack's filterForNAT) deletes the
// client's entry while media flow. The daemon does not bring it back: the
// client's next request meets the DNAT rules afresh, goes to the other node,
// and the Refresh fails, as it does with pion alone (off), where the next
// ChannelData already went there. In native mode the deletion takes the
// binding out of the kernel's maps (issue 35), so the client's ChannelData
// meet the DNAT too and go there as well: at most flushSlack of them come
// back, in every mode.
func TestConntrackFlushedLikeKubeProxy(t *testing.T) {
	eachMode(t, func(t *testing.T, mode string) {
		r := twoEndpointVIP(t)
		startNode(t, r, mode, defaultListener)
		startPeer(t, r.Peer, peerAddr+":5002", true, 0)
		client, relay := boundThroughVIP(t, r, mode)
		s := &taggedSession{peer: mustUDPAddr(peerAddr + ":5002")}
		s.run(t, relay, 0xF2, 100, 2*time.Second)
		checkSession(t, "media before the flush", s)

		before := scrape(t, r.Server)
		r.Server.Run(t, "conntrack", "-D", "-p", "udp", "--orig-dst", vip, "--reply-src", listenAddr.Addr().String())
		after := &taggedSession{peer: mustUDPAddr(peerAddr + ":5002")}
		after.run(t, relay, 0xF3, 100, 3*time.Second) // several looks of the refresher
		m := scrape(t, r.Server)
		entries := clientEntries(t, r)
		deleted := `stunnerd_xdp_bindings_evicted_total{reason="conntrack_deleted"}`
		t.Logf("after the flush: %d of %d datagrams echoed; client entries %q; bindings evicted for a deleted entry %.0f",
			after.received.Load(), after.sent.Load(), entries, m.grew(t, before, deleted))
		for _, e := range entries {
			if strings.Contains(e, "src="+listenAddr.Addr().String()) {
				t.Errorf("an entry leading here after kube-proxy deleted it: %q", e)
			}
		}
		// What the kernel relays between the deletion and the eviction (100 a second: 300 ms).
		const flushSlack = 30
		if n := after.received.Load(); n > flushSlack {
			t.Errorf("%d datagrams echoed after the client's entry was deleted, want at most %d: the stack sends them to the other node", n, flushSlack)
		}
		if mode == "native" {
			if m.grew(t, before, deleted) == 0 {
				t.Errorf("%s did not grow: the binding stayed in the kernel's maps", deleted)
			}
			if n := m.get(t, `stunnerd_xdp_bindings_userspace{reason="client_conntrack"}`); n != 1 {
				t.Errorf("bindings kept in userspace for their client's entry: %.0f, want 1 (its new entry leads elsewhere)", n)
			}
		}
		if err := refresh(client, server()); err == nil {
			t.Errorf("the Refresh after the flush succeeded: the allocation survived a flush that pion alone does not survive")
		} else {
			t.Logf("the Refresh after the flush: %v", err)
		}
	})
}

// server is the VIP the clients allocate through.
func server() netip.AddrPort { return netip.MustParseAddrPort(vip + ":3478") }

// boundThroughVIP allocates through the VIP (the Allocate's entry must lead
// to this node), binds a channel to the echo peer and waits until the
// binding is in the kernel (native) or pion holds it.
func boundThroughVIP(t *testing.T, r *netns.Rig, mode string) (*turn.Client, net.PacketConn) {
	t.Helper()
	client, relay := allocateThrough(t, r, server())
	if e := clientEntries(t, r); len(e) != 1 || !strings.Contains(e[0], "src="+listenAddr.Addr().String()) {
		t.Fatalf("client entries after the Allocate %q: want one, DNATed to this node's listener", e)
	}
	// pion's client binds a channel on its first datagram to the peer.
	if _, err := relay.WriteTo(make([]byte, 16), mustUDPAddr(peerAddr+":5002")); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the channel binding", 5*time.Second, func() bool {
		return scrape(t, r.Server).get(t, "stunnerd_xdp_channels_active") == 1
	})
	if mode == "native" {
		waitFor(t, "the binding in the kernel", 5*time.Second, func() bool {
			return scrape(t, r.Server).get(t, "stunnerd_xdp_bindings_offloaded") == 1
		})
	}
	drainRelay(relay, 0, 300*time.Millisecond)
	return client, relay
}

// twoEndpointVIP builds the rig with the VIP in front of the node DNATed to
// two endpoints, this node's listener and otherNode: with -m statistic --mode
// nth (kube-proxy's --mode random, made deterministic) the 1st, 3rd... new
// flows to the VIP come here, the 2nd goes to the other node. The server
// namespace's UDP conntrack timeouts are 3 s (unreplied) and 5 s (stream).
func twoEndpointVIP(t *testing.T) *netns.Rig {
	t.Helper()
	r := netns.NewRouted(t)
	r.Client.IP(t, "neigh", "replace", vip, "lladdr", r.ServerClientIf.MAC.String(), "dev", r.ClientIf.Name, "nud", "permanent")
	// every 2, packet 0: the 1st, 3rd... new flows come here, the 2nd
	// goes on to the other node (measured: packet 1 sends the 1st on).
	r.Server.Run(t, "iptables", "-t", "nat", "-A", "PREROUTING", "-d", vip+"/32", "-p", "udp", "--dport", "3478",
		"-m", "statistic", "--mode", "nth", "--every", "2", "--packet", "0", "-j", "DNAT", "--to-destination", listenAddr.String())
	r.Server.Run(t, "iptables", "-t", "nat", "-A", "PREROUTING", "-d", vip+"/32", "-p", "udp", "--dport", "3478",
		"-j", "DNAT", "--to-destination", otherNode)
	r.Server.Run(t, "sysctl", "-q", "-w", "net.netfilter.nf_conntrack_udp_timeout=3",
		"net.netfilter.nf_conntrack_udp_timeout_stream=5")
	return r
}

// allocateThrough allocates on the TURN server at server from a socket of its
// own in the client namespace, and returns the client too (to send its own requests).
func allocateThrough(t *testing.T, r *netns.Rig, server netip.AddrPort) (*turn.Client, net.PacketConn) {
	t.Helper()
	c, relay, err := testenv.AllocateClient(t, &turn.ClientConfig{
		TURNServerAddr: server.String(), STUNServerAddr: server.String(),
		Username: user, Password: password, Realm: config.DefaultRealm, Conn: listenUDP(t, r.Client, "10.100.0.2:0", 0),
	})
	if err != nil {
		t.Logf("the server's conntrack:\n%s", r.Server.Run(t, "conntrack", "-L", "-p", "udp"))
		t.Fatalf("allocate through %v: %v", server, err)
	}
	return c, relay
}

// clientEntries lists the server's conntrack entries of flows to the VIP.
func clientEntries(t *testing.T, r *netns.Rig) []string {
	t.Helper()
	out := r.Server.Run(t, "conntrack", "-L", "-p", "udp", "--orig-dst", vip)
	var lines []string
	for _, l := range strings.Split(out, "\n") {
		if strings.Contains(l, "dport=3478") {
			lines = append(lines, strings.TrimSpace(l))
		}
	}
	return lines
}

// refresh sends a Refresh request for the client's allocation as pion's
// client does (a first request for the nonce, then the authenticated one)
// and returns an error unless it succeeds.
func refresh(c *turn.Client, server netip.AddrPort) error {
	to := net.UDPAddrFromAddrPort(server)
	lifetime := make([]byte, 4)
	binary.BigEndian.PutUint32(lifetime, 600)
	life := stun.RawAttribute{Type: stun.AttrLifetime, Value: lifetime}
	req := stun.NewType(stun.MethodRefresh, stun.ClassRequest)
	res, err := c.PerformTransaction(stun.MustBuild(stun.TransactionID, req, life, stun.Fingerprint), to, false)
	if err != nil {
		return fmt.Errorf("refresh without credentials: %w", err)
	}
	var nonce stun.Nonce
	if err := nonce.GetFrom(res.Msg); err != nil {
		return fmt.Errorf("refresh without credentials: no nonce in %v", res.Msg)
	}
	res, err = c.PerformTransaction(stun.MustBuild(stun.TransactionID, req, life,
		stun.NewUsername(user), stun.NewRealm(config.DefaultRealm), nonce,
		stun.NewLongTermIntegrity(user, config.DefaultRealm, password), stun.Fingerprint), to, false)
	if err != nil {
		return fmt.Errorf("refresh: %w", err)
	}
	if res.Msg.Type.Class != stun.ClassSuccessResponse {
		var code stun.ErrorCodeAttribute
		_ = code.GetFrom(res.Msg)
		return errors.New("refresh: " + code.String())
	}
	return nil
}
