package bpf_test

import (
	"bytes"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/l7mp/stunnerd-xdp/bpf"
	"github.com/l7mp/stunnerd-xdp/internal/channelmap"
	"github.com/l7mp/stunnerd-xdp/internal/loader"
	"github.com/l7mp/stunnerd-xdp/test/model"
	"github.com/l7mp/stunnerd-xdp/test/packet"
	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// The TC engine (relay_tc.c) through BPF_PROG_RUN in the shared environment,
// against model.ProcessTC: the same golden and hostile rows as the XDP
// program, the rows where the engines differ, and the engine's own verdicts.

// skBuff is struct __sk_buff up to hwtstamp (uapi/linux/bpf.h): BPF_PROG_RUN
// takes ifindex, ingress_ifindex and gso_size from it.
type skBuff struct {
	Len, PktType, Mark, QueueMapping, Protocol, VlanPresent, VlanTci, VlanProto uint32
	Priority, IngressIfindex, Ifindex, TcIndex                                  uint32
	Cb                                                                          [5]uint32
	Hash, TcClassid, Data, DataEnd, NapiID, Family, RemoteIP4, LocalIP4         uint32
	RemoteIP6, LocalIP6                                                         [4]uint32
	RemotePort, LocalPort, DataMeta                                             uint32
	FlowKeys, Tstamp                                                            uint64
	WireLen, GsoSegs                                                            uint32
	Sk                                                                          uint64
	GsoSize                                                                     uint32
	TstampType                                                                  uint8
	_                                                                           [3]byte
	Hwtstamp                                                                    uint64
}

// BPF_F_TEST_SKB_CHECKSUM_COMPLETE: the skb starts CHECKSUM_COMPLETE, and the
// run fails with EBADMSG if the program leaves skb->csum wrong.
const testSkbChecksumComplete = 1 << 2

// tcEnv is the shared environment with the TC engine loaded over its maps.
type tcEnv struct {
	*env
	tc *loader.TC
	// ctxOut is the __sk_buff the last runTC returned.
	ctxOut skBuff
	// complete: this kernel's BPF_PROG_RUN starts an skb CHECKSUM_COMPLETE
	// (BPF_F_TEST_SKB_CHECKSUM_COMPLETE, which 5.10 and 6.1 refuse): only
	// then do the tests run CHECKSUM_COMPLETE skbs (live traffic has them
	// everywhere).
	complete bool
}

// completeRuns tells whether BPF_PROG_RUN takes
// BPF_F_TEST_SKB_CHECKSUM_COMPLETE, with a run of a frame the engine passes
// (not IP), before any test counts the engine's verdicts.
func (e *tcEnv) completeRuns(t testing.TB) bool {
	t.Helper()
	frame := make([]byte, 60)
	frame[12], frame[13] = 0x08, 0x06 // ARP
	var err error
	if doErr := e.ns.Do(func() error {
		opts := ebpf.RunOptions{Data: frame, DataOut: make([]byte, len(frame)+512),
			Context: skBuff{Ifindex: uint32(e.ifaces["a0"].index)}, Flags: testSkbChecksumComplete}
		_, err = e.tc.Prog().Run(&opts)
		return nil
	}); doErr != nil {
		t.Fatal(doErr)
	}
	if errors.Is(err, unix.EINVAL) {
		t.Log("BPF_PROG_RUN takes no CHECKSUM_COMPLETE skb on this kernel: CHECKSUM_NONE only")
		return false
	}
	if err != nil {
		t.Fatalf("BPF_PROG_RUN with BPF_F_TEST_SKB_CHECKSUM_COMPLETE: %v", err)
	}
	return true
}

// skbChecksum is kind where this kernel's BPF_PROG_RUN can build it, else
// CHECKSUM_NONE.
func (e *tcEnv) skbChecksum(kind model.Checksum) model.Checksum {
	if kind == model.ChecksumComplete && !e.complete {
		return model.ChecksumNone
	}
	return kind
}

func newTCEnv(t testing.TB) *tcEnv {
	t.Helper()
	return newTCEnvWith(t, false)
}

// newTCEnvWith is newTCEnv with the engine reading the kernel's skb with
// bpf_probe_read_kernel when noKfunc (as it does anyway on kernels without
// bpf_cast_to_kern_ctx).
func newTCEnvWith(t testing.TB, noKfunc bool) *tcEnv {
	t.Helper()
	cfg := progConfig
	cfg.TCNoKfunc = noKfunc
	e := newEnvWith(t, cfg)
	tc, err := e.prog.LoadTC()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tc.Close() })
	te := &tcEnv{env: e, tc: tc}
	te.complete = te.completeRuns(t)
	return te
}

// runTC runs the TC program once on frame as if it arrived on the named
// interface; complete starts the skb CHECKSUM_COMPLETE.
func (e *tcEnv) runTC(t testing.TB, ingress string, frame []byte, skb model.SKB) (uint32, []byte, error) {
	t.Helper()
	var (
		ret uint32
		out []byte
		err error
	)
	if skb.Checksum == model.ChecksumPartial {
		t.Fatal("BPF_PROG_RUN cannot build a CHECKSUM_PARTIAL skb")
	}
	doErr := e.ns.Do(func() error {
		idx := uint32(e.ifaces[ingress].index)
		// The device (skb->dev) the program reads it from; 5.10 sets no
		// ingress_ifindex (skb_iif) in a run.
		ctx := skBuff{Ifindex: idx, Priority: skb.Priority, Mark: skb.Mark}
		if skb.GSO {
			ctx.GsoSize, ctx.GsoSegs = 1000, 2
		}
		e.ctxOut = skBuff{}
		opts := ebpf.RunOptions{Data: frame, DataOut: make([]byte, len(frame)+512), Context: ctx, ContextOut: &e.ctxOut}
		if skb.Checksum == model.ChecksumComplete {
			opts.Flags = testSkbChecksumComplete
		}
		prog := e.tc.Prog()
		if skb.L3 {
			// BPF_PROG_RUN takes the first 14 bytes for an Ethernet header
			// (eth_type_trans) and gives the program the whole buffer, as a
			// device without a link-layer header gives it the IP packet.
			prog = e.tc.ProgL3()
		}
		e.ranAt = model.MonotonicNow()
		ret, err = prog.Run(&opts)
		out = opts.DataOut
		return nil
	})
	if doErr != nil {
		t.Fatal(doErr)
	}
	return ret, out, err
}

func (e *tcEnv) tcVerdicts(t testing.TB) []uint64 {
	t.Helper()
	v, err := e.tc.Verdicts()
	if err != nil {
		t.Fatal(err)
	}
	return v
}

// checkTC runs frame through the TC program and model.ProcessTC (which it
// advances) and fails on any difference: verdict, reason (exactly one TC
// counter moves, by one; no XDP counter moves), output bytes, learned
// listener addresses and per-binding counters.
func (e *tcEnv) checkTC(t testing.TB, m *model.Model, ingress string, frame []byte, skb model.SKB) (observation, model.TCResult) {
	t.Helper()
	before, beforeXDP, beforeTotals := e.tcVerdicts(t), e.verdicts(t), e.totals(t)
	ret, out, err := e.runTC(t, ingress, frame, skb)
	// A relayed CHECKSUM_COMPLETE skb leaves CHECKSUM_NONE (the program
	// shoots one that does not, as tc_rewrite_failed), so its skb->csum is
	// stale, and BPF_PROG_RUN, which compares skb->csum with the bytes
	// whatever ip_summed says, fails the run after the program ran: the
	// counters still tell what it did; the bytes are not returned.
	noBytes := err != nil && skb.Checksum == model.ChecksumComplete && errors.Is(err, unix.EBADMSG)
	if err != nil && !noBytes {
		t.Fatalf("BPF_PROG_RUN: %v", err)
	}
	after, afterXDP, afterTotals := e.tcVerdicts(t), e.verdicts(t), e.totals(t)
	if !equalCounts(beforeXDP, afterXDP) {
		t.Errorf("the TC program moved an XDP verdict counter")
	}
	// bpf_redirect_neigh's counter moves beside the relay reason: compared
	// with the model's RedirectNeigh, then left out of the one that moves.
	neigh := bpf.RelayTcTcReasonTC_REASON_REDIRECT_NEIGH
	neighMoved := after[neigh] - before[neigh]
	after[neigh] = before[neigh]
	got := observation{verdict: ret, out: out, counted: statsDelta(beforeTotals, afterTotals),
		reason: movedByOne(t, before, after, bpf.RelayReason(bpf.RelayTcTcReasonTC_REASON_MAX), tcReasonName)}
	got.neigh = neighMoved
	clock := m.Now
	m.Now = func() uint64 { return e.ranAt }
	want := m.ProcessTC(e.ifaces[ingress].index, frame, skb)
	m.Now = clock
	if noBytes {
		if want.Verdict != model.TCRedirect {
			t.Errorf("BPF_PROG_RUN: %v, for a skb the model says is %v", err, want.Verdict)
		}
		got.verdict, got.out = uint32(model.TCRedirect), want.Frame
	}
	if got.verdict != uint32(want.Verdict) || got.reason != want.Reason {
		t.Errorf("program: %v %s; model: %v %s", model.TCVerdict(got.verdict), tcReasonName(got.reason), want.Verdict, tcReasonName(want.Reason))
	}
	if wantNeigh := map[bool]uint64{false: 0, true: 1}[want.RedirectNeigh]; got.neigh != wantNeigh {
		t.Errorf("tc_redirect_neigh moved by %d, the model says %d", got.neigh, wantNeigh)
	}
	if !bytes.Equal(got.out, want.Frame) {
		t.Errorf("output differs from the model's\nprogram %x\n  model %x", got.out, want.Frame)
	}
	if !noBytes && (e.ctxOut.Priority != want.Priority || e.ctxOut.Mark != want.Mark) {
		t.Errorf("skb priority %d, mark %#x after the program; the model's %d, %#x", e.ctxOut.Priority, e.ctxOut.Mark, want.Priority, want.Mark)
	}
	e.checkEffects(t, m, got.counted, want.Reason, want.Counted, want.DataLen)
	return got, want
}

func equalCounts(a, b []uint64) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

func tcReasonName(r bpf.RelayReason) string {
	switch bpf.RelayTcTcReason(r) {
	case bpf.RelayTcTcReasonTC_REASON_GSO:
		return "tc_gso"
	case bpf.RelayTcTcReasonTC_REASON_PARTIAL_ELSEWHERE:
		return "tc_partial_elsewhere"
	case bpf.RelayTcTcReasonTC_REASON_REWRITE_FAILED:
		return "tc_rewrite_failed"
	case bpf.RelayTcTcReasonTC_REASON_REDIRECT_NEIGH:
		return "tc_redirect_neigh"
	case bpf.RelayTcTcReasonTC_REASON_L3FAMILY:
		return "tc_l3_family"
	case bpf.RelayTcTcReasonTC_REASON_L3OUTER_HEADERS:
		return "tc_l3_outer_headers"
	}
	return reasonName(r)
}

// tcVerdictOf is the TC action for an XDP golden row's verdict.
func tcVerdictOf(xdp uint32) model.TCVerdict {
	switch xdp {
	case xdpTX, xdpRedirect:
		return model.TCRedirect
	case uint32(model.Drop):
		return model.TCShot
	}
	return model.TCNext
}

// TestTCGoldenPackets: under each way this kernel reads the skb (tcSkbReads),
// every golden and hostile row of the XDP program through
// the TC program, as a CHECKSUM_NONE and a CHECKSUM_COMPLETE skb, against the
// model; where the engines agree (everything but an unattached egress and
// the PARTIAL guess, which the TC engine does not make), against the row's
// own expectation too.
func TestTCGoldenPackets(t *testing.T) {
	for _, noKfunc := range tcSkbReads() {
		t.Run(skbReadName(noKfunc), func(t *testing.T) { tcGoldenPackets(t, noKfunc) })
	}
}

// tcSkbReads are the ways of reading the kernel's skb (the noKfunc of
// newTCEnvWith) that this kernel runs: through bpf_cast_to_kern_ctx (6.2+)
// and with bpf_probe_read_kernel (cfg.tc_no_kfunc: the only one before 6.2).
func tcSkbReads() []bool {
	if loader.HaveCastToKernCtx() {
		return []bool{false, true}
	}
	return []bool{true}
}

func skbReadName(noKfunc bool) string {
	if noKfunc {
		return "skb-read=bpf_probe_read_kernel"
	}
	return "skb-read=bpf_cast_to_kern_ctx"
}

func tcGoldenPackets(t *testing.T, noKfunc bool) {
	e := newTCEnvWith(t, noKfunc)
	m := e.install(t)
	var rows []golden
	for _, set := range [][]golden{goldenCases(e.env), goldenCases6(e.env), contractCases(e.env), hostileCases(e.env), hostileCases6(e.env)} {
		rows = append(rows, set...)
	}
	for _, c := range rows {
		if !skbRunnable(c.in) {
			continue
		}
		kinds := []model.Checksum{model.ChecksumNone, model.ChecksumComplete}
		if !e.complete {
			kinds = kinds[:1]
		}
		for _, kind := range kinds {
			t.Run(fmt.Sprintf("%s/ip_summed=%d", c.name, kind), func(t *testing.T) {
				for run := 0; run < 2; run++ {
					got, want := e.checkTC(t, m, c.ingress, c.in, model.SKB{Checksum: kind, Priority: 5, Mark: 0x5eed})
					sameAsXDP := c.reason != bpf.RelayReasonREASON_EGRESS_NOT_ATTACHED && !guessedPartial(c.in)
					if !sameAsXDP {
						continue
					}
					if model.TCVerdict(got.verdict) != tcVerdictOf(c.verdict) || got.reason != c.reason {
						t.Errorf("%v %s, want %v %s", model.TCVerdict(got.verdict), tcReasonName(got.reason), tcVerdictOf(c.verdict), reasonName(c.reason))
					}
					wantOut := c.out
					if wantOut == nil {
						wantOut = c.in
					}
					if !bytes.Equal(got.out, wantOut) {
						t.Fatalf("output differs from the row's\n got %x\nwant %x", got.out, wantOut)
					}
					_ = want
				}
			})
		}
	}
}

// TestTCL3GoldenPackets: on a device without a link-layer header (tunl0,
// WireGuard: tc_turn_relay_l3) every golden and hostile row's packet, its
// Ethernet header taken off, against the model (SKB.L3); a row the engines
// relay alike leaves as the row's own output frame (the Ethernet header put
// in front), except that a relay changing the family passes
// (tc_l3_family). Then the packets the TC engine relays into any egress
// (anyEgressCases), with bpf_redirect and with bpf_redirect_neigh.
func TestTCL3GoldenPackets(t *testing.T) {
	// One way of reading the skb, the kernel's own (the L3 program reads it
	// as the Ethernet one does, which TestTCGoldenPackets runs both ways):
	// the kernel matrix's time.
	for _, noKfunc := range tcSkbReads()[:1] {
		t.Run(skbReadName(noKfunc), func(t *testing.T) { tcL3GoldenPackets(t, noKfunc) })
	}
}

func tcL3GoldenPackets(t *testing.T, noKfunc bool) {
	e := newTCEnvWith(t, noKfunc)
	m := e.install(t)
	var rows []golden
	for _, set := range [][]golden{goldenCases(e.env), goldenCases6(e.env), contractCases(e.env), hostileCases(e.env), hostileCases6(e.env)} {
		rows = append(rows, set...)
	}
	relayed, familyPassed := 0, 0
	for _, c := range rows {
		if len(c.in) < 14 || !skbRunnable(c.in[14:]) {
			continue
		}
		in := c.in[14:]
		kinds := []model.Checksum{model.ChecksumNone, model.ChecksumComplete}
		if !e.complete {
			kinds = kinds[:1]
		}
		for _, kind := range kinds {
			t.Run(fmt.Sprintf("%s/ip_summed=%d", c.name, kind), func(t *testing.T) {
				got, _ := e.checkTC(t, m, c.ingress, in, model.SKB{Checksum: kind, L3: true, Priority: 5, Mark: 0x5eed})
				// The row's expectation holds where its ethertype is what the
				// version nibble says (the L3 program reads only the nibble).
				isIP := c.in[12] == 0x08 && c.in[13] == 0x00 && in[0]>>4 == 4 || c.in[12] == 0x86 && c.in[13] == 0xdd && in[0]>>4 == 6
				if !isIP || c.reason == bpf.RelayReasonREASON_EGRESS_NOT_ATTACHED || guessedPartial(c.in) {
					return
				}
				wantVerdict, wantReason, wantOut := tcVerdictOf(c.verdict), c.reason, c.out
				if wantVerdict == model.TCRedirect && len(c.out) > 14 && (c.in[12] == 0x86) != (c.out[12] == 0x86) {
					wantVerdict, wantReason, wantOut = model.TCNext, bpf.RelayReason(bpf.RelayTcTcReasonTC_REASON_L3FAMILY), nil
					familyPassed++
				} else if wantVerdict == model.TCRedirect {
					relayed++
				}
				if wantOut == nil {
					wantOut = in
				}
				if model.TCVerdict(got.verdict) != wantVerdict || got.reason != wantReason {
					t.Errorf("%v %s, want %v %s", model.TCVerdict(got.verdict), tcReasonName(got.reason), wantVerdict, tcReasonName(wantReason))
				}
				if !bytes.Equal(got.out, wantOut) {
					t.Errorf("output differs from the row's\n got %x\nwant %x", got.out, wantOut)
				}
			})
		}
	}
	if relayed == 0 || familyPassed == 0 {
		t.Errorf("%d rows relayed, %d passed for their family change: the rows do not cover the L3 program", relayed, familyPassed)
	}
	for _, c := range anyEgressCases(e) {
		for _, needsRoute := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/needs-route=%v", c.name, needsRoute), func(t *testing.T) {
				e.setCaps(t, m, c.egress, &model.DevCaps{NeedsRoute: needsRoute, MTU: e.ifaces[c.egress].mtu})
				skb := c.skb
				skb.L3 = true
				got, _ := e.checkTC(t, m, c.ingress, c.in[14:], skb)
				wantReason, wantOut := c.reason, c.want
				if c.in[12] == 0x86 {
					wantReason, wantOut = bpf.RelayReason(bpf.RelayTcTcReasonTC_REASON_L3FAMILY), c.in[14:]
				}
				if got.reason != wantReason || !bytes.Equal(got.out, wantOut) {
					t.Errorf("%v %s, want %s\n got %x\nwant %x", model.TCVerdict(got.verdict), tcReasonName(got.reason), tcReasonName(wantReason), got.out, wantOut)
				}
			})
		}
	}
}

// FuzzTCL3VsModel: FuzzTCVsModel for tc_turn_relay_l3: any bytes from the IP
// header on, on any interface, against the golden bindings (kind: bit 0
// CHECKSUM_COMPLETE, bit 1 GSO).
func FuzzTCL3VsModel(f *testing.F) {
	e := newTCEnv(f)
	bs := sortedBindings()
	e.replace(f, bs)
	e.setShield(f, nil, model.Shield{Junk: true, Allocations: true}, fuzzAllocations(bs, 0), fuzzAllocations(bs, 1))
	for _, c := range append(append(goldenCases(e.env), goldenCases6(e.env)...), hostileCases(e.env)...) {
		if len(c.in) > 14 {
			f.Add(c.in[14:], ingressIndex(c.ingress), uint8(0))
			f.Add(c.in[14:], ingressIndex(c.ingress), uint8(1))
		}
	}
	f.Fuzz(func(t *testing.T, frame []byte, ingress, kind uint8) {
		name := ifaceNames[int(ingress&7)%len(ifaceNames)]
		skb := model.SKB{GSO: kind&2 != 0, L3: true, Priority: 3, Mark: 0xabc}
		if kind&1 != 0 {
			skb.Checksum = e.skbChecksum(model.ChecksumComplete)
		}
		e.fuzzOne(t, bs, name, frame, skb)
	})
}

// skbRunnable tells a frame BPF_PROG_RUN builds an skb of: more than an
// Ethernet header, and with room for the IP header its ethertype names.
func skbRunnable(f []byte) bool {
	if len(f) <= minRunFrame || len(f) > maxRunFrame {
		return false
	}
	switch {
	case f[12] == 0x86 && f[13] == 0xdd:
		return len(f) >= 14+40
	case f[12] == 0x08 && f[13] == 0x00:
		return len(f) >= 14+20
	}
	return true
}

// guessedPartial tells a frame whose UDP checksum field holds its pseudo-header
// sum: the XDP program takes it for CHECKSUM_PARTIAL and sums it afresh; the
// TC engine reads ip_summed and updates it.
func guessedPartial(frame []byte) bool {
	var addrs, udp []byte
	switch {
	case len(frame) >= 14+20+8 && frame[12] == 0x08 && frame[13] == 0x00 && frame[14] == 0x45:
		addrs, udp = frame[26:34], frame[34:]
	case len(frame) >= 14+40+8 && frame[12] == 0x86 && frame[13] == 0xdd:
		addrs, udp = frame[22:54], frame[54:]
	default:
		return false
	}
	s := uint32(17) + uint32(udp[4])<<8 + uint32(udp[5])
	for i := 0; i+1 < len(addrs); i += 2 {
		s += uint32(addrs[i])<<8 | uint32(addrs[i+1])
	}
	for s > 0xffff {
		s = s&0xffff + s>>16
	}
	return uint32(udp[6])<<8|uint32(udp[7]) == s
}

// tcEgressCase is a packet the TC engine relays, with its output built
// independently of the model.
type tcEgressCase struct {
	name, ingress, egress string
	in, want              []byte
	reason                bpf.RelayReason
	skb                   model.SKB
	notAttached           bool // XDP passes it: the egress is not in its devmap
}

// anyEgressCases are the packets XDP passes because the egress is not in its
// devmap (a pod's veth, a tunnel) and the TC engine relays: both directions,
// IPv4 and IPv6 clients.
func anyEgressCases(e *tcEnv) []tcEgressCase {
	a0, e0 := e.ifaces["a0"], e.ifaces["e0"]
	var cases []tcEgressCase
	for _, name := range []string{"notattached", "v6fwdoff6"} {
		b := bindings[name]
		d := data(200)
		listener := "10.100.0.1"
		if b.Client.Addr().Is6() {
			listener = "fd00:100::1"
		}
		in := fromClient(b, listener, packet.ChannelData(b.Channel, d, []byte{7, 7}))
		cases = append(cases, tcEgressCase{name: name + "/c2p", ingress: "a0", egress: "e0", in: in.Marshal(),
			want: toPeer(in, b, e0.mac, otherMAC, d).Marshal(), reason: bpf.RelayReasonREASON_RELAY_C2P_REDIRECT,
			notAttached: true})
	}
	// peer->client from the unattached side, to an IPv4 client on a0.
	b := bindings["notattached"]
	in := fromPeer(b, data(150))
	in.SrcMAC = otherMAC
	cases = append(cases, tcEgressCase{name: "notattached/p2c", ingress: "e0", egress: "a0", in: in.Marshal(),
		want:   toClient(in, b, b.ReplySource, a0.mac, clientMAC, data(150)).Marshal(),
		reason: bpf.RelayReasonREASON_RELAY_P2C_REDIRECT, skb: model.SKB{Checksum: e.skbChecksum(model.ChecksumComplete)}})
	return cases
}

// TestTCAnyEgress: where XDP passes because the egress is not in its devmap
// (a pod's veth, a tunnel), the TC engine relays (anyEgressCases).
func TestTCAnyEgress(t *testing.T) {
	e := newTCEnv(t)
	m := e.install(t)
	for _, c := range anyEgressCases(e) {
		t.Run(c.name, func(t *testing.T) {
			if c.notAttached {
				if got := e.observe(t, c.ingress, c.in); got.reason != bpf.RelayReasonREASON_EGRESS_NOT_ATTACHED {
					t.Fatalf("XDP: %s, want egress_not_attached", reasonName(got.reason))
				}
				m.Process(e.ifaces[c.ingress].index, c.in)
			}
			got, _ := e.checkTC(t, m, c.ingress, c.in, c.skb)
			if model.TCVerdict(got.verdict) != model.TCRedirect || got.reason != c.reason {
				t.Errorf("%v %s, want TC_ACT_REDIRECT %s", model.TCVerdict(got.verdict), tcReasonName(got.reason), reasonName(c.reason))
			}
			if !bytes.Equal(got.out, c.want) {
				t.Errorf("output\n got %x\nwant %x", got.out, c.want)
			}
		})
	}
}

// TestTCRedirectNeigh: into an egress whose dev_caps say its transmit needs a
// route on the skb (DEV_XMIT_NEEDS_ROUTE: tunl0), the TC engine relays the
// same frame with bpf_redirect_neigh and counts tc_redirect_neigh beside the
// relay reason; with the flag unset, bpf_redirect and no such count. The
// anyEgressCases and an XDP_TX row (the egress is the ingress).
func TestTCRedirectNeigh(t *testing.T) {
	e := newTCEnv(t)
	m := e.install(t)
	a0 := e.ifaces["a0"]
	tx := bindings["tx"]
	c2pTX := fromClient(tx, "10.100.0.1", packet.ChannelData(tx.Channel, data(100), nil))
	cases := append(anyEgressCases(e), tcEgressCase{name: "tx/c2p", ingress: "a0", egress: "a0", in: c2pTX.Marshal(),
		want: toPeer(c2pTX, tx, a0.mac, peer2MAC, data(100)).Marshal(), reason: bpf.RelayReasonREASON_RELAY_C2P_TX})
	for _, c := range cases {
		for _, needsRoute := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/needs-route=%v", c.name, needsRoute), func(t *testing.T) {
				e.setCaps(t, m, c.egress, &model.DevCaps{NeedsRoute: needsRoute, MTU: e.ifaces[c.egress].mtu})
				got, want := e.checkTC(t, m, c.ingress, c.in, c.skb)
				if model.TCVerdict(got.verdict) != model.TCRedirect || got.reason != c.reason {
					t.Errorf("%v %s, want TC_ACT_REDIRECT %s", model.TCVerdict(got.verdict), tcReasonName(got.reason), reasonName(c.reason))
				}
				if wantNeigh := map[bool]uint64{false: 0, true: 1}[needsRoute]; got.neigh != wantNeigh || want.RedirectNeigh != needsRoute {
					t.Errorf("tc_redirect_neigh moved by %d (model: %v), want %d", got.neigh, want.RedirectNeigh, wantNeigh)
				}
				if !bytes.Equal(got.out, c.want) {
					t.Errorf("output\n got %x\nwant %x", got.out, c.want)
				}
			})
		}
	}
}

// TestTCGSO: an skb with gso_size set holds several datagrams: it passes,
// counted as such, whatever it carries.
func TestTCGSO(t *testing.T) {
	e := newTCEnv(t)
	m := e.install(t)
	b := bindings["redirect"]
	for name, f := range map[string][]byte{
		"c2p": fromClient(b, "10.100.0.1", packet.ChannelData(b.Channel, data(100), nil)).Marshal(),
		"p2c": fromPeer(b, data(100)).Marshal(),
	} {
		t.Run(name, func(t *testing.T) {
			got, _ := e.checkTC(t, m, "a0", f, model.SKB{GSO: true})
			if got.verdict != uint32(model.TCNext) || got.reason != bpf.RelayReason(bpf.RelayTcTcReasonTC_REASON_GSO) {
				t.Errorf("%v %s", model.TCVerdict(got.verdict), tcReasonName(got.reason))
			}
			if !bytes.Equal(got.out, f) {
				t.Errorf("a passed skb changed")
			}
		})
	}
}

// FuzzTCVsModel: FuzzRelayVsModel for the TC engine: any frame on any
// interface against the golden bindings, as a CHECKSUM_NONE or
// CHECKSUM_COMPLETE skb, with or without gso_size (kind: bit 0 COMPLETE, bit
// 1 GSO); when bits 2-7 of kind are not all zero, they are the dev_caps
// (fuzzCapsByte's bits 0-4 from bits 2-6, its bit 6, needs a route, from bit
// 7) of the interface bits 3-5 of ingress name (bits 0-2 the ingress).
func FuzzTCVsModel(f *testing.F) {
	e := newTCEnv(f)
	bs := sortedBindings()
	e.replace(f, bs)
	e.setShield(f, nil, model.Shield{Junk: true, Allocations: true}, fuzzAllocations(bs, 0), fuzzAllocations(bs, 1))
	for _, c := range append(goldenCases(e.env), hostileCases(e.env)...) {
		f.Add(c.in, ingressIndex(c.ingress), uint8(0))
		f.Add(c.in, ingressIndex(c.ingress), uint8(1))
	}
	redirect := bindings["redirect"]
	f.Add(fromClient(redirect, "10.100.0.1", packet.ChannelData(redirect.Channel, data(64), nil)).Marshal(), uint8(0), uint8(2))
	// The egress b0, then the ingress a0 (peer->client), marked as needing a
	// route: bpf_redirect_neigh.
	f.Add(fromClient(redirect, "10.100.0.1", packet.ChannelData(redirect.Channel, data(64), nil)).Marshal(),
		ingressIndex("a0")|ingressIndex("b0")<<3, uint8(0x80))
	f.Add(fromPeer(redirect, data(64)).Marshal(), ingressIndex("b0")|ingressIndex("a0")<<3, uint8(0x81))
	f.Fuzz(func(t *testing.T, frame []byte, ingress, kind uint8) {
		name := ifaceNames[int(ingress&7)%len(ifaceNames)]
		if c := kind >> 2; c != 0 {
			capsOf := ifaceNames[int(ingress>>3)%len(ifaceNames)]
			e.setCaps(t, nil, capsOf, e.fuzzCapsByte(capsOf, c&0x1f|c&0x20<<1))
		}
		skb := model.SKB{GSO: kind&2 != 0, Priority: 3, Mark: 0xabc}
		if kind&1 != 0 {
			skb.Checksum = e.skbChecksum(model.ChecksumComplete)
		}
		e.fuzzOne(t, bs, name, frame, skb)
	})
}

// fuzzOne checks one fuzz input against a fresh model of the bindings bs
// (restored in the maps when the program learned from it).
func (e *tcEnv) fuzzOne(t *testing.T, bs []channelmap.Binding, name string, frame []byte, skb model.SKB) {
	m := e.newModel(t, bs)
	if !skbRunnable(frame) {
		m.ProcessTC(e.ifaces[name].index, frame, skb) // BPF_PROG_RUN refuses it; the model must not panic
		return
	}
	if _, res := e.checkTC(t, m, name, frame, skb); res.Learned != nil {
		e.restore(t, bs)
	}
}

// TestTCRateLimit: the TC engine charges the same buckets as XDP (one per
// allocation): over a dropping limit a bound packet is shot, over a passing
// one it goes on to pion/turn, neither charged; under it, relayed and
// charged.
func TestTCRateLimit(t *testing.T) {
	e := newTCEnv(t)
	m := e.install(t)
	b := bindings["redirect"]
	c2p := fromClient(b, "10.100.0.1", packet.ChannelData(b.Channel, data(100), nil)).Marshal()
	p2c := fromPeer(b, data(100)).Marshal()
	owedFar := model.MonotonicNow() + uint64(10*time.Second)
	for _, c := range []struct {
		name    string
		limit   channelmap.RateLimit
		owes    model.RateState
		verdict model.TCVerdict
	}{
		{"over/drop", channelmap.RateLimit{PacketsPerSecond: 50}, model.RateState{PacketTAT: owedFar}, model.TCShot},
		{"over/pass", channelmap.RateLimit{PacketsPerSecond: 50, Pass: true}, model.RateState{PacketTAT: owedFar}, model.TCNext},
		{"over-bytes/drop", channelmap.RateLimit{BytesPerSecond: 1000}, model.RateState{ByteTAT: owedFar}, model.TCShot},
		{"under", channelmap.RateLimit{PacketsPerSecond: 50}, model.RateState{}, model.TCRedirect},
	} {
		for _, dir := range []struct {
			ingress string
			frame   []byte
		}{{"a0", c2p}, {"b0", p2c}} {
			t.Run(c.name+"/"+dir.ingress, func(t *testing.T) {
				e.setRateLimit(t, m, c.limit)
				e.owe(t, m, b, c.owes)
				got, _ := e.checkTC(t, m, dir.ingress, dir.frame, model.SKB{})
				if model.TCVerdict(got.verdict) != c.verdict {
					t.Errorf("%v %s, want %v", model.TCVerdict(got.verdict), tcReasonName(got.reason), c.verdict)
				}
				if c.verdict != model.TCRedirect && got.reason != bpf.RelayReasonREASON_RATE_LIMITED {
					t.Errorf("reason %s, want rate_limited", tcReasonName(got.reason))
				}
				after := e.owed(t, m, b)
				if charged := after != c.owes; charged != (c.verdict == model.TCRedirect) {
					t.Errorf("owes %+v after, %+v before: charged %v", after, c.owes, charged)
				}
			})
		}
	}
	e.setRateLimit(t, m, channelmap.RateLimit{})
}

// FuzzTCBindingsVsModel: FuzzRelayBindingsVsModel for the TC engine: varied
// binding sets, both directions, every FIB outcome and rate limit, the
// interfaces' dev_caps (fuzzCaps: with bit 6, bpf_redirect_neigh), as a
// CHECKSUM_NONE or a CHECKSUM_COMPLETE skb.
func FuzzTCBindingsVsModel(f *testing.F) {
	e := newTCEnv(f)
	seeds := []struct {
		spec             []byte
		pick, dst, flags uint8
		complete         bool
	}{
		{[]byte{0, 0, 0, 0x20, 0x10, 1}, 0, 0, 1, false},         // redirect c2p
		{[]byte{0, 0, 0, 0x20, 0x10, 1}, 1, 0, 0, true},          // redirect p2c
		{[]byte{0, 0, 0, 0x70, 0x40, 1}, 0, 0, 1, false},         // egress not attached: TC relays
		{[]byte{0x85, 0, 0, 0x20, 0x10, 1}, 1, 0, 0, true},       // v6 client behind e0
		{[]byte{0x80, 0, 0, 0x20, 0x10, 1}, 0, 0, 1, true},       // v6 c2p
		{[]byte{0, 0, 0, 0x20, 0x10, 1, 1 | 4}, 0, 0, 1, false},  // over a dropping limit: shot
		{[]byte{0, 0, 0, 0x20, 0x10, 1, 2 | 4}, 1, 0, 0, false},  // over a passing limit
		{[]byte{0, 0, 0, 0x50, 0x20, 1, 1 | 4}, 0, 0, 1, false},  // over it, no neighbour: the FIB first
		{[]byte{0, 0, 4, 0x20, 0x10, 1}, 0, 0, 1 | 3<<1, true},   // padding 3
		{[]byte{0x80, 0, 0, 0x20, 0x10, 1}, 1, 0x80, 8, false},   // field = pseudo-header sum: no PARTIAL guess
		{[]byte{0, 0, 0, 0x20, 0x10, 0}, 0, 0x40, 1, false},      // learn a NodePort
		{[]byte{0, 0, 0, 0x20, 0x10, 0x41}, 1, 0, 0, true},       // p2c from a NodePort
		{[]byte{0x80, 0, 0, 0x20, 0x10, 0x41}, 0, 0x40, 1, true}, // v6 c2p to a NodePort
	}
	for _, s := range seeds {
		f.Add(s.spec, uint8(0), s.pick, s.dst, s.flags, s.complete, data(100))
	}
	// Bit 7 of ingress sets the flow caches aside (see FuzzRelayBindingsVsModel).
	f.Add([]byte{0, 0, 0, 0x70, 0x40, 1}, uint8(0x80), uint8(0), uint8(0), uint8(1), false, data(100))
	f.Add([]byte{0x85, 0, 0, 0x20, 0x10, 1}, uint8(0x80), uint8(1), uint8(0), uint8(0), true, data(100))
	// dev_caps bytes after the bindings, then the rate-limit byte (see
	// fuzzCaps): b0, then a0, whose transmit needs a route.
	f.Add([]byte{0, 0, 0, 0x20, 0x10, 1, 0x00, 0x40, 0}, uint8(0), uint8(0), uint8(0), uint8(1), false, data(100))
	f.Add([]byte{0, 0, 0, 0x20, 0x10, 1, 0x40, 0x00, 0}, uint8(0), uint8(1), uint8(0), uint8(0), true, data(100))
	f.Add([]byte{0x80, 0, 0, 0x20, 0x10, 1, 0x00, 0x41, 0}, uint8(0), uint8(0), uint8(0), uint8(1), false, data(100))
	// Reverse-path filtering (fuzzCapsByte bit 7): strict on a0 and b0, the
	// peer's datagram arriving on a0; loose, a client without a route back.
	f.Add([]byte{0, 0, 0, 0x20, 0x10, 1, 0x80, 0x80, 0}, uint8(0), uint8(1), uint8(0), uint8(0), false, data(100))
	f.Add([]byte{0, 0, 0, 0x20, 0x10, 1, 0x80, 0x80, 0}, uint8(0), uint8(0), uint8(0), uint8(1), false, data(100))
	f.Add([]byte{12, 0, 0, 0x20, 0x10, 1, 0x90, 0x90, 0}, uint8(0), uint8(0), uint8(0), uint8(1), true, data(100))
	f.Fuzz(func(t *testing.T, spec []byte, ingress, pick, dst, flags uint8, complete bool, payload []byte) {
		bs := decodeBindings(spec)
		e.replace(t, bs)
		e.fuzzCaps(t, spec)
		e.setFlowsAside(t, ingress&0x80 != 0)
		e.fuzzShield(t, bs, len(payload)+int(flags))
		m := e.newModel(t, bs)
		e.fuzzRateLimit(t, m, spec, bs)
		if len(payload) > maxRunFrame-64 {
			payload = payload[:maxRunFrame-64]
		}
		skb := model.SKB{}
		if complete {
			skb.Checksum = e.skbChecksum(model.ChecksumComplete)
		}
		frame := fuzzFrame(bs, pick, dst, flags, payload)
		if !skbRunnable(frame) {
			return
		}
		e.checkTC(t, m, ifaceNames[int(ingress&0x7f)%len(ifaceNames)], frame, skb)
	})
}

// TestTCReconfigure: after the XDP program's Reconfigure, the engine's
// Reconfigure loads it with the new configuration and swaps it into its tcx
// links; its counters carry over.
func TestTCReconfigure(t *testing.T) {
	e := newTCEnv(t)
	m := e.install(t)
	if err := e.ns.Do(func() error { return e.tc.Attach("a0") }); err != nil {
		t.Fatal(err)
	}
	b := bindings["redirect"]
	in := fromClient(b, "10.100.0.1", packet.ChannelData(b.Channel, data(10), nil)).Marshal()
	if got, _ := e.checkTC(t, m, "a0", in, model.SKB{}); got.reason != bpf.RelayReasonREASON_RELAY_C2P_REDIRECT {
		t.Fatalf("before: %s", tcReasonName(got.reason))
	}
	cfg := progConfig
	cfg.ListenerPorts = []uint16{listenerPort + 1}
	if err := e.prog.Reconfigure(cfg); err != nil {
		t.Fatal(err)
	}
	old := e.tc.Prog()
	// In the devices' namespace, as the daemon does: below 6.6 the swap is a
	// netlink request (the clsact filter), not an update of a link's fd.
	if err := e.ns.Do(func() error { return e.tc.Reconfigure(e.prog) }); err != nil {
		t.Fatal(err)
	}
	if e.tc.Prog() == old {
		t.Fatal("the program was not swapped")
	}
	before := e.tcVerdicts(t)
	ret, _, err := e.runTC(t, "a0", in, model.SKB{})
	if err != nil {
		t.Fatal(err)
	}
	after := e.tcVerdicts(t)
	if model.TCVerdict(ret) != model.TCNext || after[bpf.RelayReasonREASON_NOT_OURS] != before[bpf.RelayReasonREASON_NOT_OURS]+1 {
		t.Errorf("after: %v, not_ours %d -> %d (port %d is no listener's now)", model.TCVerdict(ret),
			before[bpf.RelayReasonREASON_NOT_OURS], after[bpf.RelayReasonREASON_NOT_OURS], listenerPort)
	}
	if after[bpf.RelayReasonREASON_RELAY_C2P_REDIRECT] == 0 {
		t.Error("the counters did not carry over")
	}
	// The hook runs the new program (tcx's link, or the clsact filter below 6.6).
	info, err := e.tc.Prog().Info()
	if err != nil {
		t.Fatal(err)
	}
	id, _ := info.ID()
	err = e.ns.Do(func() error {
		ids, err := testenv.IngressPrograms("a0")
		if err != nil {
			return err
		}
		if len(ids) != 1 || ids[0] != id {
			t.Errorf("a0 runs %v, want program %d", ids, id)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}
