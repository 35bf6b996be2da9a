package channelmap_test

import (
	"fmt"
	"io"
	"log/slog"
	"net/netip"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/l7mp/stunnerd-xdp/bpf"
	"github.com/l7mp/stunnerd-xdp/internal/byteorder"
	"github.com/l7mp/stunnerd-xdp/internal/channelmap"
	"github.com/l7mp/stunnerd-xdp/internal/loader"
	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// TestTotalsLiveAndRemoved: Totals sums the live bindings' counters (read one
// binding at a time) and those of removed bindings, for many bindings.
func TestTotalsLiveAndRemoved(t *testing.T) {
	m, states := loadMaps(t, 8192)
	var want channelmap.Stats
	const n = 2000
	for i := 0; i < n; i++ {
		b := channelmap.Binding{
			Client:   netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 1, byte(i >> 8), byte(i)}), 40000),
			Listener: netip.MustParseAddrPort("10.100.0.1:3478"), Channel: 0x4000,
			Peer:  netip.MustParseAddrPort("10.200.0.2:5001"),
			Relay: netip.AddrPortFrom(netip.MustParseAddr("10.200.0.1"), uint16(50000+i%10000)),
		}
		if err := m.Upsert(b); err != nil {
			t.Fatal(err)
		}
	}
	// Every slot in use gets the same counts (slot i belongs to binding i).
	for id := uint32(0); id < n; id++ {
		st := bpf.RelayBindingState{Stats: bpf.RelayBindingStats{C2pPackets: 1, C2pBytes: 100, P2cPackets: 2, P2cBytes: 50}}
		if err := states.Put(id, st); err != nil {
			t.Fatal(err)
		}
	}
	want = channelmap.Stats{ClientToPeerPackets: n, ClientToPeerBytes: n * 100, PeerToClientPackets: 2 * n, PeerToClientBytes: n * 50}
	got, err := m.Totals()
	if err != nil || got != want {
		t.Fatalf("live totals %+v (%v), want %+v", got, err, want)
	}
	// Remove all but a few: their counters stay in the totals.
	for _, b := range m.Installed()[:n-10] {
		if err := m.Delete(b.Key()); err != nil {
			t.Fatal(err)
		}
	}
	if got, err = m.Totals(); err != nil || got != want {
		t.Fatalf("totals after removal %+v (%v), want %+v", got, err, want)
	}
}

// loadMaps loads the program (not attached) and wraps its maps.
func loadMaps(t testing.TB, maxBindings uint32) (*channelmap.Maps, *ebpf.Map) {
	t.Helper()
	m, maps := loadRelayMaps(t, maxBindings)
	return m, maps.BindingStates
}

// loadRelayMaps is loadMaps with all the program's maps.
func loadRelayMaps(t testing.TB, maxBindings uint32) (*channelmap.Maps, *bpf.RelayMaps) {
	t.Helper()
	testenv.RequireRoot(t)
	prog, err := loader.Load(loader.Config{ListenerPorts: []uint16{3478}, MinRelayPort: 49152, MaxRelayPort: 65535, MaxBindings: maxBindings},
		slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { prog.Close() })
	return channelmap.New(prog.Maps()), prog.Maps()
}

// TestAccountTotalsGrowAcrossRemovalAndPeerMoves: the totals by account hold
// live and removed bindings' counters, a binding installed before SetAccount
// is assigned by it, and a binding whose channel moves to a peer of another
// account leaves its traffic so far with the old one.
func TestAccountTotalsGrowAcrossRemovalAndPeerMoves(t *testing.T) {
	m, states := loadMaps(t, 64)
	binding := func(i int, peer string) channelmap.Binding {
		return channelmap.Binding{
			Client:   netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 1, 0, byte(i)}), 40000),
			Listener: netip.MustParseAddrPort("10.100.0.1:3478"), Channel: 0x4000,
			Peer: netip.MustParseAddrPort(peer), Relay: netip.AddrPortFrom(netip.MustParseAddr("10.200.0.1"), uint16(50000+i)),
		}
	}
	// One packet of 10 bytes each way into slot id, as the program counts.
	bump := func(id uint32) {
		var st bpf.RelayBindingState
		if err := states.Lookup(id, &st); err != nil {
			t.Fatal(err)
		}
		st.Stats.C2pPackets++
		st.Stats.C2pBytes += 10
		st.Stats.P2cPackets++
		st.Stats.P2cBytes += 10
		if err := states.Put(id, st); err != nil {
			t.Fatal(err)
		}
	}
	b0, b1 := binding(0, "10.200.0.2:5000"), binding(1, "10.201.0.2:5000")
	for _, b := range []channelmap.Binding{b0, b1} {
		if err := m.Upsert(b); err != nil {
			t.Fatal(err)
		}
	}
	bump(0) // b0 counted before the accounts exist
	m.SetAccount(func(b channelmap.Binding) string { return netip.PrefixFrom(b.Peer.Addr(), 16).Masked().String() })
	bump(0)
	bump(1)
	want := func(step string, a, b uint64) {
		t.Helper()
		got, err := m.AccountTotals()
		if err != nil {
			t.Fatal(err)
		}
		for acct, n := range map[string]uint64{"10.200.0.0/16": a, "10.201.0.0/16": b} {
			if s := got[acct]; s.ClientToPeerPackets != n || s.PeerToClientBytes != 10*n {
				t.Errorf("%s: account %s has %+v, want %d packets each way", step, acct, s, n)
			}
		}
	}
	want("live", 2, 1)
	// b0's channel moves to the other account's peer: its two stay, and
	// what the program learned (the reply source) stays in the slot.
	var st bpf.RelayBindingState
	if err := states.Lookup(uint32(0), &st); err != nil {
		t.Fatal(err)
	}
	st.ListenerAddr.B[15] = 7
	if err := states.Put(uint32(0), st); err != nil {
		t.Fatal(err)
	}
	moved := b0
	moved.Peer = netip.MustParseAddrPort("10.201.0.9:5000")
	if err := m.Upsert(moved); err != nil {
		t.Fatal(err)
	}
	if err := states.Lookup(uint32(0), &st); err != nil || st.ListenerAddr.B[15] != 7 {
		t.Errorf("the learned reply source did not survive the account change: %v (%v)", st.ListenerAddr.B, err)
	}
	bump(0)
	want("moved", 2, 2)
	if err := m.Delete(b1.Key()); err != nil {
		t.Fatal(err)
	}
	want("removed", 2, 2)
	if tot, err := m.Totals(); err != nil || tot.ClientToPeerPackets != 4 {
		t.Errorf("totals %+v (%v), want 4 client->peer packets", tot, err)
	}
}

// BenchmarkAccountTotals: a scrape's cost follows the live bindings, not the
// size of the maps (here the default 131,072 slots).
func BenchmarkAccountTotals(b *testing.B) {
	for _, n := range []int{100, 10000} {
		b.Run(fmt.Sprintf("bindings=%d", n), func(b *testing.B) {
			m, _ := loadMaps(b, 131072)
			m.SetAccount(func(bd channelmap.Binding) string { return bd.Peer.String() })
			for i := 0; i < n; i++ {
				bd := channelmap.Binding{
					Client:   netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 1, byte(i >> 8), byte(i)}), 40000),
					Listener: netip.MustParseAddrPort("10.100.0.1:3478"), Channel: 0x4000,
					Peer:  netip.MustParseAddrPort("10.200.0.2:5001"),
					Relay: netip.AddrPortFrom(netip.MustParseAddr("10.200.0.1"), uint16(50000+i%10000)),
				}
				if err := m.Upsert(bd); err != nil {
					b.Fatal(err)
				}
			}
			b.ResetTimer()
			for range b.N {
				if _, err := m.AccountTotals(); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// TestAllocIDs: the channels of one allocation (relayed address) share one
// rate-limit bucket id, written into both entries of each binding; the id
// lives while any of them does, follows a channel that moves to another
// relay, and a reused id starts with nothing owed.
func TestAllocIDs(t *testing.T) {
	m, maps := loadRelayMaps(t, 64)
	relayA, relayB := netip.MustParseAddrPort("10.200.0.1:50000"), netip.MustParseAddrPort("10.200.0.1:50001")
	binding := func(ch uint16, relay netip.AddrPort) channelmap.Binding {
		return channelmap.Binding{Client: netip.MustParseAddrPort("10.1.0.1:40000"), Listener: netip.MustParseAddrPort("10.100.0.1:3478"),
			Channel: ch, Peer: netip.AddrPortFrom(netip.MustParseAddr("10.200.0.2"), 5000+ch-0x4000), Relay: relay}
	}
	// kernelID reads a binding's alloc id from both of its map entries.
	kernelID := func(b channelmap.Binding) uint32 {
		t.Helper()
		var k bpf.RelayP2cKey
		k.PeerAddr.B, k.RelayAddr.B = b.Peer.Addr().As16(), b.Relay.Addr().As16()
		k.PeerPort, k.RelayPort = byteorder.Htons(b.Peer.Port()), byteorder.Htons(b.Relay.Port())
		var v bpf.RelayP2cVal
		if err := maps.P2cBindings.Lookup(k, &v); err != nil {
			t.Fatalf("%v: %v", b, err)
		}
		var c2p bpf.RelayC2pVal
		it := maps.C2pBindings.Iterate()
		var ck bpf.RelayC2pKey
		for it.Next(&ck, &c2p) {
			if c2p.BindingId == v.Bind.BindingId {
				if c2p.AllocId != v.Bind.AllocId {
					t.Fatalf("%v: alloc id %d client->peer, %d peer->client", b, c2p.AllocId, v.Bind.AllocId)
				}
				return v.Bind.AllocId
			}
		}
		t.Fatalf("%v: no client->peer entry", b)
		return 0
	}
	upsert := func(b channelmap.Binding) {
		t.Helper()
		if err := m.Upsert(b); err != nil {
			t.Fatal(err)
		}
	}
	a1, a2, b1 := binding(0x4000, relayA), binding(0x4001, relayA), binding(0x4002, relayB)
	upsert(a1)
	upsert(a2)
	upsert(b1)
	idA, idB := kernelID(a1), kernelID(b1)
	if kernelID(a2) != idA || idA == idB {
		t.Fatalf("alloc ids: A's channels %d and %d, B's %d; want A's equal, B's its own", idA, kernelID(a2), idB)
	}
	// Owing something; a1 leaves: A keeps its id and its debt.
	if err := maps.AllocRates.Put(idA, bpf.RelayAllocRate{PktTat: 1 << 62}); err != nil {
		t.Fatal(err)
	}
	if err := m.Delete(a1.Key()); err != nil {
		t.Fatal(err)
	}
	if got, ok := m.AllocID(relayA); !ok || got != idA {
		t.Fatalf("after one of A's channels left: id %d, %v; want %d", got, ok, idA)
	}
	// a2 moves to B: A's last channel is gone, its id free.
	upsert(binding(0x4001, relayB))
	if _, ok := m.AllocID(relayA); ok {
		t.Fatal("A still has an id after its last channel moved away")
	}
	if got := kernelID(binding(0x4001, relayB)); got != idB {
		t.Fatalf("the moved channel has alloc id %d, want B's %d", got, idB)
	}
	// A new allocation reuses A's id, with nothing owed.
	c1 := binding(0x4003, netip.MustParseAddrPort("10.200.0.1:50002"))
	upsert(c1)
	if got := kernelID(c1); got != idA {
		t.Fatalf("new allocation id %d, want the freed %d", got, idA)
	}
	var ar bpf.RelayAllocRate
	if err := maps.AllocRates.Lookup(idA, &ar); err != nil || ar.PktTat != 0 {
		t.Fatalf("reused bucket owes %+v (%v), want nothing", ar, err)
	}
}

// TestFlowsAside: the program's flow caches stand aside while more bindings
// send (their slots' counters moved since the last GateFlows) than five
// eighths of a CPU's region (128 entries for 100 bindings: above 80), and are
// used again below half of it (64), as the program reads the switch (the top
// bit of the FIB generation, kept in the map). Bindings installed but idle
// do not count.
func TestFlowsAside(t *testing.T) {
	m, maps := loadRelayMaps(t, 100)
	cpus, err := ebpf.PossibleCPU()
	if err != nil {
		t.Fatal(err)
	}
	if region := int(maps.C2pFlows.MaxEntries()) / cpus; region != 128 {
		t.Fatalf("a region of %d flows for 100 bindings, want 128", region)
	}
	fibGen := bpf.NewFibGen(maps.FibGen)
	gate := func(what string, aside bool) {
		t.Helper()
		if err := m.GateFlows(); err != nil {
			t.Fatal(err)
		}
		inMap, err := fibGen.FlowsAside()
		if err != nil {
			t.Fatal(err)
		}
		if m.FlowsAside() != aside || inMap != aside {
			t.Fatalf("%s: flows aside %v (the map says %v), want %v", what, m.FlowsAside(), inMap, aside)
		}
	}
	binding := func(i int) channelmap.Binding {
		return channelmap.Binding{Client: netip.AddrPortFrom(netip.MustParseAddr("10.1.0.1"), uint16(40000+i)),
			Listener: netip.MustParseAddrPort("10.100.0.1:3478"), Channel: 0x4000,
			Peer: netip.MustParseAddrPort("10.200.0.2:5000"), Relay: netip.AddrPortFrom(netip.MustParseAddr("10.200.0.1"), uint16(50000+i))}
	}
	// send makes the first n installed bindings' slots count a packet, as
	// the program does when it relays one.
	send := func(n int) {
		t.Helper()
		var id uint32
		var st bpf.RelayBindingState
		it := maps.BindingStates.Iterate()
		var ids []uint32
		for it.Next(&id, &st) {
			if st.Gen != 0 {
				ids = append(ids, id)
			}
		}
		if err := it.Err(); err != nil {
			t.Fatal(err)
		}
		for _, id := range ids[:n] {
			if err := maps.BindingStates.Lookup(id, &st); err != nil {
				t.Fatal(err)
			}
			st.Stats.C2pPackets++
			if err := maps.BindingStates.Put(id, st); err != nil {
				t.Fatal(err)
			}
		}
	}
	for i := 1; i <= 100; i++ {
		if err := m.Upsert(binding(i)); err != nil {
			t.Fatal(err)
		}
	}
	gate("100 bindings, none sending", false)
	send(81)
	gate("81 sending", true)
	send(64)
	gate("64 sending", true)
	send(63)
	gate("63 sending", false)
	send(80)
	gate("80 sending", false)
	send(100)
	gate("100 sending", true)
	gate("none sending", false)
	send(100)
	gate("100 sending", true)
	for i := 100; i > 63; i-- {
		if err := m.Delete(binding(i).Key()); err != nil {
			t.Fatal(err)
		}
	}
	gate("63 installed", false)
}
