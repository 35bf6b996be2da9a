package channelmap_test

import (
	"fmt"
	"io"
	"log/slog"
	"net/netip"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/l7mp/stunnerd-xdp/bpf"
	"github.com/l7mp/stunnerd-xdp/internal/channelmap"
	"github.com/l7mp/stunnerd-xdp/internal/loader"
	"github.com/l7mp/stunnerd-xdp/internal/testenv"
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
	// b0's channel moves to the other account's peer: its two stay.
	moved := b0
	moved.Peer = netip.MustParseAddrPort("10.201.0.9:5000")
	if err := m.Upsert(moved); err != nil {
		t.Fatal(err)
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
