package mirror

import (
	"io"
	"log/slog"
	"net"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/l7mp/stunnerd-xdp/internal/natcheck"
	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// fakeChecker answers from a table by peer; peers not in it are Unknown. The
// real checker is tested against real conntrack in internal/natcheck.
type fakeChecker struct {
	mu      sync.Mutex
	verdict map[netip.AddrPort]natcheck.Verdict
	wire    map[netip.AddrPort]netip.AddrPort // Translated peers: the relay on the wire
	calls   map[netip.AddrPort]int
}

func newChecker() *fakeChecker {
	return &fakeChecker{verdict: map[netip.AddrPort]natcheck.Verdict{}, wire: map[netip.AddrPort]netip.AddrPort{},
		calls: map[netip.AddrPort]int{}}
}

func (c *fakeChecker) Check(relay, peer netip.AddrPort) (natcheck.Result, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.calls[peer]++
	r := natcheck.Result{Verdict: c.verdict[peer], Why: "fake"}
	switch r.Verdict {
	case natcheck.Direct:
		r.Wire = relay
	case natcheck.Translated:
		r.Wire = c.wire[peer]
	}
	return r, nil
}

// translate makes the checker find peer's flow source-NATed to wire.
func (c *fakeChecker) translate(peer *net.UDPAddr, wire string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.verdict[addrPort(peer)] = natcheck.Translated
	c.wire[addrPort(peer)] = netip.MustParseAddrPort(wire)
}

func (c *fakeChecker) set(peer *net.UDPAddr, v natcheck.Verdict) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.verdict[addrPort(peer)] = v
}

func (c *fakeChecker) callsFor(peer *net.UDPAddr) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.calls[addrPort(peer)]
}

type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *fakeClock) advance(d time.Duration) time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
	return c.t
}

func newGatedMirror(t *testing.T) (*Mirror, *fakeOffload, *fakeChecker, *testenv.LockedBuffer) {
	t.Helper()
	var logs testenv.LockedBuffer
	m := New(slog.New(slog.NewTextHandler(&logs, nil)))
	t.Cleanup(m.Close)
	// Every recheck finds every pending binding due; TestGateRecheckBackoff
	// tests the schedule.
	var clock fakeClock
	m.smu.Lock()
	m.gate.now = func() time.Time { return clock.advance(MaxRecheckBackoff) }
	m.smu.Unlock()
	c := newChecker()
	m.SetGate(c)
	f := newFake()
	m.SetOffload(f)
	return m, f, c, &logs
}

// settle applies the queued events, one recheck and one reconcile.
func settle(t *testing.T, m *Mirror) {
	t.Helper()
	m.Sync()
	m.RecheckPending()
	if _, err := m.Reconcile(); err != nil {
		t.Fatal(err)
	}
}

// onlyOffloaded checks that the maps hold one binding: channel ch to peer.
func onlyOffloaded(t *testing.T, f *fakeOffload, ch uint16, peer *net.UDPAddr) {
	t.Helper()
	if got := f.keys(); len(got) != 1 || got[chKey(ch)].Peer != addrPort(peer) {
		t.Fatalf("offloaded %v, want channel %#x to %v only", got, ch, peer)
	}
}

func wantUserspace(t *testing.T, m *Mirror, want map[string]int) {
	t.Helper()
	got := m.UserspaceBindings()
	for _, r := range UserspaceReasons {
		if got[r] != want[r] {
			t.Fatalf("bindings in userspace %v, want %v", got, want)
		}
	}
}

// Without evidence a binding waits in userspace; the recheck offloads it once
// the checker finds the flow direct, and never one pion let go meanwhile.
func TestGatePendingThenDirect(t *testing.T) {
	m, f, c, _ := newGatedMirror(t)
	bind(m, listener, peerA, 0x4000)
	bind(m, listener, peerB, 0x4001)
	m.Sync()
	if len(f.keys()) != 0 {
		t.Fatalf("offloaded %v before any evidence", f.keys())
	}
	wantUserspace(t, m, map[string]int{ReasonPending: 2})
	if n := m.RecheckPending(); n != 0 || len(f.keys()) != 0 {
		t.Fatalf("recheck without evidence offloaded %d", n)
	}
	if _, err := m.Reconcile(); err != nil || len(f.keys()) != 0 {
		t.Fatalf("reconcile offloaded a pending binding: %v, %v", f.keys(), err)
	}

	m.EventHandler().OnChannelDeleted(client, listener, "UDP", "u", "r", relay, peerB, 0x4001)
	m.Sync()
	c.set(peerA, natcheck.Direct)
	c.set(peerB, natcheck.Direct)
	if n := m.RecheckPending(); n != 1 {
		t.Fatalf("recheck offloaded %d, want 1", n)
	}
	onlyOffloaded(t, f, 0x4000, peerA)
	wantUserspace(t, m, nil)
	// Direct is remembered: a reconcile asks no more.
	calls := c.callsFor(peerA)
	if _, err := m.Reconcile(); err != nil {
		t.Fatal(err)
	}
	if c.callsFor(peerA) != calls {
		t.Fatal("reconcile asked the checker again about a decided flow")
	}
}

// A NATed flow never reaches the maps, and its peer is logged once.
func TestGateNATedNeverInstalls(t *testing.T) {
	m, f, c, logs := newGatedMirror(t)
	c.set(peerA, natcheck.NATed)
	c.set(peerB, natcheck.Direct)
	bind(m, listener, peerA, 0x4000)
	bind(m, listener, peerA, 0x4001)
	bind(m, listener, peerB, 0x4002)
	settle(t, m)
	onlyOffloaded(t, f, 0x4002, peerB)
	wantUserspace(t, m, map[string]int{ReasonNAT: 2})
	if n := strings.Count(logs.String(), "the kernel NATs this peer"); n != 1 {
		t.Fatalf("NAT logged %d times, want once:\n%s", n, logs.String())
	}
}

// Peers in a no-offload prefix are never offloaded nor even checked; moving
// the prefixes moves the bindings.
func TestGateNoOffloadPeer(t *testing.T) {
	m, f, c, _ := newGatedMirror(t)
	c.set(peerA, natcheck.Direct)
	c.set(peerB, natcheck.Direct)
	m.SetNoOffloadPeers([]netip.Prefix{netip.MustParsePrefix("10.200.0.2/32")})
	bind(m, listener, peerA, 0x4000)
	bind(m, listener, peerB, 0x4001)
	settle(t, m)
	onlyOffloaded(t, f, 0x4001, peerB)
	if c.callsFor(peerA) != 0 {
		t.Fatal("a no-offload peer was checked")
	}
	wantUserspace(t, m, map[string]int{ReasonNoOffloadPeer: 1})

	m.SetNoOffloadPeers([]netip.Prefix{netip.MustParsePrefix("10.200.0.3/32")})
	onlyOffloaded(t, f, 0x4000, peerA)
	wantUserspace(t, m, map[string]int{ReasonNoOffloadPeer: 1})
}

// The recheck does a bounded amount of work per tick, round robin.
func TestGateRecheckBudget(t *testing.T) {
	m, f, c, _ := newGatedMirror(t)
	h := m.EventHandler()
	h.OnPermissionCreated(client, listener, "UDP", "u", "r", relay, peerA.IP)
	n := RecheckBudget + 44
	for i := range n {
		h.OnChannelCreated(client, listener, "UDP", "u", "r", relay, peerA, 0x4000+uint16(i))
	}
	m.Sync()
	before := c.callsFor(peerA)
	m.RecheckPending()
	if got := c.callsFor(peerA) - before; got != RecheckBudget {
		t.Fatalf("one recheck made %d checks, want %d", got, RecheckBudget)
	}
	c.set(peerA, natcheck.Direct)
	if got := m.RecheckPending() + m.RecheckPending(); got != n || len(f.keys()) != n {
		t.Fatalf("two more rechecks offloaded %d (maps hold %d), want %d", got, len(f.keys()), n)
	}
}

// Full maps: one WARN, a counter, no error from the reconcile, and the
// waiting bindings go in when there is room.
func TestFullMapsLogOnce(t *testing.T) {
	m, f, c, logs := newGatedMirror(t)
	c.set(peerA, natcheck.Direct)
	f.capacity = 2
	h := m.EventHandler()
	h.OnPermissionCreated(client, listener, "UDP", "u", "r", relay, peerA.IP)
	for i := range 5 {
		h.OnChannelCreated(client, listener, "UDP", "u", "r", relay, peerA, 0x4000+uint16(i))
	}
	m.Sync()
	for range 3 {
		if _, err := m.Reconcile(); err != nil {
			t.Fatalf("reconcile with full maps: %v", err)
		}
	}
	if len(f.keys()) != 2 || m.Stats().Full != 3 || m.Stats().Errors != 0 {
		t.Fatalf("maps hold %d, full %d, errors %d; want 2, 3, 0", len(f.keys()), m.Stats().Full, m.Stats().Errors)
	}
	wantUserspace(t, m, map[string]int{ReasonFull: 3})
	if n := strings.Count(logs.String(), "level=WARN"); n != 1 || !strings.Contains(logs.String(), "binding maps are full") {
		t.Fatalf("%d WARN lines, want the one about full maps:\n%s", n, logs.String())
	}
	if strings.Contains(logs.String(), "level=ERROR") {
		t.Fatalf("errors logged:\n%s", logs.String())
	}

	// Detached, nothing waits for room (all 5 wait for a kernel path);
	// attached again, the maps say anew.
	m.SetOffload(nil)
	wantUserspace(t, m, map[string]int{ReasonNoKernelPath: 5})
	m.SetOffload(f)
	wantUserspace(t, m, map[string]int{ReasonFull: 3})
	if m.Stats().Full != 6 {
		t.Fatalf("full %d after the maps refused the same 3 again, want 6", m.Stats().Full)
	}

	f.capacity = 0
	if _, err := m.Reconcile(); err != nil {
		t.Fatal(err)
	}
	if len(f.keys()) != 5 || m.Stats().Full != 6 {
		t.Fatalf("after room was made: maps hold %d, full %d; want 5, 6", len(f.keys()), m.Stats().Full)
	}
	wantUserspace(t, m, nil)
	if !strings.Contains(logs.String(), "no binding waits for room") {
		t.Fatalf("the end of the shortage is not logged:\n%s", logs.String())
	}
}

type closingChecker struct {
	*fakeChecker
	closed int
}

func (c *closingChecker) Close() error { c.closed++; return nil }

// The mirror owns its checker: replaced or at Close, it is closed once.
func TestGateClosesChecker(t *testing.T) {
	m := New(slog.New(slog.NewTextHandler(io.Discard, nil)))
	c1, c2 := &closingChecker{fakeChecker: newChecker()}, &closingChecker{fakeChecker: newChecker()}
	m.SetGate(c1)
	m.SetGate(c1)
	m.SetGate(c2)
	m.Close()
	m.Close()
	if c1.closed != 1 || c2.closed != 1 {
		t.Fatalf("closed %d and %d times, want once each", c1.closed, c2.closed)
	}
}

// A channel reported again with another peer (its deletion missed) does not
// leave the old peer's entry behind when the new peer stays in userspace.
func TestGateChannelRebound(t *testing.T) {
	m, f, c, _ := newGatedMirror(t)
	c.set(peerA, natcheck.Direct)
	c.set(peerB, natcheck.NATed)
	bind(m, listener, peerA, 0x4000)
	settle(t, m)
	onlyOffloaded(t, f, 0x4000, peerA)
	bind(m, listener, peerB, 0x4000)
	m.Sync() // not left to the reconcile
	if len(f.keys()) != 0 {
		t.Fatalf("offloaded %v after the channel moved to a NATed peer", f.keys())
	}
	wantUserspace(t, m, map[string]int{ReasonNAT: 1})
}

// A binding that stays pending is checked ever less often, down to every
// MaxRecheckBackoff.
func TestGateRecheckBackoff(t *testing.T) {
	m, _, c, _ := newGatedMirror(t)
	var clock fakeClock
	m.smu.Lock()
	m.gate.now = func() time.Time { return clock.advance(0) }
	m.smu.Unlock()
	bind(m, listener, peerA, 0x4000)
	m.Sync()
	var checkedAt []time.Duration
	start := clock.advance(0)
	for range 200 { // 20 s in steps of 100 ms
		before := c.callsFor(peerA)
		m.RecheckPending()
		if c.callsFor(peerA) > before {
			checkedAt = append(checkedAt, clock.advance(0).Sub(start))
		}
		clock.advance(100 * time.Millisecond)
	}
	const ms = time.Millisecond
	want := []time.Duration{300 * ms, 800 * ms, 1800 * ms, 3800 * ms, 7800 * ms, 11800 * ms, 15800 * ms, 19800 * ms}
	if !slices.Equal(checkedAt, want) {
		t.Fatalf("rechecked at %v after the first check, want at %v", checkedAt, want)
	}
}

// A source-NATed flow is offloaded from its relay on the wire, checked again
// on every recheck, and leaves the kernel path as soon as its mapping is gone
// (the kernel would map the relay afresh): back from the new mapping once
// pion's packets made one.
func TestGateTranslated(t *testing.T) {
	m, f, c, _ := newGatedMirror(t)
	c.translate(peerA, "10.244.0.0:31000")
	c.set(peerB, natcheck.Direct)
	bind(m, listener, peerA, 0x4000)
	bind(m, listener, peerB, 0x4001)
	settle(t, m)
	wire := func() netip.AddrPort { return f.keys()[chKey(0x4000)].Wire }
	if got := f.keys(); len(got) != 2 || wire() != netip.MustParseAddrPort("10.244.0.0:31000") || got[chKey(0x4001)].Wire.IsValid() {
		t.Fatalf("offloaded %v, want channel 0x4000 from 10.244.0.0:31000 and 0x4001 untranslated", got)
	}
	wantUserspace(t, m, nil)

	// Every recheck asks about the translated flow again, not the direct one.
	callsA, callsB := c.callsFor(peerA), c.callsFor(peerB)
	if n := m.RecheckPending(); n != 0 || c.callsFor(peerA) != callsA+1 || c.callsFor(peerB) != callsB {
		t.Fatalf("recheck: offloaded %d, asked %d and %d times, want 0, once and never",
			n, c.callsFor(peerA)-callsA, c.callsFor(peerB)-callsB)
	}

	// The entry is gone (conntrack -D, a flush, expiry): out of the kernel
	// path at the next recheck, pending in userspace.
	c.set(peerA, natcheck.Unknown)
	m.RecheckPending()
	onlyOffloaded(t, f, 0x4001, peerB)
	wantUserspace(t, m, map[string]int{ReasonPending: 1})

	// pion's next packet made a new mapping: offloaded from it.
	c.translate(peerA, "10.244.0.0:42000")
	if n := m.RecheckPending(); n != 1 || wire() != netip.MustParseAddrPort("10.244.0.0:42000") {
		t.Fatalf("recheck offloaded %d, channel 0x4000 from %v; want 1, from 10.244.0.0:42000", n, wire())
	}
	// Re-mapped between two looks: moved at once.
	c.translate(peerA, "10.244.0.0:43000")
	if n := m.RecheckPending(); n != 1 || wire() != netip.MustParseAddrPort("10.244.0.0:43000") {
		t.Fatalf("recheck offloaded %d, channel 0x4000 from %v; want 1, from 10.244.0.0:43000", n, wire())
	}
	// A reconcile keeps the translation.
	if n, err := m.Reconcile(); err != nil || n != 0 {
		t.Fatalf("reconcile repaired %d (%v), want nothing", n, err)
	}
	// Translated otherwise now (a DNAT came in): userspace for good.
	c.set(peerA, natcheck.NATed)
	m.RecheckPending()
	onlyOffloaded(t, f, 0x4001, peerB)
	wantUserspace(t, m, map[string]int{ReasonNAT: 1})
}

// While no program carries bindings (no offload), every binding pion holds
// with a permission counts under the offload manager's reason, a no-offload
// peer under its own; an offload set again counts by the gate's verdicts.
func TestNoPathReason(t *testing.T) {
	m, f, c, _ := newGatedMirror(t)
	c.set(peerA, natcheck.Direct)
	c.set(peerB, natcheck.NATed)
	m.SetNoOffloadPeers([]netip.Prefix{netip.MustParsePrefix("10.200.0.4/32")})
	bind(m, listener, peerA, 0x4000)
	bind(m, listener, peerB, 0x4001)
	peerC := &net.UDPAddr{IP: net.IPv4(10, 200, 0, 4), Port: 5001}
	bind(m, listener, peerC, 0x4002)
	settle(t, m)
	wantUserspace(t, m, map[string]int{ReasonNAT: 1, ReasonNoOffloadPeer: 1})

	m.SetOffload(nil)
	wantUserspace(t, m, map[string]int{ReasonNoKernelPath: 2, ReasonNoOffloadPeer: 1})
	why := ReasonRefused
	m.SetNoPath(func() string { return why })
	wantUserspace(t, m, map[string]int{ReasonRefused: 2, ReasonNoOffloadPeer: 1})
	why = ReasonOff
	wantUserspace(t, m, map[string]int{ReasonOff: 2, ReasonNoOffloadPeer: 1})

	m.SetOffload(f)
	settle(t, m)
	onlyOffloaded(t, f, 0x4000, peerA)
	wantUserspace(t, m, map[string]int{ReasonNAT: 1, ReasonNoOffloadPeer: 1})
}
