package ctrefresh

import (
	"net/netip"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ti-mo/conntrack"
	"golang.org/x/sys/unix"

	"github.com/l7mp/stunnerd-xdp/internal/channelmap"
)

var defaults = Timeouts{Unreplied: 30 * time.Second, Stream: 120 * time.Second}

func entry(status conntrack.Status) conntrack.Flow {
	return conntrack.NewFlow(unix.IPPROTO_UDP, status, netip.MustParseAddr("10.1.0.2"), netip.MustParseAddr("10.96.1.1"), 40000, 3478, 0, 0)
}

// TestDecide: the timeout and status bits the kernel's UDP tracker gives an
// entry on packets in each direction.
func TestDecide(t *testing.T) {
	const (
		seen    = conntrack.StatusSeenReply
		assured = conntrack.StatusAssured
	)
	for _, tc := range []struct {
		name             string
		status           conntrack.Status
		orig, reply, old bool
		want             bool
		timeout          time.Duration
		newStatus        conntrack.Status // 0: not sent
	}{
		{"nothing relayed", seen, false, false, true, false, 0, 0},
		{"unreplied, original direction", conntrack.StatusConfirmed, true, false, true, true, defaults.Unreplied, 0},
		{"first reply marks the entry", conntrack.StatusConfirmed, false, true, false, true, defaults.Unreplied,
			conntrack.StatusConfirmed | seen},
		{"replied and young", seen, true, false, false, true, defaults.Unreplied, 0},
		{"replied and old: a stream", seen, true, false, true, true, defaults.Stream, seen | assured},
		{"reply on an old entry: a stream at once", conntrack.StatusConfirmed, false, true, true, true, defaults.Stream,
			conntrack.StatusConfirmed | seen | assured},
		{"assured: a stream however young", seen | assured, true, false, false, true, defaults.Stream, 0},
		{"NAT clash: a stream, never assured", seen | statusNATClash, true, true, true, true, defaults.Stream, 0},
		{"fixed timeout", seen | conntrack.StatusFixedTimeout, true, true, true, false, 0, 0},
		{"flowtable's", seen | conntrack.StatusOffload, true, true, true, false, 0, 0},
		{"dying", seen | conntrack.StatusDying, true, true, true, false, 0, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := entry(tc.status)
			u, ok := Decide(e, tc.orig, tc.reply, tc.old, defaults)
			if ok != tc.want {
				t.Fatalf("refresh %v, want %v", ok, tc.want)
			}
			if !ok {
				return
			}
			if got := time.Duration(u.Timeout) * time.Second; got != tc.timeout {
				t.Errorf("timeout %v, want %v", got, tc.timeout)
			}
			if u.Status != tc.newStatus {
				t.Errorf("status %v, want %v", u.Status, tc.newStatus)
			}
			if u.TupleOrig != e.TupleOrig || u.TupleReply != e.TupleReply {
				t.Errorf("update names %v / %v, want the entry's tuples", u.TupleOrig, u.TupleReply)
			}
		})
	}
}

func TestInterval(t *testing.T) {
	for _, tc := range []struct {
		to   Timeouts
		want time.Duration
	}{
		{defaults, 7500 * time.Millisecond},
		{Timeouts{Unreplied: 3 * time.Second, Stream: 5 * time.Second}, 750 * time.Millisecond},
		{Timeouts{Unreplied: 180 * time.Second, Stream: 120 * time.Second}, MaxInterval},
		{Timeouts{Unreplied: time.Second, Stream: 120 * time.Second}, MinInterval},
	} {
		if got := tc.to.Interval(); got != tc.want {
			t.Errorf("%+v: interval %v, want %v", tc.to, got, tc.want)
		}
	}
}

func TestReadTimeouts(t *testing.T) {
	dir := t.TempDir()
	u, s := filepath.Join(dir, "u"), filepath.Join(dir, "s")
	if _, err := readTimeouts(u, s); err != ErrNoConntrack {
		t.Fatalf("no sysctls: %v, want ErrNoConntrack", err)
	}
	for p, v := range map[string]string{u: "3\n", s: "5\n"} {
		if err := os.WriteFile(p, []byte(v), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	got, err := readTimeouts(u, s)
	if want := (Timeouts{3 * time.Second, 5 * time.Second}); err != nil || got != want {
		t.Fatalf("%+v, %v; want %+v", got, err, want)
	}
}

// fakeTable records the refresher's requests; every entry is a plain one.
type fakeTable struct {
	got     []conntrack.Flow
	updates []conntrack.Flow
	missing map[netip.AddrPort]bool // by the query's source
	// dnat translates destinations as a DNAT rule would: the reply comes
	// from the target.
	dnat map[netip.AddrPort]netip.AddrPort
	// status is every entry's; noReply makes an update by a reply tuple
	// from these sources fail with ENOENT (the entry re-created elsewhere).
	status  conntrack.Status
	noReply map[netip.AddrPort]bool
	// snat translates sources as a masquerade would: the reply goes to the
	// target, and the entry has IPS_SRC_NAT.
	snat map[netip.AddrPort]netip.AddrPort
}

func (f *fakeTable) Get(q conntrack.Flow) (conntrack.Flow, error) {
	f.got = append(f.got, q)
	if f.missing[netip.AddrPortFrom(q.TupleOrig.IP.SourceAddress, q.TupleOrig.Proto.SourcePort)] {
		return conntrack.Flow{}, unix.ENOENT
	}
	dst := netip.AddrPortFrom(q.TupleOrig.IP.DestinationAddress, q.TupleOrig.Proto.DestinationPort)
	if to, ok := f.dnat[dst]; ok {
		q.TupleReply.IP.SourceAddress, q.TupleReply.Proto.SourcePort = to.Addr(), to.Port()
	}
	q.Status = f.status
	src := netip.AddrPortFrom(q.TupleOrig.IP.SourceAddress, q.TupleOrig.Proto.SourcePort)
	if to, ok := f.snat[src]; ok {
		q.TupleReply.IP.DestinationAddress, q.TupleReply.Proto.DestinationPort = to.Addr(), to.Port()
		q.Status |= conntrack.StatusSrcNAT | conntrack.StatusSrcNATDone
	}
	return q, nil
}

func (f *fakeTable) Update(u conntrack.Flow) error {
	f.updates = append(f.updates, u)
	if !u.TupleOrig.IP.SourceAddress.IsValid() &&
		f.noReply[netip.AddrPortFrom(u.TupleReply.IP.SourceAddress, u.TupleReply.Proto.SourcePort)] {
		return unix.ENOENT
	}
	return nil
}

// TestRoundStreams: an entry found a stream is refreshed by a blind update of
// its reply tuple from then on (one request instead of two); when that finds
// nothing (the entry re-created with another translation), the refresher
// looks the flow up again, and a flow idle for a look is looked up again.
func TestRoundStreams(t *testing.T) {
	vip := netip.MustParseAddrPort("10.96.1.1:3478")
	listener := netip.MustParseAddrPort("10.0.0.1:3478")
	ft := &fakeTable{dnat: map[netip.AddrPort]netip.AddrPort{vip: listener}, noReply: map[netip.AddrPort]bool{},
		status: conntrack.StatusConfirmed | conntrack.StatusSeenReply | conntrack.StatusAssured}
	r := New(Config{Dial: func() (Table, func() error, error) { return ft, nil, nil }})
	b := channelmap.Binding{
		Client: netip.MustParseAddrPort("10.1.0.2:40000"), Listener: listener, Channel: 0x4000,
		Peer: netip.MustParseAddrPort("10.2.0.2:5000"), Relay: netip.MustParseAddrPort("10.0.0.1:50000"), ReplySource: vip.Addr(),
	}
	var n uint64
	round := func() (gets, blind int) {
		t.Helper()
		ft.got, ft.updates = nil, nil
		n++
		if err := r.Round([]channelmap.Live{{Binding: b, Stats: channelmap.Stats{ClientToPeerPackets: n}}}, defaults); err != nil {
			t.Fatal(err)
		}
		for _, u := range ft.updates {
			if !u.TupleOrig.IP.SourceAddress.IsValid() {
				blind++
				if u.Timeout != uint32(defaults.Stream/time.Second) {
					t.Errorf("blind update with timeout %d", u.Timeout)
				}
			}
		}
		return len(ft.got), blind
	}
	if gets, blind := round(); gets != 2 || blind != 0 {
		t.Fatalf("first look: %d look-ups, %d blind updates; want 2, 0", gets, blind)
	}
	if gets, blind := round(); gets != 0 || blind != 2 {
		t.Fatalf("streams: %d look-ups, %d blind updates; want 0, 2", gets, blind)
	}
	// The client's entry re-created to the listener no more: the blind
	// update misses, the look-up finds it leading elsewhere.
	ft.noReply[listener] = true
	ft.dnat[vip] = netip.MustParseAddrPort("10.3.0.7:3478")
	if gets, blind := round(); gets != 1 || blind != 2 || r.Stats().Elsewhere != 1 {
		t.Fatalf("re-created elsewhere: %d look-ups, %d blind updates, %d elsewhere; want 1, 2, 1", gets, blind, r.Stats().Elsewhere)
	}
	// Idle for a look: looked up again.
	n--
	round()
	if gets, blind := round(); gets != 2 || blind != 0 {
		t.Fatalf("after an idle look: %d look-ups, %d blind updates; want 2, 0", gets, blind)
	}
}

// TestRoundAdvanced: only the flows of bindings whose counters moved since the
// last look are refreshed; the client's entry is looked up by the address the
// program learned (the VIP), and only once it learned one; a missing entry is
// counted, not re-created.
func TestRoundAdvanced(t *testing.T) {
	vip := netip.MustParseAddr("10.96.1.1")
	ft := &fakeTable{missing: map[netip.AddrPort]bool{},
		dnat: map[netip.AddrPort]netip.AddrPort{netip.AddrPortFrom(vip, 3478): netip.MustParseAddrPort("10.0.0.1:3478")}}
	r := New(Config{Dial: func() (Table, func() error, error) { return ft, nil, nil }})
	b := channelmap.Binding{
		Client: netip.MustParseAddrPort("10.1.0.2:40000"), Listener: netip.MustParseAddrPort("10.0.0.1:3478"),
		Channel: 0x4000, Peer: netip.MustParseAddrPort("10.2.0.2:5000"), Relay: netip.MustParseAddrPort("10.0.0.1:50000"),
	}
	round := func(l ...channelmap.Live) {
		t.Helper()
		ft.got, ft.updates = nil, nil
		if err := r.Round(l, defaults); err != nil {
			t.Fatal(err)
		}
	}
	// Nothing relayed yet: nothing to refresh.
	round(channelmap.Live{Binding: b})
	if len(ft.got) != 0 {
		t.Fatalf("idle binding: %d look-ups", len(ft.got))
	}
	// Relayed peer->client only, no reply source learned (cannot happen in
	// the program, which relays to the client only from a learned source):
	// the peer's entry alone.
	round(channelmap.Live{Binding: b, Stats: channelmap.Stats{PeerToClientPackets: 1}})
	if len(ft.got) != 1 || !sameTuple(ft.got[0].TupleOrig, b.Relay, b.Peer) {
		t.Fatalf("look-ups %v, want the relay->peer entry alone", ft.got)
	}
	// The same counters again: nothing.
	round(channelmap.Live{Binding: b, Stats: channelmap.Stats{PeerToClientPackets: 1}})
	if len(ft.got) != 0 {
		t.Fatalf("counters unchanged: %d look-ups", len(ft.got))
	}
	// Learned the VIP, relayed both ways: both entries, the client's by the VIP.
	lb := b
	lb.ReplySource = vip
	round(channelmap.Live{Binding: lb, Stats: channelmap.Stats{ClientToPeerPackets: 5, PeerToClientPackets: 2}})
	if len(ft.updates) != 2 {
		t.Fatalf("updates %v, want the client's and the peer's entries", ft.updates)
	}
	var client bool
	for _, q := range ft.got {
		client = client || sameTuple(q.TupleOrig, b.Client, netip.AddrPortFrom(vip, 3478))
	}
	if !client {
		t.Errorf("look-ups %v, want client->VIP:3478 among them", ft.got)
	}
	// The client's entry deleted: counted once per round, never re-created.
	ft.missing[b.Client] = true
	round(channelmap.Live{Binding: lb, Stats: channelmap.Stats{ClientToPeerPackets: 9, PeerToClientPackets: 2}})
	if len(ft.updates) != 1 || r.Stats().ClientMissing != 1 {
		t.Fatalf("updates %v, %d client entries missing; want the peer's update and 1", ft.updates, r.Stats().ClientMissing)
	}
	// The client's entry back, DNATed to another node: left alone.
	delete(ft.missing, b.Client)
	ft.dnat[netip.AddrPortFrom(vip, 3478)] = netip.MustParseAddrPort("10.3.0.7:3478")
	round(channelmap.Live{Binding: lb, Stats: channelmap.Stats{ClientToPeerPackets: 12, PeerToClientPackets: 2}})
	if len(ft.updates) != 1 || r.Stats().Elsewhere != 1 {
		t.Fatalf("updates %v, %d entries elsewhere; want the peer's update and 1", ft.updates, r.Stats().Elsewhere)
	}
}

// TestRun: the loop looks at the interval the timeouts call for, reads no
// conntrack while the kernel path relays nothing, and refreshes once it does.
func TestRun(t *testing.T) {
	ft := &fakeTable{}
	var dials atomic.Int32
	r := New(Config{
		Timeouts: func() (Timeouts, error) { return Timeouts{Unreplied: time.Second, Stream: time.Second}, nil },
		Dial:     func() (Table, func() error, error) { dials.Add(1); return ft, nil, nil },
	})
	b := channelmap.Binding{
		Client: netip.MustParseAddrPort("10.1.0.2:40000"), Listener: netip.MustParseAddrPort("10.0.0.1:3478"),
		Channel: 0x4000, Peer: netip.MustParseAddrPort("10.2.0.2:5000"), Relay: netip.MustParseAddrPort("10.0.0.1:50000"),
	}
	looks := make(chan bool, 100)
	var n uint64
	stop := make(chan struct{})
	done := make(chan struct{})
	start := time.Now()
	go func() {
		defer close(done)
		r.Run(stop, func() ([]channelmap.Live, bool, error) {
			n++
			attached := n > 2 // the first two looks: XDP not attached
			looks <- attached
			return []channelmap.Live{{Binding: b, Stats: channelmap.Stats{ClientToPeerPackets: n}}}, attached, nil
		})
	}()
	for i := 0; i < 4; i++ {
		if attached := <-looks; !attached && dials.Load() != 0 {
			t.Fatalf("look %d: dialled conntrack while nothing was attached", i)
		}
	}
	close(stop)
	<-done
	// 1 s timeouts: a look every MinInterval (a quarter would be less).
	if d := time.Since(start); d < 4*MinInterval {
		t.Errorf("4 looks in %v: faster than every %v", d, MinInterval)
	}
	if dials.Load() != 1 || r.Stats().Refreshed == 0 {
		t.Errorf("%d dials, stats %+v: want one dial and refreshes once attached", dials.Load(), r.Stats())
	}
}

// TestRoundTranslated: a source-NATed relay<->peer flow (a masquerade) the
// kernel path relays from its translated relay is refreshed while its entry
// maps the relay there, and left alone once it maps it elsewhere (the
// mirror's gate moves the binding) or the binding relays untranslated.
func TestRoundTranslated(t *testing.T) {
	relay, wire := netip.MustParseAddrPort("192.168.77.10:50000"), netip.MustParseAddrPort("10.244.0.0:31000")
	ft := &fakeTable{snat: map[netip.AddrPort]netip.AddrPort{relay: wire}, status: conntrack.StatusConfirmed}
	r := New(Config{Dial: func() (Table, func() error, error) { return ft, nil, nil }})
	b := channelmap.Binding{
		Client: netip.MustParseAddrPort("10.1.0.2:40000"), Listener: netip.MustParseAddrPort("192.168.77.10:3478"),
		Channel: 0x4000, Peer: netip.MustParseAddrPort("10.244.1.5:5002"), Relay: relay, Wire: wire,
	}
	var n uint64
	round := func(b channelmap.Binding) {
		t.Helper()
		ft.got, ft.updates = nil, nil
		n++
		if err := r.Round([]channelmap.Live{{Binding: b, Stats: channelmap.Stats{ClientToPeerPackets: n}}}, defaults); err != nil {
			t.Fatal(err)
		}
	}
	round(b)
	if len(ft.got) != 1 || !sameTuple(ft.got[0].TupleOrig, relay, b.Peer) || len(ft.updates) != 1 {
		t.Fatalf("look-ups %v, updates %v; want pion's relay->peer entry looked up and refreshed", ft.got, ft.updates)
	}
	// The entry maps the relay to another port now: not this binding's mapping.
	ft.snat[relay] = netip.MustParseAddrPort("10.244.0.0:42000")
	round(b)
	if len(ft.updates) != 0 || r.Stats().Elsewhere != 1 {
		t.Fatalf("updates %v, %d elsewhere; want none and 1", ft.updates, r.Stats().Elsewhere)
	}
	// A binding relaying untranslated while the node translates: elsewhere too.
	b.Wire = netip.AddrPort{}
	round(b)
	if len(ft.updates) != 0 || r.Stats().Elsewhere != 2 {
		t.Fatalf("updates %v, %d elsewhere; want none and 2", ft.updates, r.Stats().Elsewhere)
	}
	// Untranslated on both sides: refreshed.
	delete(ft.snat, relay)
	round(b)
	if len(ft.updates) != 1 || r.Stats().Elsewhere != 2 {
		t.Fatalf("updates %v, %d elsewhere; want one and still 2", ft.updates, r.Stats().Elsewhere)
	}
}
