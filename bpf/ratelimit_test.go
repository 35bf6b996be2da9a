package bpf_test

import (
	"testing"
	"time"

	"github.com/l7mp/stunnerd-xdp/bpf"
	"github.com/l7mp/stunnerd-xdp/internal/channelmap"
	"github.com/l7mp/stunnerd-xdp/test/model"
	"github.com/l7mp/stunnerd-xdp/test/packet"
)

const xdpDrop = uint32(model.Drop)

// setRateLimit sets the limit in the program (its map: no reload) and in the
// model.
func (e *env) setRateLimit(t testing.TB, m *model.Model, r channelmap.RateLimit) {
	t.Helper()
	if err := e.maps.SetRateLimit(r); err != nil {
		t.Fatal(err)
	}
	me := e.modelEnv()
	me.RateLimit = r
	m.SetEnv(me)
}

// owe sets what b's allocation owes its rate limit in its bucket and in the
// model: BPF_PROG_RUN cannot fake time, so a test moves the debt instead of
// the clock.
func (e *env) owe(t testing.TB, m *model.Model, b channelmap.Binding, s model.RateState) {
	t.Helper()
	id := e.allocID(t, b)
	if err := e.prog.Maps().AllocRates.Put(id, bpf.RelayAllocRate{PktTat: s.PacketTAT, ByteTat: s.ByteTAT}); err != nil {
		t.Fatal(err)
	}
	m.SetRateState(b.Relay, s)
}

func (e *env) allocID(t testing.TB, b channelmap.Binding) uint32 {
	t.Helper()
	id, ok := e.maps.AllocID(b.Relay)
	if !ok {
		t.Fatalf("no allocation id for %v", b.Relay)
	}
	return id
}

// owed reads what b's allocation owes in the kernel and checks it against the
// model's within tolerance (the two read the clock microseconds apart).
func (e *env) owed(t testing.TB, m *model.Model, b channelmap.Binding) model.RateState {
	t.Helper()
	var ar bpf.RelayAllocRate
	if err := e.prog.Maps().AllocRates.Lookup(e.allocID(t, b), &ar); err != nil {
		t.Fatal(err)
	}
	got, want := model.RateState{PacketTAT: ar.PktTat, ByteTAT: ar.ByteTat}, m.RateState(b.Relay)
	near := func(a, b uint64) bool { return max(a, b)-min(a, b) < uint64(5*time.Millisecond) }
	if !near(got.PacketTAT, want.PacketTAT) || !near(got.ByteTAT, want.ByteTAT) {
		t.Errorf("allocation %v owes %+v in the kernel, %+v in the model", b.Relay, got, want)
	}
	return got
}

// wantLimited runs a client frame on a0 and a peer frame on b0 and wants both
// over the limit with the given verdict.
func (e *env) wantLimited(t testing.TB, m *model.Model, verdict uint32, c2pIngress string, c2p []byte, p2cIngress string, p2c []byte) {
	t.Helper()
	for _, f := range []struct {
		ingress string
		frame   []byte
	}{{c2pIngress, c2p}, {p2cIngress, p2c}} {
		got, _ := e.check(t, m, f.ingress, f.frame)
		if got.verdict != verdict || got.reason != bpf.RelayReasonREASON_RATE_LIMITED {
			t.Fatalf("over the limit (%s): %v %s, want %v rate_limited", f.ingress, model.Verdict(got.verdict), reasonName(got.reason), model.Verdict(verdict))
		}
	}
}

func relayed(v uint32) bool { return v == xdpRedirect || v == xdpTX }

// TestRateLimit: an allocation under its limit is relayed and charged; over
// it, a packet is dropped or passed untouched (as configured) and charged
// nothing; time pays the debt back; both directions and all the allocation's
// channels draw on one budget, other allocations on their own; packets that
// pass for another reason are not charged. Every packet goes through the
// model too (e.check).
func TestRateLimit(t *testing.T) {
	e := newEnv(t)
	m := e.install(t)
	b := bindings["redirect"]
	c2p := func() []byte {
		return fromClient(b, "10.100.0.1", packet.ChannelData(b.Channel, data(100), nil)).Marshal()
	}
	p2c := fromPeer(b, data(100)).Marshal()
	ms := uint64(time.Millisecond)

	// 25 pps: a packet costs 40 ms, the burst is 50 ms: from nothing owed, 2
	// packets go at once (owing 0, 40 ms before each) and the 3rd waits (owing
	// 80 ms, less the time the test took: up to 30 ms of it on a loaded
	// machine still leaves it over the burst).
	e.setRateLimit(t, m, channelmap.RateLimit{PacketsPerSecond: 25})
	e.owe(t, m, b, model.RateState{})
	for i, f := range []struct {
		ingress string
		frame   []byte
	}{{"a0", c2p()}, {"b0", p2c}} {
		if got, _ := e.check(t, m, f.ingress, f.frame); !relayed(got.verdict) {
			t.Fatalf("packet %d of the burst: %v %s, want relayed", i, model.Verdict(got.verdict), reasonName(got.reason))
		}
	}
	before := e.owed(t, m, b)
	e.wantLimited(t, m, xdpDrop, "a0", c2p(), "b0", p2c)
	if after := e.owed(t, m, b); after != before {
		t.Fatalf("a dropped packet was charged: owed %+v, then %+v", before, after)
	}

	// Time passing is the debt shrinking: at 50 pps (20 ms a packet), 90 ms
	// owed is over the burst; 30 ms owed (as 60 ms later) goes and owes 20 ms
	// more.
	e.setRateLimit(t, m, channelmap.RateLimit{PacketsPerSecond: 50})
	now := model.MonotonicNow()
	e.owe(t, m, b, model.RateState{PacketTAT: now + 90*ms})
	if got, _ := e.check(t, m, "a0", c2p()); got.verdict != xdpDrop {
		t.Fatalf("90 ms owed: %v, want DROP", model.Verdict(got.verdict))
	}
	e.owe(t, m, b, model.RateState{PacketTAT: now + 30*ms})
	if got, _ := e.check(t, m, "a0", c2p()); !relayed(got.verdict) {
		t.Fatalf("30 ms owed: %v %s, want relayed", model.Verdict(got.verdict), reasonName(got.reason))
	}
	if o := e.owed(t, m, b); o.PacketTAT != now+50*ms {
		t.Fatalf("after relaying with 30 ms owed: owes until now+%v, want now+50ms", time.Duration(o.PacketTAT-now))
	}

	// Pass instead of drop: the same program, the map changed. The packet
	// leaves untouched for pion/turn, whose relay limits it the same way.
	e.setRateLimit(t, m, channelmap.RateLimit{PacketsPerSecond: 50, Pass: true})
	e.owe(t, m, b, model.RateState{PacketTAT: model.MonotonicNow() + 90*ms})
	e.wantLimited(t, m, xdpPass, "a0", c2p(), "b0", p2c)

	// Bytes: 1000 B/s, 100 bytes of data cost 100 ms: one packet goes, the
	// next is over. The packet limit off.
	e.setRateLimit(t, m, channelmap.RateLimit{BytesPerSecond: 1000})
	e.owe(t, m, b, model.RateState{})
	if got, _ := e.check(t, m, "b0", p2c); !relayed(got.verdict) {
		t.Fatalf("byte limit, first packet: %v %s, want relayed", model.Verdict(got.verdict), reasonName(got.reason))
	}
	if got, _ := e.check(t, m, "a0", c2p()); got.verdict != xdpDrop || got.reason != bpf.RelayReasonREASON_RATE_LIMITED {
		t.Fatalf("byte limit, second packet: %v %s, want DROP rate_limited", model.Verdict(got.verdict), reasonName(got.reason))
	}
	e.owed(t, m, b)

	// Another allocation's budget is its own; a packet that passes for another reason
	// (no neighbour for its peer) is not charged.
	other, noneigh := bindings["tx"], bindings["noneigh"]
	e.owe(t, m, other, model.RateState{})
	if got, _ := e.check(t, m, "a0", fromClient(other, "10.100.0.1", packet.ChannelData(other.Channel, data(100), nil)).Marshal()); got.verdict != xdpTX {
		t.Fatalf("another binding: %v %s, want TX", model.Verdict(got.verdict), reasonName(got.reason))
	}
	e.owe(t, m, noneigh, model.RateState{})
	if got, _ := e.check(t, m, "a0", fromClient(noneigh, "10.100.0.1", packet.ChannelData(noneigh.Channel, data(100), nil)).Marshal()); got.reason != bpf.RelayReasonREASON_FIB_NO_NEIGH {
		t.Fatalf("no neighbour: %s, want pass_fib_no_neigh", reasonName(got.reason))
	}
	if o := e.owed(t, m, noneigh); o != (model.RateState{}) {
		t.Fatalf("a packet passed for want of a neighbour was charged: %+v", o)
	}

	// One allocation's channels share its budget: at 5 pps one packet costs
	// 200 ms, four times the burst, so a packet on one channel leaves the
	// next on the other over the limit (for 150 ms: a loaded machine's
	// scheduling cannot refill it in between).
	sibling := channelmap.Binding{Client: b.Client, Listener: b.Listener, Channel: 0x4010,
		Peer: ap("10.200.0.2:5050"), Relay: b.Relay, ReplySource: b.ReplySource}
	bs := append(sortedBindings(), sibling)
	e.replace(t, bs)
	m = e.newModel(t, bs)
	e.setRateLimit(t, m, channelmap.RateLimit{PacketsPerSecond: 5})
	if a, s := e.allocID(t, b), e.allocID(t, sibling); a != s {
		t.Fatalf("two channels of one allocation have buckets %d and %d", a, s)
	}
	onSibling := func() []byte {
		return fromClient(sibling, "10.100.0.1", packet.ChannelData(sibling.Channel, data(100), nil)).Marshal()
	}
	if got, _ := e.check(t, m, "a0", c2p()); !relayed(got.verdict) {
		t.Fatalf("the allocation's first packet: %v %s, want relayed", model.Verdict(got.verdict), reasonName(got.reason))
	}
	e.wantLimited(t, m, xdpDrop, "a0", onSibling(), "b0", p2c)
	e.owed(t, m, sibling)

	// Off: what is owed no longer matters.
	e.setRateLimit(t, m, channelmap.RateLimit{})
	e.owe(t, m, b, model.RateState{PacketTAT: model.MonotonicNow() + uint64(time.Second)})
	if got, _ := e.check(t, m, "a0", c2p()); !relayed(got.verdict) {
		t.Fatalf("limit off: %v %s, want relayed", model.Verdict(got.verdict), reasonName(got.reason))
	}
}
