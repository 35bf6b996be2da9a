package ctrefresh_test

import (
	"errors"
	"net"
	"net/netip"
	"strconv"
	"testing"
	"time"

	"github.com/mdlayher/netlink"
	"github.com/ti-mo/conntrack"
	"golang.org/x/sys/unix"

	"github.com/l7mp/stunnerd-xdp/internal/channelmap"
	"github.com/l7mp/stunnerd-xdp/internal/ctrefresh"
	"github.com/l7mp/stunnerd-xdp/test/netns"
	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// The rig: one namespace with the node's addresses on its loopback and
// kube-proxy-like DNAT rules for locally generated traffic (nat OUTPUT): the
// VIP 10.96.1.1:3478 to the listener 10.0.0.1:3478, the VIP 10.96.1.2:3478 to
// another node's listener (10.0.0.9, nothing listens), and a NodePort
// 10.0.0.1:31478 to the listener (the port translated). Clients send from
// 10.0.0.2, the relay from 10.0.0.1, the peer is 10.0.0.3. UDP timeouts of 3 s
// (unreplied) and 5 s (stream), so entries expire within the test.
const (
	listenerAddr = "10.0.0.1:3478"
	vipHere      = "10.96.1.1:3478"
	vipElsewhere = "10.96.1.2:3478"
	nodePort     = "10.0.0.1:31478"
)

var short = ctrefresh.Timeouts{Unreplied: 3 * time.Second, Stream: 5 * time.Second}

func TestRefreshRoot(t *testing.T) {
	if !testenv.InNetns() {
		netns.RequirePrivileged(t, "iptables", "conntrack")
		ns := netns.NewNS(t, "ctrefresh")
		ns.IP(t, "link", "set", "lo", "up")
		for _, a := range []string{"10.0.0.1/32", "10.0.0.2/32", "10.0.0.3/32", "10.0.0.9/32"} {
			ns.IP(t, "addr", "add", a, "dev", "lo")
		}
		// The VIPs need a route before OUTPUT's DNAT reroutes to the target.
		ns.IP(t, "route", "add", "10.96.1.0/24", "dev", "lo")
		for vip, to := range map[string]string{vipHere: listenerAddr, vipElsewhere: "10.0.0.9:3478", nodePort: listenerAddr} {
			ap := netip.MustParseAddrPort(vip)
			ns.Run(t, "iptables", "-t", "nat", "-A", "OUTPUT", "-p", "udp", "-d", ap.Addr().String(),
				"--dport", strconv.Itoa(int(ap.Port())), "-j", "DNAT", "--to-destination", to)
		}
		ns.Run(t, "sysctl", "-q", "-w", "net.netfilter.nf_conntrack_udp_timeout=3", "net.netfilter.nf_conntrack_udp_timeout_stream=5")
		testenv.RunInNetns(t, ns.Name, 2*time.Minute)
		return
	}
	to, err := ctrefresh.ReadTimeouts()
	if err != nil || to != short {
		t.Fatalf("timeouts %+v, %v; want %+v", to, err, short)
	}
	conn, err := conntrack.Dial(&netlink.Config{})
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()

	listener := udp(t, listenerAddr)
	// b1 relays all along; b2, its control, went idle; b3 came through the
	// VIP that leads elsewhere; b4 relays all along through the NodePort.
	// (The replied ones first: the listener answers what it reads first.)
	b1 := flows(t, listener, vipHere, true)
	b4 := flows(t, listener, nodePort, true)
	b2 := flows(t, listener, vipHere, false)
	b3 := flows(t, listener, vipElsewhere, false)
	for _, f := range []*flow{b1, b2, b4} {
		if e := get(t, conn, f.clientTuple()); e == nil || e.Status.SeenReply() != f.replied {
			t.Fatalf("client entry %v, want one (seen reply: %v)", e, f.replied)
		}
	}
	if e := get(t, conn, b1.peerTuple()); e == nil || e.Status.SeenReply() {
		t.Fatalf("peer entry %v, want one that has seen no reply", e)
	}

	r := ctrefresh.New(ctrefresh.Config{})
	defer r.Close()
	var c2p, p2c uint64
	deadline := time.Now().Add(2*short.Stream + time.Second)
	for time.Now().Before(deadline) {
		c2p, p2c = c2p+10, p2c+10
		live := []channelmap.Live{
			{Binding: b1.binding, Stats: channelmap.Stats{ClientToPeerPackets: c2p, PeerToClientPackets: p2c}},
			{Binding: b2.binding, Stats: channelmap.Stats{ClientToPeerPackets: 7}},
			{Binding: b3.binding, Stats: channelmap.Stats{ClientToPeerPackets: c2p}},
			{Binding: b4.binding, Stats: channelmap.Stats{ClientToPeerPackets: c2p, PeerToClientPackets: p2c}},
		}
		if err := r.Round(live, to); err != nil {
			t.Fatal(err)
		}
		time.Sleep(to.Interval())
	}
	st := r.Stats()
	t.Logf("after %v: %+v", 2*short.Stream+time.Second, st)

	// b1 and b4 outlived every timeout, as flows relayed in the stack would
	// have: their entries are streams now (the peer's saw the
	// kernel-relayed replies).
	for what, tp := range map[string]conntrack.Flow{"b1's client": b1.clientTuple(), "b1's peer": b1.peerTuple(),
		"b4's client (the NodePort's)": b4.clientTuple(), "b4's peer": b4.peerTuple()} {
		e := get(t, conn, tp)
		if e == nil {
			t.Fatalf("%s entry expired while its counters advanced", what)
		}
		t.Logf("%s entry: %v, timeout %d s", what, e.Status, e.Timeout)
		if !e.Status.SeenReply() || !e.Status.Assured() || e.Timeout <= 3 || e.Timeout > 5 {
			t.Errorf("%s entry: %v, timeout %d s; want SEEN_REPLY|ASSURED and the stream timeout", what, e.Status, e.Timeout)
		}
	}
	// b2's counters stopped after the first look, and b3's entry leads to
	// another node: both expired as the kernel would have let them.
	for what, tp := range map[string]conntrack.Flow{"b2's client": b2.clientTuple(), "b2's peer": b2.peerTuple(),
		"b3's client": b3.clientTuple()} {
		if e := get(t, conn, tp); e != nil {
			t.Errorf("%s entry still there (%v, %d s): refreshed without relayed packets", what, e.Status, e.Timeout)
		}
	}
	// b3's entry was found leading elsewhere until it expired, then missing.
	if st.Elsewhere == 0 || st.Errors != 0 || st.PeerMissing != 0 {
		t.Errorf("stats %+v: want entries found elsewhere (b3), no errors, no peer entry missing", st)
	}

	// kube-proxy deletes the entries of an endpoint it removed (conntrack
	// -D --orig-dst VIP --reply-src endpoint): the refresher does not bring
	// them back.
	if err := conn.Delete(b1.clientTuple()); err != nil {
		t.Fatal(err)
	}
	live := []channelmap.Live{{Binding: b1.binding, Stats: channelmap.Stats{ClientToPeerPackets: c2p + 1, PeerToClientPackets: p2c + 1}}}
	if err := r.Round(live, to); err != nil {
		t.Fatal(err)
	}
	if e := get(t, conn, b1.clientTuple()); e != nil {
		t.Errorf("the deleted client entry is back: %v", e)
	}
	if e := get(t, conn, b1.peerTuple()); e == nil {
		t.Errorf("b1's peer entry is gone")
	}
	if after := r.Stats(); after.ClientMissing != st.ClientMissing+1 {
		t.Errorf("stats %+v: want the missing client entry counted", after)
	}

	// The cost of a refresh, in this process's CPU time (wall time on a
	// shared machine says little): a look-up and an update of one entry,
	// and the blind update of a stream by its reply tuple.
	const n = 2000
	cpu := func() time.Duration {
		var ru unix.Rusage
		_ = unix.Getrusage(unix.RUSAGE_SELF, &ru)
		return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
	}
	e := get(t, conn, b1.peerTuple())
	for _, m := range []struct {
		what string
		do   func() error
	}{
		{"look-up and update", func() error {
			e, err := conn.Get(b1.peerTuple())
			if err != nil {
				return err
			}
			return conn.Update(conntrack.Flow{TupleOrig: e.TupleOrig, TupleReply: e.TupleReply, Timeout: 5})
		}},
		{"blind update", func() error { return conn.Update(conntrack.Flow{TupleReply: e.TupleReply, Timeout: 5}) }},
	} {
		start, wall := cpu(), time.Now()
		for i := 0; i < n; i++ {
			if err := m.do(); err != nil {
				t.Fatalf("%s: %v", m.what, err)
			}
		}
		t.Logf("a refresh by %s costs %v of CPU, %v of wall time", m.what, (cpu()-start)/n, time.Since(wall)/n)
	}
}

// flow is one binding's sockets: the client's traffic to a VIP, and the
// relay's to the peer, both seen by conntrack.
type flow struct {
	binding         channelmap.Binding
	client, relay   netip.AddrPort
	wire, peer      netip.AddrPort
	replied         bool
	clientC, relayC *net.UDPConn
}

// flows makes the conntrack entries pion's first packets would: the client
// sends to vip (a reply from the listener when replied), the relay sends to
// the peer.
func flows(t *testing.T, listener *net.UDPConn, vip string, replied bool) *flow {
	t.Helper()
	f := &flow{clientC: udp(t, "10.0.0.2:0"), relayC: udp(t, "10.0.0.1:0"), wire: netip.MustParseAddrPort(vip), replied: replied}
	f.client, f.relay = f.clientC.LocalAddr().(*net.UDPAddr).AddrPort(), f.relayC.LocalAddr().(*net.UDPAddr).AddrPort()
	f.peer = netip.AddrPortFrom(netip.MustParseAddr("10.0.0.3"), f.relay.Port())
	send(t, f.clientC, f.wire)
	if replied {
		buf := make([]byte, 64)
		_ = listener.SetReadDeadline(time.Now().Add(2 * time.Second))
		_, from, err := listener.ReadFromUDPAddrPort(buf)
		if err != nil {
			t.Fatalf("listener: %v", err)
		}
		send(t, listener, from)
	}
	send(t, f.relayC, f.peer)
	f.binding = channelmap.Binding{Client: f.client, Listener: netip.MustParseAddrPort(listenerAddr), Channel: 0x4000,
		Peer: f.peer, Relay: f.relay, ReplySource: f.wire.Addr(), ReplyPort: f.wire.Port()}
	return f
}

func (f *flow) clientTuple() conntrack.Flow { return tupleOf(f.client, f.wire) }
func (f *flow) peerTuple() conntrack.Flow   { return tupleOf(f.relay, f.peer) }

func tupleOf(src, dst netip.AddrPort) conntrack.Flow {
	return conntrack.NewFlow(unix.IPPROTO_UDP, 0, src.Addr(), dst.Addr(), src.Port(), dst.Port(), 0, 0)
}

func udp(t *testing.T, addr string) *net.UDPConn {
	t.Helper()
	c, err := net.ListenUDP("udp4", net.UDPAddrFromAddrPort(netip.MustParseAddrPort(addr)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func send(t *testing.T, c *net.UDPConn, to netip.AddrPort) {
	t.Helper()
	if _, err := c.WriteToUDPAddrPort([]byte("first"), to); err != nil {
		t.Fatalf("send to %v: %v", to, err)
	}
}

// get returns the entry of the tuple, nil when there is none.
func get(t *testing.T, conn *conntrack.Conn, q conntrack.Flow) *conntrack.Flow {
	t.Helper()
	e, err := conn.Get(q)
	if errors.Is(err, unix.ENOENT) {
		return nil
	}
	if err != nil {
		t.Fatal(err)
	}
	return &e
}
