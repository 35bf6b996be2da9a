package metrics

import (
	"net"
	"net/netip"
	"testing"

	"github.com/pion/turn/v4"

	"github.com/l7mp/stunnerd-xdp/internal/channelmap"
	"github.com/l7mp/stunnerd-xdp/internal/config"
)

func udpPair(t *testing.T) (a, b net.PacketConn) {
	t.Helper()
	var err error
	if a, err = net.ListenPacket("udp4", "127.0.0.1:0"); err != nil {
		t.Fatal(err)
	}
	if b, err = net.ListenPacket("udp4", "127.0.0.1:0"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.Close(); b.Close() })
	return a, b
}

func exchange(t *testing.T, from, to net.PacketConn, payload string) {
	t.Helper()
	if _, err := from.WriteTo([]byte(payload), to.LocalAddr()); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 1500)
	if _, _, err := to.ReadFrom(buf); err != nil {
		t.Fatal(err)
	}
}

// relaySocket allocates a relay socket on loopback the way pion/turn does,
// through the listener's wrapped generator.
func relaySocket(t *testing.T, tr *Traffic, listener string) net.PacketConn {
	t.Helper()
	gen := tr.RelayAddressGenerator(listener, &turn.RelayAddressGeneratorStatic{RelayAddress: net.IPv4(127, 0, 0, 1), Address: "127.0.0.1"})
	if err := gen.Validate(); err != nil {
		t.Fatal(err)
	}
	c, _, err := gen.AllocatePacketConn("udp4", 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

var media = []config.ResolvedCluster{
	{Name: "ns/other", Peers: []netip.Prefix{netip.MustParsePrefix("10.9.0.0/16")}},
	{Name: "ns/media", Peers: []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")}},
}

// TestListenerConnCountsEveryDatagram: a listener counts all it reads and
// writes, whole datagrams, and its socket as an open connection until closed.
func TestListenerConnCountsEveryDatagram(t *testing.T) {
	tr := NewTraffic()
	tr.SetListeners([]Listener{{Name: "ns/udp", Clusters: media}})
	raw, client := udpPair(t)
	l := tr.ListenerConn("ns/udp", raw)
	exchange(t, client, l, "allocate-request") // 16 bytes in
	exchange(t, client, l, "xy")
	exchange(t, l, client, "response") // 8 bytes out
	got := tr.Totals(nil)
	want := Stats{Rx: Dir{2, 18}, Tx: Dir{1, 8}}
	if got.Listeners["ns/udp"] != want {
		t.Errorf("listener %+v, want %+v", got.Listeners["ns/udp"], want)
	}
	if got.Conns["ns/udp"] != 1 || got.ConnsTotal["ns/udp"] != 1 {
		t.Errorf("connections %d (total %d), want 1 (1)", got.Conns["ns/udp"], got.ConnsTotal["ns/udp"])
	}
	l.Close()
	l.Close()
	if got := tr.Totals(nil); got.Conns["ns/udp"] != 0 || got.ConnsTotal["ns/udp"] != 1 {
		t.Errorf("after close: connections %d (total %d), want 0 (1)", got.Conns["ns/udp"], got.ConnsTotal["ns/udp"])
	}
}

// TestRelayConnCountsByCluster: relay sockets count what goes to and comes
// from a peer under the first of the listener's clusters that has it, and
// nothing for a peer in none.
func TestRelayConnCountsByCluster(t *testing.T) {
	tr := NewTraffic()
	tr.SetListeners([]Listener{{Name: "ns/udp", Clusters: media}, {Name: "ns/bare"}})
	relay := relaySocket(t, tr, "ns/udp")
	_, peer := udpPair(t)
	exchange(t, relay, peer, "12345") // tx
	exchange(t, peer, relay, "123")   // rx
	exchange(t, peer, relay, "1")
	want := Stats{Rx: Dir{2, 4}, Tx: Dir{1, 5}}
	got := tr.Totals(nil)
	if got.Clusters["ns/media"] != want || len(got.Clusters) != 1 {
		t.Errorf("clusters %+v, want ns/media %+v only", got.Clusters, want)
	}

	// A listener without clusters: its peers count nowhere.
	exchange(t, relaySocket(t, tr, "ns/bare"), peer, "x")
	if got := tr.Totals(nil); got.Clusters["ns/media"] != want || len(got.Clusters) != 1 {
		t.Errorf("a peer in no cluster was counted: %+v", got.Clusters)
	}
}

// TestRelayConnFollowsPeerAndReload: a relay socket remembers its last
// peer's cluster, so the next datagram to another peer, or after a reload
// that moved the peer to another cluster, must count where it belongs now.
func TestRelayConnFollowsPeerAndReload(t *testing.T) {
	clusters := []config.ResolvedCluster{
		{Name: "ns/other", Peers: []netip.Prefix{netip.MustParsePrefix("127.0.0.2/32")}},
		{Name: "ns/media", Peers: []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")}},
	}
	tr := NewTraffic()
	tr.SetListeners([]Listener{{Name: "ns/udp", Clusters: clusters}})
	relay := relaySocket(t, tr, "ns/udp")
	_, peer := udpPair(t)
	other := &net.UDPAddr{IP: net.IPv4(127, 0, 0, 2), Port: 9} // ns/other; nobody listens there
	exchange(t, relay, peer, "1")
	if _, err := relay.WriteTo([]byte("22"), other); err != nil {
		t.Fatal(err)
	}
	exchange(t, relay, peer, "333")
	got := tr.Totals(nil).Clusters
	if got["ns/media"].Tx != (Dir{2, 4}) || got["ns/other"].Tx != (Dir{1, 2}) {
		t.Fatalf("before the reload: %+v, want ns/media tx {2 4}, ns/other tx {1 2}", got)
	}

	// The reload puts loopback into another cluster, listed first.
	moved := append([]config.ResolvedCluster{{Name: "ns/moved", Peers: []netip.Prefix{netip.MustParsePrefix("127.0.0.1/32")}}}, clusters...)
	tr.SetListeners([]Listener{{Name: "ns/udp", Clusters: moved}})
	exchange(t, relay, peer, "4444")
	exchange(t, peer, relay, "55555")
	got = tr.Totals(nil).Clusters
	if want := (Stats{Rx: Dir{1, 5}, Tx: Dir{1, 4}}); got["ns/moved"] != want || got["ns/media"].Tx != (Dir{2, 4}) {
		t.Errorf("after the reload: %+v, want ns/moved %+v and ns/media unchanged", got, want)
	}
}

// BenchmarkRelayConnWriteTo: the counting a relay socket adds to each
// datagram pion/turn writes to a peer (the socket underneath is a stub).
func BenchmarkRelayConnWriteTo(b *testing.B) {
	tr := NewTraffic()
	tr.SetListeners([]Listener{{Name: "ns/udp", Clusters: media}})
	c := &relayConn{PacketConn: discard{}, g: &relayGen{t: tr, listener: "ns/udp"}}
	peer := &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 9}
	p := make([]byte, 100)
	b.ReportAllocs()
	for b.Loop() {
		if _, err := c.WriteTo(p, peer); err != nil {
			b.Fatal(err)
		}
	}
}

// discard is a PacketConn whose writes all succeed.
type discard struct{ net.PacketConn }

func (discard) WriteTo(p []byte, _ net.Addr) (int, error) { return len(p), nil }

// TestStreamListenerCountsConnections: a TCP listener counts accepted
// connections, open and all-time, and their bytes.
func TestStreamListenerCountsConnections(t *testing.T) {
	tr := NewTraffic()
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	l := tr.Listener("ns/tcp", ln)
	defer l.Close()
	c, err := net.Dial("tcp4", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	s, err := l.Accept()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Write([]byte("hello")); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 5)
	if _, err := s.Read(buf); err != nil {
		t.Fatal(err)
	}
	got := tr.Totals(nil)
	if got.Listeners["ns/tcp"].Rx != (Dir{1, 5}) || got.Conns["ns/tcp"] != 1 || got.ConnsTotal["ns/tcp"] != 1 {
		t.Errorf("tcp listener %+v, connections %d/%d", got.Listeners["ns/tcp"], got.Conns["ns/tcp"], got.ConnsTotal["ns/tcp"])
	}
	s.Close()
	if got := tr.Totals(nil); got.Conns["ns/tcp"] != 0 || got.ConnsTotal["ns/tcp"] != 1 {
		t.Errorf("after close: connections %d/%d, want 0/1", got.Conns["ns/tcp"], got.ConnsTotal["ns/tcp"])
	}
}

// TestKernelAccountsInSTUNnersDirections: the kernel's client->peer traffic is
// a listener's rx (with the ChannelData header) and a cluster's tx, its
// peer->client traffic a cluster's rx and a listener's tx; the accounts name
// the listener by its socket address and the cluster by the peer.
func TestKernelAccountsInSTUNnersDirections(t *testing.T) {
	tr := NewTraffic()
	laddr := netip.MustParseAddrPort("10.0.0.1:3478")
	tr.SetListeners([]Listener{{Name: "ns/udp", Addr: laddr, Clusters: media}})
	b := channelmap.Binding{Listener: laddr, Peer: netip.MustParseAddrPort("127.0.0.9:5000")}
	acct := tr.Account(b)
	if l, c := splitAccount(acct); l != "ns/udp" || c != "ns/media" {
		t.Fatalf("account %q, want ns/udp and ns/media", acct)
	}
	got := tr.Totals(map[string]channelmap.Stats{acct: {ClientToPeerPackets: 10, ClientToPeerBytes: 1000, PeerToClientPackets: 3, PeerToClientBytes: 30}})
	if l := got.Listeners["ns/udp"]; l != (Stats{Rx: Dir{10, 1040}, Tx: Dir{3, 42}}) || got.KernelListeners["ns/udp"] != l {
		t.Errorf("listener %+v (kernel %+v)", l, got.KernelListeners["ns/udp"])
	}
	if c := got.Clusters["ns/media"]; c != (Stats{Rx: Dir{3, 30}, Tx: Dir{10, 1000}}) || got.KernelClusters["ns/media"] != c {
		t.Errorf("cluster %+v (kernel %+v)", c, got.KernelClusters["ns/media"])
	}
}
