package model_test

import (
	"bytes"
	"encoding/binary"
	"testing"

	"github.com/l7mp/stunnerd-xdp/bpf"
	"github.com/l7mp/stunnerd-xdp/internal/channelmap"
	"github.com/l7mp/stunnerd-xdp/test/model"
	"github.com/l7mp/stunnerd-xdp/test/packet"
)

// The TC engine's rule 8: a CHECKSUM_PARTIAL skb leaves with the output's
// pseudo-header sum, which an egress completing it (summing from the UDP
// header, the field included) turns into the checksum a full sender would
// have written; every other skb leaves with the full checksum, even one whose
// field happens to equal its pseudo-header sum (the XDP program takes that for
// PARTIAL and sums it afresh).
func TestTCChecksumByIPSummed(t *testing.T) {
	d := []byte("hello, peer!!")
	in := clientFrame("10.100.0.1", packet.ChannelData(0x4000, d, []byte{0x5a, 0x5a, 0x5a}))
	full := newModel(t, binding).Process(2, in.Marshal()).Frame

	partial := in
	partial.PartialChecksum = true
	res := newModel(t, binding).ProcessTC(2, partial.Marshal(), model.SKB{Checksum: model.ChecksumPartial, CsumAtUDP: true})
	if res.Verdict != model.TCRedirect || res.Reason != bpf.RelayReasonREASON_RELAY_C2P_REDIRECT {
		t.Fatalf("%v %v", res.Verdict, res.Reason)
	}
	off := packet.EthLen + packet.IPv4Len
	udp := res.Frame[off:]
	// The field is the pseudo-header sum (what a PARTIAL sender leaves).
	want := packet.Frame{DstMAC: peerMAC, SrcMAC: bMAC, TTL: 8, ID: 7, FragOff: 0x4000, TOS: 0xb8,
		Src: binding.Relay, Dst: binding.Peer, Payload: d, PartialChecksum: true}.Marshal()
	if !bytes.Equal(res.Frame, want) {
		t.Fatalf("output\n got %x\nwant %x", res.Frame, want)
	}
	// The egress completes it: the ones' complement sum from the UDP header,
	// written over the field.
	var s uint32
	for i := 0; i+1 < len(udp); i += 2 {
		s += uint32(binary.BigEndian.Uint16(udp[i:]))
	}
	if len(udp)%2 == 1 {
		s += uint32(udp[len(udp)-1]) << 8
	}
	for s > 0xffff {
		s = s&0xffff + s>>16
	}
	completed := bytes.Clone(res.Frame)
	binary.BigEndian.PutUint16(completed[off+6:], ^uint16(s))
	if !bytes.Equal(completed, full) {
		t.Fatalf("completed by the egress\n got %x\nwant %x", completed, full)
	}

	// CHECKSUM_NONE with a field equal to the pseudo-header sum: updated
	// incrementally (the damage it stands for carried over), not summed afresh.
	res = newModel(t, binding).ProcessTC(2, partial.Marshal(), model.SKB{Checksum: model.ChecksumNone})
	xdp := newModel(t, binding).Process(2, partial.Marshal())
	if bytes.Equal(res.Frame, xdp.Frame) {
		t.Fatal("the TC engine guessed PARTIAL from the field")
	}
	if _, err := packet.Parse(res.Frame); err == nil {
		t.Fatal("a datagram whose checksum did not verify was relayed with one that does")
	}
}

// The TC engine's own passes: a GSO skb, and a PARTIAL skb whose csum_start
// is not this UDP header; and it reaches an egress XDP's devmap does not hold.
func TestTCPassesAndAnyEgress(t *testing.T) {
	in := clientFrame("10.100.0.1", packet.ChannelData(0x4000, []byte("x"), nil)).Marshal()
	m := newModel(t, binding)
	if r := m.ProcessTC(2, in, model.SKB{GSO: true}); r.Verdict != model.TCNext || r.Reason != bpf.RelayReason(bpf.RelayTcTcReasonTC_REASON_GSO) || !bytes.Equal(r.Frame, in) {
		t.Errorf("GSO: %v %v", r.Verdict, r.Reason)
	}
	if r := m.ProcessTC(2, in, model.SKB{VLAN: true}); r.Verdict != model.TCNext || r.Reason != bpf.RelayReasonREASON_NOT_IP || r.Counted != nil {
		t.Errorf("VLAN: %v %v", r.Verdict, r.Reason)
	}
	if r := m.ProcessTC(2, in, model.SKB{Checksum: model.ChecksumPartial}); r.Verdict != model.TCNext ||
		r.Reason != bpf.RelayReason(bpf.RelayTcTcReasonTC_REASON_PARTIAL_ELSEWHERE) || r.Counted != nil {
		t.Errorf("PARTIAL elsewhere: %v %v", r.Verdict, r.Reason)
	}
	env := testEnv()
	env.Interfaces[1].Attached = false
	m, err := model.New(env, []channelmap.Binding{binding})
	if err != nil {
		t.Fatal(err)
	}
	if r := m.Process(2, in); r.Reason != bpf.RelayReasonREASON_EGRESS_NOT_ATTACHED {
		t.Errorf("XDP: %v", r.Reason)
	}
	if r := m.ProcessTC(2, in, model.SKB{}); r.Verdict != model.TCRedirect || r.Reason != bpf.RelayReasonREASON_RELAY_C2P_REDIRECT {
		t.Errorf("TC, unattached egress: %v %v", r.Verdict, r.Reason)
	}
}

// An egress whose transmit needs a route on the skb (tunl0): the TC engine
// relays the same frame with bpf_redirect_neigh (RedirectNeigh); XDP, which
// never reaches such a device, and any other egress do not say so.
func TestTCRedirectNeigh(t *testing.T) {
	in := clientFrame("10.100.0.1", packet.ChannelData(0x4000, []byte("x"), nil)).Marshal()
	env := testEnv()
	env.Interfaces[1].Attached = false
	plain, err := model.New(env, []channelmap.Binding{binding})
	if err != nil {
		t.Fatal(err)
	}
	want := plain.ProcessTC(2, in, model.SKB{})
	if want.RedirectNeigh {
		t.Fatal("an egress without NeedsRoute: bpf_redirect_neigh")
	}
	env.Interfaces[1].Caps = &model.DevCaps{NeedsRoute: true, MTU: 1500}
	m, err := model.New(env, []channelmap.Binding{binding})
	if err != nil {
		t.Fatal(err)
	}
	r := m.ProcessTC(2, in, model.SKB{})
	if r.Verdict != model.TCRedirect || r.Reason != bpf.RelayReasonREASON_RELAY_C2P_REDIRECT || !r.RedirectNeigh {
		t.Errorf("TC into a NeedsRoute egress: %v %v neigh %v", r.Verdict, r.Reason, r.RedirectNeigh)
	}
	if !bytes.Equal(r.Frame, want.Frame) {
		t.Errorf("the frame depends on the redirect helper")
	}
	if x := m.Process(2, in); x.RedirectNeigh || x.Reason != bpf.RelayReasonREASON_EGRESS_NOT_ATTACHED {
		t.Errorf("XDP: %v neigh %v", x.Reason, x.RedirectNeigh)
	}
}

// TestTOSPriority: TOSPriority is the kernel's rt_tos2priority for every
// TOS: ip_tos2prio (net/ipv4/route.c) indexed by IPTOS_TOS(tos)>>1.
func TestTOSPriority(t *testing.T) {
	const besteffort, bulk, interactive, interactiveBulk = 0, 2, 6, 4
	ipTOS2Prio := [16]uint32{besteffort, besteffort, besteffort, besteffort, bulk, bulk, bulk, bulk,
		interactive, interactive, interactive, interactive, interactiveBulk, interactiveBulk, interactiveBulk, interactiveBulk}
	for tos := range 256 {
		if got, want := model.TOSPriority(uint8(tos)), ipTOS2Prio[(tos&0x1e)>>1]; got != want {
			t.Errorf("TOS %#02x: priority %d, want %d", tos, got, want)
		}
	}
	if model.TOSPriority(0xb8) != interactiveBulk { // EF
		t.Errorf("EF: %d", model.TOSPriority(0xb8))
	}
}
