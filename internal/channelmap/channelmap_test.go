package channelmap_test

import (
	"io"
	"log/slog"
	"net/netip"
	"testing"

	"github.com/l7mp/stunnerd-xdp/bpf"
	"github.com/l7mp/stunnerd-xdp/internal/channelmap"
	"github.com/l7mp/stunnerd-xdp/internal/loader"
	"github.com/l7mp/stunnerd-xdp/internal/testenv"
)

// TestTotalsBatchAndPerBinding: Totals reads the counters per binding for few
// bindings and in batches for many; both must give the same sums, removed
// bindings included.
func TestTotalsBatchAndPerBinding(t *testing.T) {
	testenv.RequireRoot(t)
	prog, err := loader.Load(loader.Config{ListenerPorts: []uint16{3478}, MinRelayPort: 49152, MaxRelayPort: 65535, MaxBindings: 8192},
		slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	defer prog.Close()
	m := channelmap.New(prog.Maps())
	states := prog.Maps().BindingStates
	var want channelmap.Stats
	const n = 2000 // above the batch threshold
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
		t.Fatalf("batch totals %+v (%v), want %+v", got, err, want)
	}
	// Remove all but a few: the per-binding path, with the removed ones retired.
	for _, b := range m.Installed()[:n-10] {
		if err := m.Delete(b.Key()); err != nil {
			t.Fatal(err)
		}
	}
	if got, err = m.Totals(); err != nil || got != want {
		t.Fatalf("per-binding totals %+v (%v), want %+v", got, err, want)
	}
}
