package channelmap_test

import (
	"net/netip"
	"testing"

	"github.com/l7mp/stunnerd-xdp/bpf"
	"github.com/l7mp/stunnerd-xdp/internal/byteorder"
	"github.com/l7mp/stunnerd-xdp/internal/channelmap"
)

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
			if c2p.BindingId == v.BindingId {
				if c2p.AllocId != v.AllocId {
					t.Fatalf("%v: alloc id %d client->peer, %d peer->client", b, c2p.AllocId, v.AllocId)
				}
				return v.AllocId
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
