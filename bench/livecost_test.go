package bench

import (
	"fmt"
	"io"
	"log/slog"
	"net/netip"
	"os"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/l7mp/stunnerd-xdp/bpf"
	"github.com/l7mp/stunnerd-xdp/internal/channelmap"
	"github.com/l7mp/stunnerd-xdp/internal/loader"
	"github.com/l7mp/stunnerd-xdp/test/netns"
	"github.com/l7mp/stunnerd-xdp/test/packet"
)

var liveCostNames = []string{liveC2P4, liveP2C4, liveC2P6, liveP2C6, liveC2P4Full, liveP2C4Full, liveC2P4NoFlow, liveP2C4NoFlow,
	liveC2P4NoCache, liveP2C4NoCache, liveC2P4Rate, liveP2C4Rate, liveC2P4RateDrop, liveParse, liveLookups, liveFIB,
	liveC2P4Active1k, liveC2P4Active8k, liveC2P4Active1kNoFlow, liveC2P4Active8kNoFlow}

// underLimit is a rate limit far above rate: both buckets are checked and
// charged on every packet, and none is over.
func underLimit(rate float64) channelmap.RateLimit {
	return channelmap.RateLimit{PacketsPerSecond: uint64(100 * rate), BytesPerSecond: uint64(100 * rate * 1500)}
}

// liveSender is the datagrams of one socket, or of several in turn: payload
// to dst.
type liveSender struct {
	fds     []int
	dst     unix.Sockaddr
	payload []byte
}

// send sends for dur at rate packets/s, in bursts of a millisecond's worth.
func (s liveSender) send(rate float64, dur time.Duration) (sent uint64) {
	start := time.Now()
	for {
		el := time.Since(start)
		if el >= dur {
			return sent
		}
		due := rate*el.Seconds() - float64(sent)
		if due < 1 {
			time.Sleep(time.Duration((1 - due) / rate * float64(time.Second)))
			continue
		}
		for i := 0; i < int(due) && i < 256; i++ {
			if unix.Sendto(s.fds[sent%uint64(len(s.fds))], s.payload, unix.MSG_DONTWAIT, s.dst) == nil {
				sent++
			}
		}
	}
}

// liveRow is one row of the stage: who sends, where it lands, what it counts.
type liveRow struct {
	name      string
	sender    liveSender
	floorNS   *netns.NS // where the trivial program runs on the relayed frames (nil: not relayed)
	floorIf   string
	reason    string
	offloadNS *netns.NS // sender namespace and interface whose tx checksum offload goes off for the row
	offloadIf string
	noCache   bool                 // the next-hop and flow caches off for the row (FIB generation 0)
	noFlow    bool                 // the program without flow caches for the row
	rateLimit channelmap.RateLimit // set for the row, off after it
}

// udpSocket opens a UDP socket bound to addr in ns with a small receive buffer
// (the relayed datagrams it receives are dropped there: the cost measured is
// the programs').
func udpSocket(t *testing.T, ns *netns.NS, addr netip.AddrPort) int {
	t.Helper()
	var fd int
	err := ns.Do(func() error {
		var (
			family = unix.AF_INET
			sa     unix.Sockaddr
		)
		if addr.Addr().Is4() {
			sa = &unix.SockaddrInet4{Port: int(addr.Port()), Addr: addr.Addr().As4()}
		} else {
			family, sa = unix.AF_INET6, &unix.SockaddrInet6{Port: int(addr.Port()), Addr: addr.Addr().As16()}
		}
		var err error
		if fd, err = unix.Socket(family, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0); err != nil {
			return err
		}
		_ = unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_RCVBUF, 4096)
		return unix.Bind(fd, sa)
	})
	if err != nil {
		t.Fatalf("netns %s: socket %v: %v", ns.Name, addr, err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	return fd
}

func sockaddrOf(a netip.AddrPort) unix.Sockaddr {
	if a.Addr().Is4() {
		return &unix.SockaddrInet4{Port: int(a.Port()), Addr: a.Addr().As4()}
	}
	return &unix.SockaddrInet6{Port: int(a.Port()), Addr: a.Addr().As16()}
}

// xdpProgOn returns the XDP program attached to iface in ns.
func xdpProgOn(ns *netns.NS, iface string) (*ebpf.Program, error) {
	var prog *ebpf.Program
	err := ns.Do(func() error {
		l, err := netlink.LinkByName(iface)
		if err != nil {
			return err
		}
		x := l.Attrs().Xdp
		if x == nil || !x.Attached || x.ProgId == 0 {
			return fmt.Errorf("no XDP program on %s", iface)
		}
		prog, err = ebpf.NewProgramFromID(ebpf.ProgramID(x.ProgId))
		return err
	})
	return prog, err
}

func statsOf(p *ebpf.Program) (progStats, error) {
	st, err := p.Stats()
	if err != nil {
		return progStats{}, err
	}
	return progStats{runTime: st.Runtime, runs: st.RunCount}, nil
}

// rigBindings returns a binding of an IPv4 and one of an IPv6 client of the
// rig (cl0/srv0 have 10.100.0.2/.1 and fd00:100::2/::1) on channel 0x4000 to
// peers on the peer subnet: client port clientPort, peer port peerPort, relay
// port relayPort; the IPv6 one uses each port plus one.
func rigBindings(clientPort, peerPort, relayPort uint16) (b4, b6 channelmap.Binding) {
	listen := netip.AddrPortFrom(netip.MustParseAddr("10.100.0.1"), uint16(listenPort))
	listen6 := netip.AddrPortFrom(netip.MustParseAddr("fd00:100::1"), uint16(listenPort))
	peer, relay := netip.MustParseAddr("10.200.0.2"), netip.MustParseAddr("10.200.0.1")
	b4 = channelmap.Binding{Client: netip.AddrPortFrom(netip.MustParseAddr("10.100.0.2"), clientPort), Listener: listen, Channel: 0x4000,
		Peer: netip.AddrPortFrom(peer, peerPort), Relay: netip.AddrPortFrom(relay, relayPort)}
	b6 = channelmap.Binding{Client: netip.AddrPortFrom(netip.MustParseAddr("fd00:100::2"), clientPort+1), Listener: listen6, Channel: 0x4000,
		Peer: netip.AddrPortFrom(peer, peerPort+1), Relay: netip.AddrPortFrom(relay, relayPort+1)}
	return b4, b6
}

// stageLiveCost measures the relay program's live cost per relayed packet per
// direction and client family, next to the trivial XDP_PASS program that the
// relayed frames meet on the receiving veth in the same interval.
func (h *harness) stageLiveCost(t *testing.T) {
	defer enableBPFStats(t).Close()
	r := h.rig
	b4, b6 := rigBindings(40100, 5103, 50100)
	listen, listen6 := b4.Listener, b6.Listener
	// A peer on the peer subnet without a neighbour entry: the lookup ends in
	// pass_fib_no_neigh every time (the stack never sends to it).
	bNoNeigh := channelmap.Binding{Client: b4.Client, Listener: listen, Channel: 0x4001,
		Peer: netip.MustParseAddrPort("10.200.0.99:5105"), Relay: netip.MustParseAddrPort("10.200.0.1:50102")}

	var prog *loader.Program
	err := r.Server.Do(func() error {
		var err error
		prog, err = loader.Load(h.liveConfig(false), slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})))
		if err != nil {
			return err
		}
		for _, ifc := range r.ServerIfaces() {
			if _, err := prog.Attach(ifc, loader.ModeNative); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = r.Server.Do(prog.Close) }()
	maps := channelmap.New(prog.Maps())
	if err := maps.SetDestinations(map[netip.AddrPort]netip.AddrPort{listen: listen, listen6: listen6}); err != nil {
		t.Fatal(err)
	}
	for _, b := range []channelmap.Binding{b4, b6, bNoNeigh} {
		if err := maps.Upsert(b); err != nil {
			t.Fatal(err)
		}
	}

	data := make([]byte, 100)
	cl4 := udpSocket(t, r.Client, b4.Client)
	cl6 := udpSocket(t, r.Client, b6.Client)
	pe4 := udpSocket(t, r.Peer, b4.Peer)
	pe6 := udpSocket(t, r.Peer, b6.Peer)
	c2p4 := liveSender{[]int{cl4}, sockaddrOf(listen), packet.ChannelData(b4.Channel, data, nil)}
	c2p6 := liveSender{[]int{cl6}, sockaddrOf(listen6), packet.ChannelData(b6.Channel, data, nil)}
	p2c4 := liveSender{[]int{pe4}, sockaddrOf(b4.Relay), data}
	p2c6 := liveSender{[]int{pe6}, sockaddrOf(b6.Relay), data}
	active1k, active8k := h.activeSender(t, maps, b4, 0, 1024, data), h.activeSender(t, maps, b4, 1024, 8192, data)
	rows := []liveRow{
		{name: liveC2P4, sender: c2p4, floorNS: r.Peer, floorIf: r.PeerIf.Name, reason: "relay_client_to_peer_redirect"},
		{name: liveP2C4, sender: p2c4, floorNS: r.Client, floorIf: r.ClientIf.Name, reason: "relay_peer_to_client_redirect"},
		{name: liveC2P6, sender: c2p6, floorNS: r.Peer, floorIf: r.PeerIf.Name, reason: "relay_client_to_peer_redirect"},
		{name: liveP2C6, sender: p2c6, floorNS: r.Client, floorIf: r.ClientIf.Name, reason: "relay_peer_to_client_redirect"},
		{name: liveC2P4Full, sender: c2p4, floorNS: r.Peer, floorIf: r.PeerIf.Name, reason: "relay_client_to_peer_redirect",
			offloadNS: r.Client, offloadIf: r.ClientIf.Name},
		{name: liveP2C4Full, sender: p2c4, floorNS: r.Client, floorIf: r.ClientIf.Name, reason: "relay_peer_to_client_redirect",
			offloadNS: r.Peer, offloadIf: r.PeerIf.Name},
		{name: liveC2P4NoFlow, sender: c2p4, floorNS: r.Peer, floorIf: r.PeerIf.Name, reason: "relay_client_to_peer_redirect",
			offloadNS: r.Client, offloadIf: r.ClientIf.Name, noFlow: true},
		{name: liveP2C4NoFlow, sender: p2c4, floorNS: r.Client, floorIf: r.ClientIf.Name, reason: "relay_peer_to_client_redirect",
			offloadNS: r.Peer, offloadIf: r.PeerIf.Name, noFlow: true},
		{name: liveC2P4NoCache, sender: c2p4, floorNS: r.Peer, floorIf: r.PeerIf.Name, reason: "relay_client_to_peer_redirect",
			offloadNS: r.Client, offloadIf: r.ClientIf.Name, noCache: true},
		{name: liveP2C4NoCache, sender: p2c4, floorNS: r.Client, floorIf: r.ClientIf.Name, reason: "relay_peer_to_client_redirect",
			offloadNS: r.Peer, offloadIf: r.PeerIf.Name, noCache: true},
		{name: liveC2P4Rate, sender: c2p4, floorNS: r.Peer, floorIf: r.PeerIf.Name, reason: "relay_client_to_peer_redirect",
			offloadNS: r.Client, offloadIf: r.ClientIf.Name, rateLimit: underLimit(h.cfg.liveRate)},
		{name: liveP2C4Rate, sender: p2c4, floorNS: r.Client, floorIf: r.ClientIf.Name, reason: "relay_peer_to_client_redirect",
			offloadNS: r.Peer, offloadIf: r.PeerIf.Name, rateLimit: underLimit(h.cfg.liveRate)},
		{name: liveC2P4RateDrop, sender: c2p4, reason: "rate_limited", offloadNS: r.Client, offloadIf: r.ClientIf.Name,
			rateLimit: channelmap.RateLimit{PacketsPerSecond: 1}},
		{name: liveParse, sender: liveSender{[]int{cl4}, sockaddrOf(netip.AddrPortFrom(listen.Addr(), 3479)), packet.ChannelData(b4.Channel, data, nil)},
			reason: "pass_not_ours"},
		{name: liveLookups, sender: liveSender{[]int{cl4}, sockaddrOf(listen), packet.ChannelData(0x4ffe, data, nil)}, reason: "pass_no_channel"},
		{name: liveFIB, sender: liveSender{[]int{cl4}, sockaddrOf(listen), packet.ChannelData(bNoNeigh.Channel, data, nil)}, reason: "pass_fib_no_neigh"},
		// Many bindings with traffic at once, each client socket in turn:
		// what the flow cache holds, and what happens beyond it.
		{name: liveC2P4Active1k, sender: active1k, floorNS: r.Peer, floorIf: r.PeerIf.Name, reason: "relay_client_to_peer_redirect"},
		{name: liveC2P4Active8k, sender: active8k, floorNS: r.Peer, floorIf: r.PeerIf.Name, reason: "relay_client_to_peer_redirect"},
		{name: liveC2P4Active1kNoFlow, sender: active1k, floorNS: r.Peer, floorIf: r.PeerIf.Name, reason: "relay_client_to_peer_redirect", noFlow: true},
		{name: liveC2P4Active8kNoFlow, sender: active8k, floorNS: r.Peer, floorIf: r.PeerIf.Name, reason: "relay_client_to_peer_redirect", noFlow: true},
	}
	// Debugging a program change: BENCH_LIVE_ROWS=relay measures only the
	// relay rows (the report is then incomplete, as with BENCH_ONLY).
	// BENCH_LIVE_ROWS=active only the rows with many bindings sending.
	// BENCH_LIVE_AB=<relay object> compares the embedded program with that
	// object (see liveAB), and writes no report either.
	ab := os.Getenv("BENCH_LIVE_AB")
	quick := os.Getenv("BENCH_LIVE_ROWS") != "" || ab != ""
	switch os.Getenv("BENCH_LIVE_ROWS") {
	case "relay":
		rows = rows[:6]
	case "active":
		rows = slices.DeleteFunc(rows, func(r liveRow) bool { return !strings.Contains(r.name, "bindings sending") })
	}
	// Replies to IPv4 and IPv6 clients come from the learned listener address:
	// let the client speak first.
	c2p4.send(2000, 50*time.Millisecond)
	c2p6.send(2000, 50*time.Millisecond)

	floors := map[string]*ebpf.Program{}
	for _, row := range rows {
		if row.floorNS == nil || floors[row.floorIf] != nil {
			continue
		}
		p, err := xdpProgOn(row.floorNS, row.floorIf)
		if err != nil {
			t.Fatal(err)
		}
		defer p.Close()
		floors[row.floorIf] = p
	}
	results := make([]LiveCostRow, len(rows))
	for i, row := range rows {
		results[i] = LiveCostRow{Name: row.name, Reason: row.reason, RatePPS: h.cfg.liveRate, Seconds: h.cfg.livePoint.Seconds()}
	}
	h.command("live program cost: %d rounds of %v per row at %.0f pps, 100 B; kernel.bpf_stats_enabled=1", h.cfg.liveRounds, h.cfg.livePoint, h.cfg.liveRate)
	measure := func(rows []liveRow, results []LiveCostRow) {
		for round := 0; round < h.cfg.liveRounds; round++ {
			for i, row := range rows {
				h.liveInterval(t, prog, maps, floors, row, &results[i])
			}
		}
	}
	if ab != "" {
		h.liveAB(t, prog, maps, floors, rows, results, ab)
		return
	}
	measure(rows, results)
	if quick {
		for i := range results {
			results[i].finish()
			t.Logf("%s: relay %.0f ns/run, trivial %.0f ns/run, %.2fx (%d runs)", results[i].Name, results[i].RelayMedianNs, results[i].FloorMedianNs, results[i].Ratio, results[i].Runs)
		}
		return
	}
	// Program cost against the number of bindings: the relay rows again with
	// 100,000 more bindings (other clients, channels, peers) in the maps.
	many := []liveRow{rows[4], rows[5]} // the full-checksum relay rows
	many[0].name, many[1].name = liveC2P4Many, liveP2C4Many
	for i := 0; i < liveManyBindings; i++ {
		b := channelmap.Binding{Client: netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 101, byte(i >> 8), byte(i)}), uint16(1024+i>>16)),
			Listener: listen, Channel: 0x4000, Peer: netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, byte(201 + i>>16), byte(i >> 8), byte(i)}), 5000),
			Relay: netip.AddrPortFrom(b4.Relay.Addr(), uint16(49152+i%16000))}
		if err := maps.Upsert(b); err != nil {
			t.Fatalf("binding %d of %d: %v", i, liveManyBindings, err)
		}
	}
	for _, row := range many {
		results = append(results, LiveCostRow{Name: row.name, Reason: row.reason, RatePPS: h.cfg.liveRate, Seconds: h.cfg.livePoint.Seconds()})
	}
	measure(many, results[len(rows):])
	for i := range results {
		res := &results[i]
		res.finish()
		// Every run of the interval must be the row's branch (a few ARP/ND or
		// MLD frames aside), else the figure is not the row's cost.
		if res.Counted*100 < res.Runs*95 {
			t.Errorf("%s: only %d of %d program runs ended in %s", res.Name, res.Counted, res.Runs, res.Reason)
		}
		t.Logf("%s: relay %.0f ns/run, trivial %.0f ns/run, %.2fx (%d runs)", res.Name, res.RelayMedianNs, res.FloorMedianNs, res.Ratio, res.Runs)
		h.rep.LiveCost = append(h.rep.LiveCost, *res)
	}
}

// liveConfig is the stage's program configuration.
func (h *harness) liveConfig(noFlow bool) loader.Config {
	return loader.Config{ListenerPorts: []uint16{uint16(listenPort)}, MinRelayPort: 49152, MaxRelayPort: 65535,
		MaxBindings: liveManyBindings + liveActiveMax + 1024, IPv6Clients: true, NoFlowCache: noFlow, Object: h.liveObject}
}

// liveAB measures each row alternately with the embedded program (A) and the
// relay object obj (B, built from other sources: `make generate`, copy
// bpf/relay_bpfel.o, restore the sources), swapped in over the same maps
// between intervals, A first in even rounds and B first in odd ones. On a
// shared machine run-to-run drift is larger than most program changes; the
// median of the paired per-interval ratios B/A resolves a few percent.
func (h *harness) liveAB(t *testing.T, prog *loader.Program, maps *channelmap.Maps, floors map[string]*ebpf.Program,
	rows []liveRow, resA []LiveCostRow, obj string) {
	resB := slices.Clone(resA)
	use := func(object string) {
		h.liveObject = object
		if err := h.rig.Server.Do(func() error { return prog.Reconfigure(h.liveConfig(false)) }); err != nil {
			t.Fatal(err)
		}
	}
	defer use("")
	for round := 0; round < h.cfg.liveRounds; round++ {
		for i, row := range rows {
			order := []string{"", obj}
			if round%2 == 1 {
				order = []string{obj, ""}
			}
			for _, object := range order {
				use(object)
				res := &resA[i]
				if object != "" {
					res = &resB[i]
				}
				h.liveInterval(t, prog, maps, floors, row, res)
			}
		}
	}
	for i := range resA {
		a, b := &resA[i], &resB[i]
		ratios := make([]float64, len(a.RelayNs))
		for k := range a.RelayNs {
			ratios[k] = b.RelayNs[k] / a.RelayNs[k]
		}
		sort.Float64s(ratios)
		a.finish()
		b.finish()
		t.Logf("A/B %s: A %.0f ns/run (%.2fx trivial), B %.0f ns/run (%.2fx); B/A median %.3f (intervals %.3f-%.3f)",
			a.Name, a.RelayMedianNs, a.Ratio, b.RelayMedianNs, b.Ratio, quantile(ratios, 0.5), ratios[0], ratios[len(ratios)-1])
	}
}

// liveActiveMax is how many bindings the active rows install in all.
const liveActiveMax = 1024 + 8192

// activeSender installs n bindings like b (client ports from 42000+first, one
// relay port each, one peer sink) and returns a sender that sends from each
// binding's client socket in turn.
func (h *harness) activeSender(t *testing.T, maps *channelmap.Maps, b channelmap.Binding, first, n int, data []byte) liveSender {
	r := h.rig
	peer := netip.AddrPortFrom(b.Peer.Addr(), 5110)
	if first == 0 {
		udpSocket(t, r.Peer, peer)
	}
	fds := make([]int, n)
	for i := range n {
		k := first + i
		nb := channelmap.Binding{Client: netip.AddrPortFrom(b.Client.Addr(), uint16(42000+k)), Listener: b.Listener, Channel: b.Channel,
			Peer: peer, Relay: netip.AddrPortFrom(b.Relay.Addr(), uint16(49152+k))}
		if err := maps.Upsert(nb); err != nil {
			t.Fatalf("active binding %d: %v", k, err)
		}
		fds[i] = udpSocket(t, r.Client, nb.Client)
	}
	return liveSender{fds, sockaddrOf(b.Listener), packet.ChannelData(b.Channel, data, nil)}
}

// liveInterval measures one interval of one row into res.
func (h *harness) liveInterval(t *testing.T, prog *loader.Program, maps *channelmap.Maps, floors map[string]*ebpf.Program, row liveRow, res *LiveCostRow) {
	if row.offloadNS != nil {
		row.offloadNS.Run(t, "ethtool", "-K", row.offloadIf, "tx", "off")
	}
	if row.noFlow {
		// The same maps under a program without flow caches, swapped in
		// through the links for the interval.
		swap := func(noFlow bool) {
			if err := h.rig.Server.Do(func() error { return prog.Reconfigure(h.liveConfig(noFlow)) }); err != nil {
				t.Fatal(err)
			}
		}
		swap(true)
		defer swap(false)
	}
	fibGen := prog.FibGen()
	if row.noCache {
		if err := fibGen.Disable(); err != nil {
			t.Fatal(err)
		}
	}
	if err := maps.SetRateLimit(row.rateLimit); err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := maps.SetRateLimit(channelmap.RateLimit{}); err != nil {
			t.Fatal(err)
		}
	}()
	row.sender.send(h.cfg.liveRate, 20*time.Millisecond) // warm up
	v0, err := maps.Verdicts()
	if err != nil {
		t.Fatal(err)
	}
	relay0, err := statsOf(prog.XDP())
	if err != nil {
		t.Fatal(err)
	}
	var floor0 progStats
	if row.floorNS != nil {
		if floor0, err = statsOf(floors[row.floorIf]); err != nil {
			t.Fatal(err)
		}
	}
	sent := row.sender.send(h.cfg.liveRate, h.cfg.livePoint)
	relay1, err := statsOf(prog.XDP())
	if err != nil {
		t.Fatal(err)
	}
	res.Sent += sent
	res.RelayNs = append(res.RelayNs, relay1.nsPerRunSince(relay0))
	res.Runs += relay1.runs - relay0.runs
	if row.floorNS != nil {
		floor1, err := statsOf(floors[row.floorIf])
		if err != nil {
			t.Fatal(err)
		}
		res.FloorNs = append(res.FloorNs, floor1.nsPerRunSince(floor0))
	}
	v1, err := maps.Verdicts()
	if err != nil {
		t.Fatal(err)
	}
	for r, n := range v1 {
		if channelmap.ReasonNames[bpf.RelayReason(r)] == row.reason && r < len(v0) {
			res.Counted += n - v0[r]
		}
	}
	if row.noCache {
		// The FIB watcher turns the cache back on at its next event: such an
		// interval measured a mix.
		var gen uint32
		if err := prog.Maps().FibGen.Lookup(uint32(0), &gen); err != nil || gen != 0 {
			t.Errorf("%s: the next-hop cache came back on during the interval (generation %d, %v)", row.name, gen, err)
		}
		if err := fibGen.Enable(); err != nil {
			t.Fatal(err)
		}
	}
	if row.offloadNS != nil {
		row.offloadNS.Run(t, "ethtool", "-K", row.offloadIf, "tx", "on")
	}
}

// finish computes the medians; the ratio is the median of the per-interval
// ratios (each interval's relay and trivial runs were side by side).
func (r *LiveCostRow) finish() {
	med := func(v []float64) float64 {
		s := append([]float64(nil), v...)
		sort.Float64s(s)
		return quantile(s, 0.5)
	}
	r.RelayMedianNs = med(r.RelayNs)
	if len(r.FloorNs) == 0 {
		return
	}
	r.FloorMedianNs = med(r.FloorNs)
	ratios := make([]float64, 0, len(r.FloorNs))
	for i := range r.FloorNs {
		if r.FloorNs[i] > 0 {
			ratios = append(ratios, r.RelayNs[i]/r.FloorNs[i])
		}
	}
	r.Ratio = med(ratios)
}

// relayMaps names every map of the relay program.
func relayMaps(pm *bpf.RelayMaps) map[string]*ebpf.Map {
	return map[string]*ebpf.Map{bpf.RelayMapBindingStates: pm.BindingStates,
		bpf.RelayMapC2pBindings: pm.C2pBindings, bpf.RelayMapP2cBindings: pm.P2cBindings, bpf.RelayMapListenerDsts: pm.ListenerDsts,
		bpf.RelayMapFibGen: pm.FibGen, bpf.RelayMapTxPorts: pm.TxPorts, bpf.RelayMapVerdicts: pm.Verdicts,
		bpf.RelayMapAllocRates: pm.AllocRates, bpf.RelayMapRateLimits: pm.RateLimits,
		bpf.RelayMapC2pFlows: pm.C2pFlows, bpf.RelayMapP2cFlows: pm.P2cFlows}
}

// stageMemory loads the program with the maps sized for 100k, the default
// 131,072 and 1M bindings and reads what the kernel charges for each map on
// this machine; for 64 CPUs the per-CPU maps' share is scaled (computed).
func (h *harness) stageMemory(t *testing.T) {
	ncpu, err := ebpf.PossibleCPU()
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range []uint32{100000, 131072, 1000000} {
		prog, err := loader.Load(loader.Config{ListenerPorts: []uint16{uint16(listenPort)}, MinRelayPort: 49152, MaxRelayPort: 65535,
			MaxBindings: n}, slog.New(slog.NewTextHandler(io.Discard, nil)))
		if err != nil {
			t.Fatal(err)
		}
		measured := MemoryRow{Bindings: n, CPUs: ncpu, Maps: map[string]uint64{}, Measured: true}
		computed := MemoryRow{Bindings: n, CPUs: 64, Maps: map[string]uint64{}}
		for name, m := range relayMaps(prog.Maps()) {
			b := uint64(memlock(m))
			if memlock(m) < 0 {
				t.Fatalf("%s: no memlock figure", name)
			}
			measured.Maps[name], measured.Total = b, measured.Total+b
			switch {
			case m.Type() == ebpf.PerCPUArray || m.Type() == ebpf.PerCPUHash:
				// The per-CPU share: entries × value size (rounded to 8) per CPU.
				b += uint64(64-ncpu) * uint64(m.MaxEntries()) * uint64((m.ValueSize()+7)&^7)
			case name == bpf.RelayMapC2pFlows || name == bpf.RelayMapP2cFlows:
				// A region per possible CPU.
				b += uint64(64-ncpu) * uint64(m.MaxEntries()/uint32(ncpu)) * uint64(m.ValueSize())
			}
			computed.Maps[name], computed.Total = b, computed.Total+b
		}
		prog.Close()
		t.Logf("%d bindings: %.1f MiB on %d CPUs, %.1f MiB on 64 CPUs", n, float64(measured.Total)/(1<<20), ncpu, float64(computed.Total)/(1<<20))
		h.rep.Memory = append(h.rep.Memory, measured, computed)
	}
}

// stageMapOps times every binding write while the maps fill to 100,000
// bindings and empty again: the control plane's rate and tail at scale.
func (h *harness) stageMapOps(t *testing.T) {
	const n = liveManyBindings
	prog, err := loader.Load(loader.Config{ListenerPorts: []uint16{uint16(listenPort)}, MinRelayPort: 49152, MaxRelayPort: 65535,
		MaxBindings: 131072}, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	defer prog.Close()
	maps := channelmap.New(prog.Maps())
	listen := netip.AddrPortFrom(netip.MustParseAddr("10.100.0.1"), uint16(listenPort))
	if err := maps.SetDestinations(map[netip.AddrPort]netip.AddrPort{listen: listen}); err != nil {
		t.Fatal(err)
	}
	bs := make([]channelmap.Binding, n)
	for i := range bs {
		bs[i] = channelmap.Binding{Client: netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, byte(101 + i>>16), byte(i >> 8), byte(i)}), 40000),
			Listener: listen, Channel: 0x4000, Peer: netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, byte(201 + i>>16), byte(i >> 8), byte(i)}), 5000),
			Relay: netip.AddrPortFrom(netip.MustParseAddr("10.200.0.1"), uint16(49152+i%16000))}
	}
	row := func(op string, f func(channelmap.Binding) error) MapOpsRow {
		lat := make([]float64, 0, n)
		start := time.Now()
		for _, b := range bs {
			t0 := time.Now()
			if err := f(b); err != nil {
				t.Fatalf("%s %v: %v", op, b, err)
			}
			lat = append(lat, float64(time.Since(t0).Nanoseconds())/1000)
		}
		el := time.Since(start)
		sort.Float64s(lat)
		r := MapOpsRow{Op: op, Bindings: n, PerSecond: float64(n) / el.Seconds(), P50Us: quantile(lat, 0.5), P99Us: quantile(lat, 0.99), MaxUs: lat[len(lat)-1]}
		t.Logf("%s: %.0f/s, p50 %.1f µs, p99 %.1f µs, max %.0f µs", op, r.PerSecond, r.P50Us, r.P99Us, r.MaxUs)
		return r
	}
	h.rep.MapOps = append(h.rep.MapOps, row("install (Upsert), filling 0 → 100,000", maps.Upsert),
		row("remove (Delete), emptying 100,000 → 0", func(b channelmap.Binding) error { return maps.Delete(b.Key()) }))
	if maps.Len() != 0 {
		t.Errorf("%d bindings left", maps.Len())
	}
}
