package channelmap_test

import (
	"net/netip"
	"testing"

	"github.com/l7mp/stunnerd-xdp/bpf"
	"github.com/l7mp/stunnerd-xdp/internal/channelmap"
)

// TestLive: Live reports each installed binding with its slot's counters and
// the reply source the program learned, and leaves out a removed binding.
func TestLive(t *testing.T) {
	m, states := loadMaps(t, 64)
	binding := func(i int) channelmap.Binding {
		return channelmap.Binding{
			Client:   netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 1, 0, byte(i)}), 40000),
			Listener: netip.MustParseAddrPort("10.100.0.1:3478"), Channel: 0x4000,
			Peer: netip.MustParseAddrPort("10.200.0.2:5001"), Relay: netip.AddrPortFrom(netip.MustParseAddr("10.200.0.1"), uint16(50000+i)),
		}
	}
	vip := netip.MustParseAddr("10.96.1.1")
	for i := 0; i < 3; i++ {
		if err := m.Upsert(binding(i)); err != nil {
			t.Fatal(err)
		}
		// A fresh map hands out slots in order; the program would write
		// the slot as this does (its generation stays).
		var st bpf.RelayBindingState
		if err := states.Lookup(uint32(i), &st); err != nil {
			t.Fatal(err)
		}
		st.Stats = bpf.RelayBindingStats{C2pPackets: uint64(10 * (i + 1)), P2cPackets: uint64(i)}
		if i > 0 {
			st.ListenerAddr.B = vip.As16()
		}
		if err := states.Put(uint32(i), st); err != nil {
			t.Fatal(err)
		}
	}
	if err := m.Delete(binding(2).Key()); err != nil {
		t.Fatal(err)
	}
	live, err := m.Live()
	if err != nil {
		t.Fatal(err)
	}
	got := map[channelmap.Key]channelmap.Live{}
	for _, l := range live {
		got[l.Binding.Key()] = l
	}
	if len(got) != 2 {
		t.Fatalf("%d live bindings, want 2: %+v", len(got), live)
	}
	for i := 0; i < 2; i++ {
		l, ok := got[binding(i).Key()]
		want := channelmap.Stats{ClientToPeerPackets: uint64(10 * (i + 1)), PeerToClientPackets: uint64(i)}
		if !ok || l.Stats != want {
			t.Errorf("binding %d: %+v (found %v), want counters %+v", i, l, ok, want)
		}
		if wantSrc := (i > 0); l.Binding.ReplySource.IsValid() != wantSrc || (wantSrc && l.Binding.ReplySource != vip) {
			t.Errorf("binding %d: reply source %v", i, l.Binding.ReplySource)
		}
	}
}
