package channelmap

import (
	"errors"
	"io"
	"log/slog"
	"net/netip"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/l7mp/stunnerd-xdp/bpf"
	"github.com/l7mp/stunnerd-xdp/internal/byteorder"
	"github.com/l7mp/stunnerd-xdp/internal/loader"
	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// failingMap makes Put fail on demand, as a full or broken kernel map would.
type failingMap struct {
	*ebpf.Map
	failPut bool
}

var errInjected = errors.New("injected map write failure")

func (f *failingMap) Put(k, v any) error {
	if f.failPut {
		return errInjected
	}
	return f.Map.Put(k, v)
}

func newTestMaps(t testing.TB, maxBindings uint32) (*Maps, *bpf.RelayMaps) {
	t.Helper()
	testenv.RequireRoot(t)
	prog, err := loader.Load(loader.Config{ListenerPorts: []uint16{3478}, MinRelayPort: 49152, MaxRelayPort: 65535, MaxBindings: maxBindings},
		slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { prog.Close() })
	return New(prog.Maps()), prog.Maps()
}

var testBinding = Binding{
	Client:   netip.MustParseAddrPort("10.100.0.2:40000"),
	Listener: netip.MustParseAddrPort("10.100.0.1:3478"),
	Channel:  0x4000,
	Peer:     netip.MustParseAddrPort("10.200.0.2:5001"),
	Relay:    netip.MustParseAddrPort("10.200.0.1:50000"),
}

// learn writes a reply source on the listener's port into b's state slot,
// as the program does from a client packet.
func learn(t *testing.T, raw *bpf.RelayMaps, b Binding, a netip.Addr) {
	t.Helper()
	learnFrom(t, raw, b, netip.AddrPortFrom(a, b.Listener.Port()))
}

// learnFrom is learn with another port (a NodePort's).
func learnFrom(t *testing.T, raw *bpf.RelayMaps, b Binding, from netip.AddrPort) {
	t.Helper()
	var v bpf.RelayP2cVal
	var st bpf.RelayBindingState
	if err := raw.P2cBindings.Lookup(p2cKey(b), &v); err != nil {
		t.Fatal(err)
	}
	if err := raw.BindingStates.Lookup(v.Bind.BindingId, &st); err != nil {
		t.Fatal(err)
	}
	st.ListenerAddr.B, st.ListenerPort = from.Addr().As16(), byteorder.Htons(from.Port())
	if err := raw.BindingStates.Put(v.Bind.BindingId, st); err != nil {
		t.Fatal(err)
	}
}

func dumpOne(t *testing.T, m *Maps, k Key) (Binding, bool) {
	t.Helper()
	d, err := m.Dump()
	if err != nil {
		t.Fatal(err)
	}
	b, ok := d[k]
	return b, ok
}

// TestUpsertKeepsLearnedReplySource: the reply source is the program's to
// learn; a later Upsert (a refresh, the reconcile, a channel moved to another
// peer) must not wipe it, and the first Upsert must not seed it.
func TestUpsertKeepsLearnedReplySource(t *testing.T) {
	m, raw := newTestMaps(t, 64)
	b := testBinding
	if err := m.Upsert(b); err != nil {
		t.Fatal(err)
	}
	if got, _ := dumpOne(t, m, b.Key()); got.ReplySource.IsValid() {
		t.Fatalf("reply source %v seeded by Upsert", got.ReplySource)
	}
	vip := netip.MustParseAddr("192.0.2.10")
	learn(t, raw, b, vip)
	if err := m.Upsert(b); err != nil {
		t.Fatal(err)
	}
	if got, _ := dumpOne(t, m, b.Key()); got.ReplySource != vip {
		t.Fatalf("reply source %v after a second Upsert, want the learned %v", got.ReplySource, vip)
	}
	moved := b
	moved.Peer = netip.MustParseAddrPort("10.200.0.3:5001")
	if err := m.Upsert(moved); err != nil {
		t.Fatal(err)
	}
	if got, _ := dumpOne(t, m, b.Key()); got.ReplySource != vip || got.Peer != moved.Peer {
		t.Fatalf("after the channel moved: %v, want peer %v and reply source %v", got, moved.Peer, vip)
	}
	if n, _ := m.DumpPeerToClient(); n != 1 {
		t.Fatalf("%d peer->client entries, want 1 (the old peer's must go)", n)
	}
}

// TestUpsertRollbackLeavesNothingStale: when the client->peer write of a
// replacement fails, neither the new peer->client entry nor the old
// client->peer entry (which pointed at a peer->client entry now gone) stays.
func TestUpsertRollbackLeavesNothingStale(t *testing.T) {
	m, raw := newTestMaps(t, 64)
	b := testBinding
	if err := m.Upsert(b); err != nil {
		t.Fatal(err)
	}
	fm := &failingMap{Map: raw.C2pBindings, failPut: true}
	m.c2p = fm
	moved := b
	moved.Peer = netip.MustParseAddrPort("10.200.0.3:5001")
	if err := m.Upsert(moved); !errors.Is(err, errInjected) {
		t.Fatalf("Upsert: %v, want the injected failure", err)
	}
	for name, mp := range map[string]*ebpf.Map{"client->peer": raw.C2pBindings, "peer->client": raw.P2cBindings} {
		var k, v []byte
		if it := mp.Iterate(); it.Next(&k, &v) {
			t.Errorf("a %s entry is left after the failed replacement", name)
		}
	}
	if m.Len() != 0 {
		t.Errorf("%d bindings recorded, want 0: the reconcile must install it again", m.Len())
	}
	fm.failPut = false
	if err := m.Upsert(moved); err != nil {
		t.Fatal(err)
	}
	if got, ok := dumpOne(t, m, b.Key()); !ok || got.Peer != moved.Peer {
		t.Fatalf("after the retry: %v %v", got, ok)
	}
}

// TestDumpSkipsHalfBindings: a client->peer entry whose peer->client entry is
// gone is not a binding the reconcile may trust: Dump leaves it out, so the
// mirror installs it again.
func TestDumpSkipsHalfBindings(t *testing.T) {
	m, raw := newTestMaps(t, 64)
	b := testBinding
	if err := m.Upsert(b); err != nil {
		t.Fatal(err)
	}
	if err := raw.P2cBindings.Delete(p2cKey(b)); err != nil {
		t.Fatal(err)
	}
	if _, ok := dumpOne(t, m, b.Key()); ok {
		t.Fatal("Dump reports a binding without its peer->client entry")
	}
	if err := m.Upsert(b); err != nil {
		t.Fatal(err)
	}
	if _, ok := dumpOne(t, m, b.Key()); !ok {
		t.Fatal("Upsert did not repair the binding")
	}
}

// TestFreedIDsRestBeforeReuse: an id freed by Delete is not handed to a new
// binding while packets the program looked up under it may still be counting.
func TestFreedIDsRestBeforeReuse(t *testing.T) {
	m, raw := newTestMaps(t, 2)
	now := time.Unix(1000, 0)
	m.now = func() time.Time { return now }
	a, b := testBinding, testBinding
	b.Channel = 0x4001
	b.Peer = netip.MustParseAddrPort("10.200.0.3:5001")
	for _, x := range []Binding{a, b} {
		if err := m.Upsert(x); err != nil {
			t.Fatal(err)
		}
	}
	id := m.bindings[a.Key()].id
	if err := m.Delete(a.Key()); err != nil {
		t.Fatal(err)
	}
	// A packet in flight counts into the freed slot after the delete.
	var late bpf.RelayBindingState
	late.Stats.C2pPackets, late.Stats.C2pBytes = 1, 100
	if err := raw.BindingStates.Put(id, late); err != nil {
		t.Fatal(err)
	}
	c := a
	c.Channel = 0x4002
	c.Peer = netip.MustParseAddrPort("10.200.0.4:5001")
	if err := m.Upsert(c); !errors.Is(err, ErrFull) {
		t.Fatalf("Upsert within the quarantine: %v, want ErrFull", err)
	}
	now = now.Add(idQuarantine)
	if err := m.Upsert(c); err != nil {
		t.Fatal(err)
	}
	if got := m.bindings[c.Key()].id; got != id {
		t.Fatalf("new binding has id %d, want the freed %d", got, id)
	}
	if s, _ := m.Stats(c.Key()); s != (Stats{}) {
		t.Fatalf("the new owner starts with %+v, want nothing", s)
	}
	if tot, _ := m.Totals(); tot.ClientToPeerPackets != 1 || tot.ClientToPeerBytes != 100 {
		t.Fatalf("totals %+v: the late packet must count in the totals", tot)
	}
}

// TestSetDestinations: the table is replaced as a whole, and what leaves it
// leaves the kernel.
func TestSetDestinations(t *testing.T) {
	m, _ := newTestMaps(t, 64)
	l1, l2 := netip.MustParseAddrPort("10.100.0.1:3478"), netip.MustParseAddrPort("0.0.0.0:3478")
	vip := netip.MustParseAddrPort("192.0.2.10:3478")
	want := map[netip.AddrPort]netip.AddrPort{l1: l1, netip.MustParseAddrPort("10.100.0.3:3478"): l2, vip: l1}
	if err := m.SetDestinations(want); err != nil {
		t.Fatal(err)
	}
	check := func(want map[netip.AddrPort]netip.AddrPort) {
		t.Helper()
		got, err := m.Destinations()
		if err != nil || len(got) != len(want) {
			t.Fatalf("destinations %v (%v), want %v", got, err, want)
		}
		for k, v := range want {
			if got[k] != v {
				t.Fatalf("destination %v -> %v, want %v", k, got[k], v)
			}
		}
	}
	check(want)
	delete(want, vip)
	want[vip] = l2
	want[netip.MustParseAddrPort("[fd00::1]:3478")] = netip.MustParseAddrPort("[::]:3478")
	if err := m.SetDestinations(want); err != nil {
		t.Fatal(err)
	}
	check(want)
	if err := m.SetDestinations(map[netip.AddrPort]netip.AddrPort{netip.MustParseAddrPort("0.0.0.0:3478"): l1}); err == nil {
		t.Fatal("an unspecified destination accepted")
	}
	if err := m.SetDestinations(nil); err != nil {
		t.Fatal(err)
	}
	check(nil)
}

// TestSetDestinationsWirePorts: a destination whose port is not its
// listener's (a NodePort) puts its port into the program's wire_ports
// bitmap, and takes it out when the last such destination goes; listener
// ports stay out of it.
func TestSetDestinationsWirePorts(t *testing.T) {
	m, raw := newTestMaps(t, 64)
	wild := netip.MustParseAddrPort("0.0.0.0:3478")
	bits := func() map[uint16]bool {
		t.Helper()
		out := map[uint16]bool{}
		for w := uint32(0); w < wirePortWords; w++ {
			var v uint64
			if err := raw.WirePorts.Lookup(w, &v); err != nil {
				t.Fatal(err)
			}
			for b := range 64 {
				if v>>b&1 != 0 {
					out[uint16(w*64)+uint16(b)] = true
				}
			}
		}
		return out
	}
	check := func(what string, want ...uint16) {
		t.Helper()
		got := bits()
		if len(got) != len(want) {
			t.Fatalf("%s: wire ports %v, want %v", what, got, want)
		}
		for _, p := range want {
			if !got[p] {
				t.Fatalf("%s: wire ports %v, want %v", what, got, want)
			}
		}
	}
	d := map[netip.AddrPort]netip.AddrPort{
		netip.MustParseAddrPort("10.0.0.1:3478"):   wild,
		netip.MustParseAddrPort("10.0.0.1:31478"):  wild,
		netip.MustParseAddrPort("10.0.0.2:31478"):  wild,
		netip.MustParseAddrPort("192.0.2.1:443"):   wild,
		netip.MustParseAddrPort("192.0.2.1:65535"): wild,
	}
	if err := m.SetDestinations(d); err != nil {
		t.Fatal(err)
	}
	check("set", 31478, 443, 65535)
	delete(d, netip.MustParseAddrPort("10.0.0.1:31478"))
	delete(d, netip.MustParseAddrPort("192.0.2.1:443"))
	if err := m.SetDestinations(d); err != nil {
		t.Fatal(err)
	}
	check("one of two NodePort destinations and a VIP gone", 31478, 65535)
	if err := m.SetDestinations(map[netip.AddrPort]netip.AddrPort{netip.MustParseAddrPort("10.0.0.1:3478"): wild}); err != nil {
		t.Fatal(err)
	}
	check("none left")
}

// TestDumpReportsLearnedPort: Dump reports the port the program learned with
// the reply source (a NodePort), and ReplyFrom both.
func TestDumpReportsLearnedPort(t *testing.T) {
	m, raw := newTestMaps(t, 64)
	b := testBinding
	if err := m.Upsert(b); err != nil {
		t.Fatal(err)
	}
	np := netip.MustParseAddrPort("10.100.0.1:31478")
	learnFrom(t, raw, b, np)
	got, _ := dumpOne(t, m, b.Key())
	if got.ReplySource != np.Addr() || got.ReplyPort != np.Port() || got.ReplyFrom() != np {
		t.Fatalf("dumped reply source %v port %d (from %v), want %v", got.ReplySource, got.ReplyPort, got.ReplyFrom(), np)
	}
	live, err := m.Live()
	if err != nil || len(live) != 1 || live[0].Binding.ReplyFrom() != np {
		t.Fatalf("live %+v (%v), want the reply source %v", live, err, np)
	}
	if err := m.Upsert(b); err != nil {
		t.Fatal(err)
	}
	if got, _ := dumpOne(t, m, b.Key()); got.ReplyFrom() != np {
		t.Fatalf("after a second Upsert the reply source is %v, want the learned %v", got.ReplyFrom(), np)
	}
}

// TestAccountTotalsMonotonicUnderChurn: scrapes read the live counters
// outside the lock while bindings come, go and move between accounts and the
// "program" keeps counting; no account's total, and not the overall total,
// may ever go down from one scrape to the next (a reset to Prometheus).
func TestAccountTotalsMonotonicUnderChurn(t *testing.T) {
	m, raw := newTestMaps(t, 64)
	// Each read of the clock (under the maps' lock) is a second later: freed
	// ids are out of quarantine by the next allocation.
	clock := time.Now()
	m.now = func() time.Time { clock = clock.Add(time.Second); return clock }
	m.SetAccount(func(b Binding) string { return b.Peer.Addr().String() })
	peers := []netip.AddrPort{netip.MustParseAddrPort("10.200.0.2:5001"), netip.MustParseAddrPort("10.200.0.3:5001")}
	binding := func(i, peer int) Binding {
		b := testBinding
		b.Client = netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 100, 1, byte(i)}), 40000)
		b.Peer = peers[peer]
		return b
	}
	// bump counts one packet each way in the binding's slot, as the program
	// would (it may land after the binding's removal: a late packet, folded
	// in when the slot is reused).
	bump := func(k Key) {
		m.mu.Lock()
		e, ok := m.bindings[k]
		m.mu.Unlock()
		if !ok {
			return
		}
		var st bpf.RelayBindingState
		if err := raw.BindingStates.Lookup(e.id, &st); err != nil {
			t.Error(err)
			return
		}
		st.Stats.C2pPackets++
		st.Stats.P2cPackets++
		if err := raw.BindingStates.Put(e.id, st); err != nil {
			t.Error(err)
		}
	}

	done := make(chan struct{})
	go func() {
		defer close(done)
		for i := 0; i < 3000; i++ {
			b := binding(i%16, (i/16)%2)
			switch i % 5 {
			case 0, 1, 2: // install or move to the other peer, and count
				if err := m.Upsert(b); err != nil {
					t.Error(err)
					return
				}
				bump(b.Key())
			case 3:
				bump(b.Key())
			case 4:
				if err := m.Delete(b.Key()); err != nil {
					t.Error(err)
					return
				}
			}
		}
	}()
	prev := map[string]Stats{}
	var prevTotal Stats
	less := func(a, b Stats) bool {
		return a.ClientToPeerPackets < b.ClientToPeerPackets || a.PeerToClientPackets < b.PeerToClientPackets
	}
	for scrapes := 0; ; scrapes++ {
		select {
		case <-done:
			if scrapes < 10 {
				t.Errorf("only %d scrapes during the churn", scrapes)
			}
			return
		default:
		}
		got, err := m.AccountTotals()
		if err != nil {
			t.Fatal(err)
		}
		for a, s := range got {
			if less(s, prev[a]) {
				t.Fatalf("scrape %d: account %s went down from %+v to %+v", scrapes, a, prev[a], s)
			}
		}
		prev = got
		total, err := m.Totals()
		if err != nil {
			t.Fatal(err)
		}
		if less(total, prevTotal) {
			t.Fatalf("scrape %d: totals went down from %+v to %+v", scrapes, prevTotal, total)
		}
		prevTotal = total
	}
}

// TestSlotGenerations: every install gives its slot a generation of its own,
// which both entries carry with a copy of their key, and a removal takes it
// back: the program's flow caches hold a binding only as long as its slot
// keeps the generation they were made in (a reused id must not revive them).
func TestSlotGenerations(t *testing.T) {
	m, raw := newTestMaps(t, 2)
	now := time.Unix(1000, 0)
	m.now = func() time.Time { return now }
	gens := func(b Binding) (slot, c2p, p2c uint32) {
		t.Helper()
		var (
			cv bpf.RelayC2pVal
			pv bpf.RelayP2cVal
			st bpf.RelayBindingState
		)
		if err := errors.Join(raw.C2pBindings.Lookup(m.c2pKey(b.Key()), &cv), raw.P2cBindings.Lookup(p2cKey(b), &pv),
			raw.BindingStates.Lookup(cv.BindingId, &st)); err != nil {
			t.Fatal(err)
		}
		if cv.Key != m.c2pKey(b.Key()) || pv.Key != p2cKey(b) {
			t.Fatalf("%v: the entries' key copies %+v / %+v differ from their keys", b, cv.Key, pv.Key)
		}
		return st.Gen, cv.Gen, pv.Bind.Gen
	}
	a := testBinding
	if err := m.Upsert(a); err != nil {
		t.Fatal(err)
	}
	id := m.bindings[a.Key()].id
	g1, c, p := gens(a)
	if g1 == 0 || c != g1 || p != g1 {
		t.Fatalf("installed: slot %d, client->peer %d, peer->client %d: want one nonzero generation", g1, c, p)
	}
	if err := m.Upsert(a); err != nil { // unchanged: the same generation
		t.Fatal(err)
	}
	if g, _, _ := gens(a); g != g1 {
		t.Fatalf("an unchanged Upsert moved the generation %d -> %d", g1, g)
	}
	if err := m.Delete(a.Key()); err != nil {
		t.Fatal(err)
	}
	var st bpf.RelayBindingState
	if err := raw.BindingStates.Lookup(id, &st); err != nil || st.Gen != 0 {
		t.Fatalf("removed: slot generation %d (%v), want 0", st.Gen, err)
	}
	now = now.Add(idQuarantine)
	b := a
	b.Channel, b.Peer = 0x4001, netip.MustParseAddrPort("10.200.0.3:5001")
	if err := m.Upsert(b); err != nil {
		t.Fatal(err)
	}
	c3 := b
	c3.Channel, c3.Peer = 0x4002, netip.MustParseAddrPort("10.200.0.4:5001")
	if err := m.Upsert(c3); err != nil {
		t.Fatal(err)
	}
	reused := b
	if m.bindings[c3.Key()].id == id {
		reused = c3
	}
	if m.bindings[reused.Key()].id != id {
		t.Fatalf("id %d was not reused", id)
	}
	if g, _, _ := gens(reused); g == 0 || g == g1 {
		t.Fatalf("the reused slot has generation %d, the removed binding's was %d", g, g1)
	}
}

// TestInvalidateRetried: a FIB generation bump that failed is made by the
// next write; RemoveStray bumps it when it removed anything.
func TestInvalidateRetried(t *testing.T) {
	m, raw := newTestMaps(t, 4)
	if err := bpf.NewFibGen(raw.FibGen).Enable(); err != nil {
		t.Fatal(err)
	}
	gen := func() uint32 {
		t.Helper()
		var g uint32
		if err := raw.FibGen.Lookup(uint32(0), &g); err != nil {
			t.Fatal(err)
		}
		return g
	}
	broken, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.Array, KeySize: 4, ValueSize: 4, MaxEntries: 1})
	if err != nil {
		t.Fatal(err)
	}
	broken.Close() // every operation on it fails
	g0 := gen()
	m.fibGen = bpf.NewFibGen(broken)
	if err := m.SetDestinations(map[netip.AddrPort]netip.AddrPort{testBinding.Listener: testBinding.Listener}); err == nil {
		t.Fatal("SetDestinations with a broken FIB generation: no error")
	}
	m.fibGen = bpf.NewFibGen(raw.FibGen)
	if gen() != g0 {
		t.Fatal("the generation moved through a broken map")
	}
	if err := m.Delete(testBinding.Key()); err != nil { // any write
		t.Fatal(err)
	}
	if g := gen(); g == g0 {
		t.Fatal("the failed bump was not made by the next write")
	}

	// A stray entry (in the map, not in m's records).
	var cv bpf.RelayC2pVal
	k := m.c2pKey(testBinding.Key())
	cv.Key = k
	if err := raw.C2pBindings.Put(k, cv); err != nil {
		t.Fatal(err)
	}
	g1 := gen()
	if n, err := m.RemoveStray(); err != nil || n != 1 {
		t.Fatalf("RemoveStray: %d, %v; want 1", n, err)
	}
	if gen() == g1 {
		t.Fatal("RemoveStray removed an entry without a new FIB generation")
	}
}

// TestTranslatedRelay: a binding with a translated relay (Binding.Wire) is
// keyed and sourced by it in the kernel, Dump gives pion's relay back beside
// it, and its port's bit in nat_relay_ports stands while any installed binding
// has a translated relay on that port.
func TestTranslatedRelay(t *testing.T) {
	m, raw := newTestMaps(t, 16)
	natBit := func(port uint16) bool {
		t.Helper()
		var v uint64
		if err := raw.NatRelayPorts.Lookup(uint32(port/64), &v); err != nil {
			t.Fatal(err)
		}
		return v>>(port%64)&1 == 1
	}
	a := testBinding
	a.Wire = netip.MustParseAddrPort("10.244.0.0:31000")
	b := testBinding
	b.Channel, b.Peer, b.Relay = 0x4001, netip.MustParseAddrPort("10.200.0.3:5001"), netip.MustParseAddrPort("10.200.0.1:50001")
	b.Wire = netip.MustParseAddrPort("10.244.0.1:31000") // another address, the same port
	for _, x := range []Binding{a, b} {
		if err := m.Upsert(x); err != nil {
			t.Fatal(err)
		}
	}
	var cv bpf.RelayC2pVal
	if err := raw.C2pBindings.Lookup(m.c2pKey(a.Key()), &cv); err != nil {
		t.Fatal(err)
	}
	if got := netip.AddrPortFrom(fromAddr16(cv.RelayAddr.B), byteorder.Htons(cv.RelayPort)); got != a.Wire {
		t.Fatalf("client->peer source %v, want the translated relay %v", got, a.Wire)
	}
	if got, ok := dumpOne(t, m, a.Key()); !ok || got.Relay != a.Relay || got.Wire != a.Wire {
		t.Fatalf("dump %v (%v), want relay %v on the wire %v", got, ok, a.Relay, a.Wire)
	}
	if !natBit(31000) || natBit(31001) {
		t.Fatal("nat_relay_ports: want port 31000 alone")
	}
	if err := m.Delete(a.Key()); err != nil {
		t.Fatal(err)
	}
	if !natBit(31000) {
		t.Fatal("port 31000 cleared while another binding has it")
	}
	// Moved to an untranslated relay: the port's last reference goes.
	b.Wire = netip.AddrPort{}
	if err := m.Upsert(b); err != nil {
		t.Fatal(err)
	}
	if natBit(31000) {
		t.Fatal("port 31000 still set with no translated relay on it")
	}
	if got, ok := dumpOne(t, m, b.Key()); !ok || got.Relay != b.Relay || got.Wire.IsValid() {
		t.Fatalf("dump %v (%v), want relay %v untranslated", got, ok, b.Relay)
	}
}

// slotTestBinding is the i-th of many bindings: a client port and a relay
// port of its own.
func slotTestBinding(i int) Binding {
	return Binding{Client: netip.AddrPortFrom(netip.MustParseAddr("10.100.0.2"), uint16(1024+i)),
		Listener: testBinding.Listener, Channel: 0x4000, Peer: testBinding.Peer,
		Relay: netip.AddrPortFrom(netip.MustParseAddr("10.200.0.1"), uint16(1024+i))}
}

// installCounting installs n bindings and gives each slot counters of its
// own (c2p packets = 1000+id), as the program would count them.
func installCounting(t testing.TB, m *Maps, raw *bpf.RelayMaps, n int) {
	t.Helper()
	for i := range n {
		if err := m.Upsert(slotTestBinding(i)); err != nil {
			t.Fatal(err)
		}
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, e := range m.bindings {
		var st bpf.RelayBindingState
		if err := raw.BindingStates.Lookup(e.id, &st); err != nil {
			t.Fatal(err)
		}
		st.Stats = bpf.RelayBindingStats{C2pPackets: 1000 + uint64(e.id), C2pBytes: 7 * uint64(e.id), P2cPackets: 3, P2cBytes: uint64(e.id)}
		if err := raw.BindingStates.Put(e.id, st); err != nil {
			t.Fatal(err)
		}
	}
}

// TestReadSlots: many dense bindings are read in batches, few or sparse ones
// one by one; either way each binding gets its own slot, as a lookup of it
// gives.
func TestReadSlots(t *testing.T) {
	m, raw := newTestMaps(t, 4096)
	const n = 600 // above slotBatch/slotsDense: batches
	installCounting(t, m, raw, n)
	check := func(what string, wantBatch bool) {
		t.Helper()
		snap, slots, errs := m.snapshotSlots()
		if err := errors.Join(errs...); err != nil {
			t.Fatal(err)
		}
		m.mu.Lock()
		next := m.nextID
		m.mu.Unlock()
		if batch := batchable(len(snap), next); batch != wantBatch {
			t.Fatalf("%s: %d bindings below id %d read in batches: %v, want %v", what, len(snap), next, batch, wantBatch)
		}
		for i, e := range snap {
			var want bpf.RelayBindingState
			if err := raw.BindingStates.Lookup(e.id, &want); err != nil {
				t.Fatal(err)
			}
			if slots[i] != want || slots[i].Stats.C2pPackets != 1000+uint64(e.id) {
				t.Fatalf("%s: binding %v (id %d) read %+v, its slot holds %+v", what, e.binding, e.id, slots[i].Stats, want.Stats)
			}
		}
		live, err := m.Live()
		if err != nil {
			t.Fatal(err)
		}
		if len(live) != len(snap) {
			t.Fatalf("%s: Live has %d bindings, want %d", what, len(live), len(snap))
		}
	}
	check("600 of 600", true)
	for i := 100; i < n; i++ {
		if err := m.Delete(slotTestBinding(i).Key()); err != nil {
			t.Fatal(err)
		}
	}
	check("100 of 600", false)
}

// BenchmarkReadSlots reads the slots of 10,000 installed bindings, as
// metrics, the connection-tracking refresh and GateFlows do: in batches,
// and one lookup each (what they did before).
func BenchmarkReadSlots(b *testing.B) {
	m, raw := newTestMaps(b, 16384)
	const n = 10000
	installCounting(b, m, raw, n)
	snap, _, _ := m.snapshotSlots()
	ids := make([]uint32, len(snap))
	for i, e := range snap {
		ids[i] = e.id
	}
	out := make([]bpf.RelayBindingState, len(ids))
	b.Run("batches", func(b *testing.B) {
		for b.Loop() {
			if err := errors.Join(m.readSlots(ids, n, out)...); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("one by one", func(b *testing.B) {
		for b.Loop() {
			for i, id := range ids {
				if err := m.states.Lookup(id, &out[i]); err != nil {
					b.Fatal(err)
				}
			}
		}
	})
}
