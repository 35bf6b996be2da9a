package bpf_test

import (
	"errors"
	"net/netip"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/l7mp/stunnerd-xdp/bpf"
	"github.com/l7mp/stunnerd-xdp/internal/channelmap"
	"github.com/l7mp/stunnerd-xdp/test/model"
	"github.com/l7mp/stunnerd-xdp/test/packet"
)

// chargeSlack is how far apart the last charge's clock reads could be: the
// program read it somewhere between the model's instant and this much later
// (on a loaded machine, milliseconds).
var chargeSlack time.Duration

// charge runs the charge program for a datagram of n bytes to relay's
// allocation (bucket id) and the model's Charge at the instant before it, and
// wants both to say the same (over or not).
func (e *env) charge(t testing.TB, m *model.Model, relay netip.AddrPort, id uint32, n int) bool {
	t.Helper()
	at := model.MonotonicNow()
	over, err := e.maps.Charge(id, n)
	if err != nil {
		t.Fatal(err)
	}
	chargeSlack = time.Duration(model.MonotonicNow()-at) + time.Millisecond
	clock := m.Now
	m.Now = func() uint64 { return at }
	want := m.Charge(relay, n)
	m.Now = clock
	if over != want {
		t.Fatalf("charge of %d bytes to %v: over %v, the model says %v", n, relay, over, want)
	}
	return over
}

// bucket reads bucket id in the kernel.
func (e *env) bucket(t testing.TB, id uint32) model.RateState {
	t.Helper()
	var ar bpf.RelayAllocRate
	if err := e.prog.Maps().AllocRates.Lookup(id, &ar); err != nil {
		t.Fatal(err)
	}
	return model.RateState{PacketTAT: ar.PktTat, ByteTAT: ar.ByteTat}
}

// charged reads bucket id after a charge and wants it to owe what the model's
// does, within the charge's clock reads (chargeSlack).
func (e *env) charged(t testing.TB, m *model.Model, relay netip.AddrPort, id uint32) model.RateState {
	t.Helper()
	got, want := e.bucket(t, id), m.RateState(relay)
	near := func(a, b uint64) bool { return time.Duration(max(a, b)-min(a, b)) <= chargeSlack }
	if !near(got.PacketTAT, want.PacketTAT) || !near(got.ByteTAT, want.ByteTAT) {
		t.Errorf("allocation %v owes %+v in the kernel, %+v in the model (clock reads within %v)", relay, got, want, chargeSlack)
	}
	return got
}

// TestChargeProgram: the charge program (userspace's charge of a datagram
// pion/turn relays) draws on the bucket the relay program charges its
// allocation's packets to, with the same GCRA (the model's): both paths
// together stay within one budget; over the limit nothing is charged, pass
// or drop; the byte limit counts the datagram's data; no limit charges
// nothing; an allocation without a binding has a bucket of its own for as
// long as its relay socket holds it.
func TestChargeProgram(t *testing.T) {
	e := newEnv(t)
	m := e.install(t)
	b := bindings["redirect"]
	c2p := func() []byte {
		return fromClient(b, "10.100.0.1", packet.ChannelData(b.Channel, data(100), nil)).Marshal()
	}
	ms := uint64(time.Millisecond)
	id, err := e.maps.HoldAlloc(b.Relay)
	if err != nil {
		t.Fatal(err)
	}
	if bound := e.allocID(t, b); id != bound {
		t.Fatalf("the relay socket holds bucket %d, the allocation's bindings carry %d", id, bound)
	}

	// 5 pps: a packet costs 200 ms, four times the burst: from nothing
	// owed, one packet goes on either path and leaves the other path over
	// the limit (for 150 ms: a loaded machine's scheduling cannot refill it
	// in between).
	e.setRateLimit(t, m, channelmap.RateLimit{PacketsPerSecond: 5})
	e.owe(t, m, b, model.RateState{})
	if e.charge(t, m, b.Relay, id, 100) {
		t.Fatal("first datagram over the limit")
	}
	before := e.charged(t, m, b.Relay, id)
	if got, _ := e.check(t, m, "a0", c2p()); got.verdict != xdpDrop || got.reason != bpf.RelayReasonREASON_RATE_LIMITED {
		t.Fatalf("kernel packet after a userspace charge: %v %s, want DROP rate_limited", model.Verdict(got.verdict), reasonName(got.reason))
	}
	if !e.charge(t, m, b.Relay, id, 100) {
		t.Fatal("second userspace datagram within the limit")
	}
	if after := e.bucket(t, id); after != before {
		t.Fatalf("datagrams over the limit were charged: owed %+v, then %+v", before, after)
	}
	e.owe(t, m, b, model.RateState{})
	if got, _ := e.check(t, m, "a0", c2p()); !relayed(got.verdict) {
		t.Fatalf("kernel packet, nothing owed: %v %s, want relayed", model.Verdict(got.verdict), reasonName(got.reason))
	}
	if !e.charge(t, m, b.Relay, id, 100) {
		t.Fatal("userspace datagram after a kernel packet within the limit")
	}

	// 50 pps, a burst of 50 ms: from nothing owed three datagrams go at
	// once, the program's GCRA.
	e.setRateLimit(t, m, channelmap.RateLimit{PacketsPerSecond: 50})
	e.owe(t, m, b, model.RateState{})
	for i := 0; i < 3; i++ {
		if e.charge(t, m, b.Relay, id, 100) {
			t.Fatalf("datagram %d of the burst over the limit", i)
		}
	}

	// Time passing is the debt shrinking: 500 ms owed is over, 45 ms (less
	// what passed since) goes and owes one packet (20 ms) more. The debts
	// leave a loaded machine's scheduling room either side of the burst.
	now := model.MonotonicNow()
	e.owe(t, m, b, model.RateState{PacketTAT: now + 500*ms})
	if !e.charge(t, m, b.Relay, id, 100) {
		t.Fatal("500 ms owed: within the limit")
	}
	e.owe(t, m, b, model.RateState{PacketTAT: now + 45*ms})
	if e.charge(t, m, b.Relay, id, 100) {
		t.Fatal("45 ms owed: over the limit")
	}
	if o := e.charged(t, m, b.Relay, id); o.PacketTAT != now+65*ms {
		t.Fatalf("after a charge with 45 ms owed: owes until now+%v, want now+65ms", time.Duration(o.PacketTAT-now))
	}

	// Pass: the kernel hands its packet over the limit to pion/turn, whose
	// charge of it is over too (and charges nothing): userspace drops it.
	e.setRateLimit(t, m, channelmap.RateLimit{PacketsPerSecond: 50, Pass: true})
	e.owe(t, m, b, model.RateState{PacketTAT: model.MonotonicNow() + 500*ms})
	if got, _ := e.check(t, m, "a0", c2p()); got.verdict != xdpPass || got.reason != bpf.RelayReasonREASON_RATE_LIMITED {
		t.Fatalf("pass over the limit: %v %s, want PASS rate_limited", model.Verdict(got.verdict), reasonName(got.reason))
	}
	if !e.charge(t, m, b.Relay, id, 100) {
		t.Fatal("pass: the passed packet's userspace charge is within the limit")
	}

	// Bytes: 1000 B/s, 100 bytes cost 100 ms: one datagram goes, the next
	// (on either path) is over; the length is the datagram's data.
	e.setRateLimit(t, m, channelmap.RateLimit{BytesPerSecond: 1000})
	e.owe(t, m, b, model.RateState{})
	if e.charge(t, m, b.Relay, id, 100) {
		t.Fatal("byte limit: the first datagram over")
	}
	if o := e.charged(t, m, b.Relay, id); o.ByteTAT < model.MonotonicNow()+90*ms {
		t.Fatalf("100 bytes at 1000 B/s: owes until %v from now, want ~100 ms", time.Duration(o.ByteTAT-model.MonotonicNow()))
	}
	if got, _ := e.check(t, m, "a0", c2p()); got.verdict != xdpDrop {
		t.Fatalf("byte limit, kernel packet after a userspace one: %v, want DROP", model.Verdict(got.verdict))
	}
	e.owe(t, m, b, model.RateState{})
	if e.charge(t, m, b.Relay, id, 10) || e.charge(t, m, b.Relay, id, 10) {
		t.Fatal("byte limit: two 10-byte datagrams (20 ms) over")
	}

	// Off: nothing is charged, nothing is over.
	e.setRateLimit(t, m, channelmap.RateLimit{})
	owed := model.RateState{PacketTAT: model.MonotonicNow() + uint64(time.Second)}
	e.owe(t, m, b, owed)
	if e.charge(t, m, b.Relay, id, 100) {
		t.Fatal("limit off: over")
	}
	if got := e.bucket(t, id); got.PacketTAT != owed.PacketTAT {
		t.Fatalf("limit off: the bucket owes %d, want %d untouched", got.PacketTAT, owed.PacketTAT)
	}

	// An allocation without a binding (Send indications only) has its own
	// bucket while its socket holds it; its bindings get the same; the id
	// outlives them until the socket lets go.
	e.setRateLimit(t, m, channelmap.RateLimit{PacketsPerSecond: 5})
	lone := netip.MustParseAddrPort("10.200.0.1:40999")
	lid, err := e.maps.HoldAlloc(lone)
	if err != nil {
		t.Fatal(err)
	}
	if lid == id {
		t.Fatalf("two allocations share bucket %d", id)
	}
	if again, _ := e.maps.HoldAlloc(lone); again != lid {
		t.Fatalf("held twice: buckets %d and %d", lid, again)
	}
	if e.charge(t, m, lone, lid, 100) {
		t.Fatal("an allocation's first datagram over the limit")
	}
	if !e.charge(t, m, lone, lid, 100) {
		t.Fatal("5 pps: the second datagram at once within the limit")
	}
	nb := channelmap.Binding{Client: b.Client, Listener: b.Listener, Channel: 0x4011, Peer: netip.MustParseAddrPort("10.200.0.2:5051"), Relay: lone}
	if err := e.maps.Upsert(nb); err != nil {
		t.Fatal(err)
	}
	if got := e.allocID(t, nb); got != lid {
		t.Fatalf("a binding of a held allocation carries bucket %d, the socket holds %d", got, lid)
	}
	if err := e.maps.Delete(nb.Key()); err != nil {
		t.Fatal(err)
	}
	if got, ok := e.maps.AllocID(lone); !ok || got != lid {
		t.Fatalf("after its last binding went the held allocation has bucket %d (%v), want %d", got, ok, lid)
	}
	e.maps.ReleaseAlloc(lone)
	if _, ok := e.maps.AllocID(lone); ok {
		t.Fatal("released allocation still has a bucket")
	}
	if _, err := e.maps.Charge(e.prog.Maps().AllocRates.MaxEntries(), 1); !errors.Is(err, channelmap.ErrNoBucket) {
		t.Fatalf("charge of an id outside alloc_rates: %v, want ErrNoBucket", err)
	}
}

// BenchmarkCharge is userspace's cost per relayed datagram under a limit: one
// BPF_PROG_RUN of the charge program (channelmap.Maps.Charge). For
// comparison, "lookup+update" is the read and write of the bucket under
// BPF_F_LOCK from Go, which would not even be one step (a charge the engines
// made in between is lost), and "getppid" one bare system call (a charge is
// one BPF_PROG_RUN system call).
func BenchmarkCharge(b *testing.B) {
	e := newEnv(b)
	if err := e.maps.SetRateLimit(channelmap.RateLimit{PacketsPerSecond: 1 << 30}); err != nil {
		b.Fatal(err)
	}
	id, err := e.maps.HoldAlloc(netip.MustParseAddrPort("10.200.0.1:40000"))
	if err != nil {
		b.Fatal(err)
	}
	b.Run("prog-run", func(b *testing.B) {
		for b.Loop() {
			if _, err := e.maps.Charge(id, 100); err != nil {
				b.Fatal(err)
			}
		}
	})
	// The scale: one bare system call on this machine.
	b.Run("getppid", func(b *testing.B) {
		for b.Loop() {
			unix.Getppid()
		}
	})
	b.Run("lookup+update", func(b *testing.B) {
		rates := e.prog.Maps().AllocRates
		var ar bpf.RelayAllocRate
		for b.Loop() {
			if err := rates.LookupWithFlags(id, &ar, ebpf.LookupLock); err != nil {
				b.Fatal(err)
			}
			ar.PktTat += 1
			if err := rates.Update(id, &ar, ebpf.UpdateLock); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// FuzzChargeVsModel: the charge program against model.Charge for any limit
// (packets, bytes, pass or drop), any debt in the allocation's bucket (behind
// or ahead of now, in 100 µs steps) and any datagram length. The verdicts
// must agree unless a debt is within 10 ms (and the clock reads' spread) of
// the burst's edge: the program and the model read the clock apart, by
// milliseconds on a loaded machine; the debts after it too, within that
// spread.
func FuzzChargeVsModel(f *testing.F) {
	e := newEnv(f)
	bs := sortedBindings()
	e.replace(f, bs)
	b := bindings["redirect"]
	id, err := e.maps.HoldAlloc(b.Relay)
	if err != nil {
		f.Fatal(err)
	}
	f.Add(uint16(50), uint32(0), int16(0), int16(0), uint16(100), false)
	f.Add(uint16(50), uint32(0), int16(700), int16(0), uint16(100), false)
	f.Add(uint16(5), uint32(1000), int16(300), int16(-300), uint16(1200), true)
	f.Add(uint16(0), uint32(1000), int16(0), int16(600), uint16(65535), false)
	f.Add(uint16(0), uint32(0), int16(32767), int16(32767), uint16(1), false)
	f.Fuzz(func(t *testing.T, pps uint16, bps uint32, pktOff, byteOff int16, dataLen uint16, pass bool) {
		m := e.newModel(t, bs)
		e.setRateLimit(t, m, channelmap.RateLimit{PacketsPerSecond: uint64(pps), BytesPerSecond: uint64(bps), Pass: pass})
		step := int64(100 * time.Microsecond)
		now := int64(model.MonotonicNow())
		e.owe(t, m, b, model.RateState{PacketTAT: uint64(now + int64(pktOff)*step), ByteTAT: uint64(now + int64(byteOff)*step)})
		at := model.MonotonicNow()
		over, err := e.maps.Charge(id, int(dataLen))
		if err != nil {
			t.Fatal(err)
		}
		// The program read the clock somewhere in [now, after] (the debt was
		// set at now): on a loaded machine milliseconds apart.
		after := model.MonotonicNow()
		slack := time.Duration(after-uint64(now)) + time.Millisecond
		m.Now = func() uint64 { return at }
		want := m.Charge(b.Relay, int(dataLen))
		edge := func(off int16) bool {
			d := time.Duration(int64(off)*step) - channelmap.RateBurst
			return d > -slack-10*time.Millisecond && d < slack+10*time.Millisecond
		}
		if over != want {
			if edge(pktOff) || edge(byteOff) {
				return
			}
			t.Fatalf("limit %d pps %d B/s, owing %v and %v, %d bytes: over %v, the model says %v", pps, bps,
				time.Duration(int64(pktOff)*step), time.Duration(int64(byteOff)*step), dataLen, over, want)
		}
		got, st := e.bucket(t, id), m.RateState(b.Relay)
		near := func(a, b uint64) bool { return time.Duration(max(a, b)-min(a, b)) <= slack }
		if !near(got.PacketTAT, st.PacketTAT) || !near(got.ByteTAT, st.ByteTAT) {
			t.Fatalf("limit %d pps %d B/s, %d bytes: the bucket owes %+v, the model %+v (clock read within %v)", pps, bps, dataLen, got, st, slack)
		}
	})
}
