package model

import (
	"fmt"

	"github.com/l7mp/stunnerd-xdp/bpf"
	"github.com/l7mp/stunnerd-xdp/internal/channelmap"
)

// TCVerdict is a TC action (TC_ACT_*), numbered as the kernel numbers them.
type TCVerdict uint32

// The verdicts the TC engine gives.
const (
	// TCNext is TCX_NEXT (-1): the next program on the hook sees the skb,
	// untouched, then the stack and pion/turn. Not TC_ACT_OK, which would
	// end the hook's chain: another daemon's TC engine (another Gateway of
	// the node) after this one must see its own packets. Under cls_bpf it
	// is TC_ACT_UNSPEC, which goes on as well.
	TCNext     TCVerdict = 0xffffffff
	TCShot     TCVerdict = 2 // TC_ACT_SHOT: over a dropping rate limit
	TCRedirect TCVerdict = 7 // TC_ACT_REDIRECT: out of the FIB's egress
)

func (v TCVerdict) String() string {
	switch v {
	case TCNext:
		return "TCX_NEXT"
	case TCShot:
		return "TC_ACT_SHOT"
	case TCRedirect:
		return "TC_ACT_REDIRECT"
	}
	return fmt.Sprintf("TC action %d", uint32(v))
}

// Checksum is an skb's ip_summed.
type Checksum int

// The kinds of ip_summed, as the kernel numbers them.
const (
	ChecksumNone        Checksum = 0 // the receiver verifies the field
	ChecksumUnnecessary Checksum = 1 // a device verified it
	ChecksumComplete    Checksum = 2 // skb->csum sums the packet
	ChecksumPartial     Checksum = 3 // the field holds the pseudo-header sum; the egress sums from csum_start
)

// SKB is what the TC engine sees of an skb besides its bytes.
type SKB struct {
	Checksum Checksum
	// CsumAtUDP: for CHECKSUM_PARTIAL, csum_start and csum_offset name this
	// packet's UDP checksum field (not a tunnel's outer one).
	CsumAtUDP bool
	// GSO: gso_size is set: the skb holds several datagrams.
	GSO bool
	// VLAN: the device took a VLAN tag off the frame (skb->vlan_tci): the
	// frame was tagged, which rule 1 passes.
	VLAN bool
	// L3: the skb arrived on a device without a link-layer header (tunl0, a
	// WireGuard or GRE device; the engine's tc_turn_relay_l3): its bytes
	// start at the IP header, whose version nibble names the family. A
	// relayed one leaves with an Ethernet header in front (bpf_skb_change_head),
	// the same frame as from an Ethernet ingress; one whose family would
	// change (an IPv6 client's, either way) passes (TC_REASON_L3_FAMILY).
	L3 bool
	// OuterHeaders: on an L3 device, the skb still has a MAC header (the
	// tunnel left its outer headers in front of the IP packet, as 5.10's
	// ip_tunnel_rcv does): it passes (TC_REASON_L3_OUTER_HEADERS).
	// BPF_PROG_RUN cannot build one (it sets no mac_len).
	OuterHeaders bool
	// Priority and Mark are skb->priority and skb->mark as the skb arrives.
	Priority, Mark uint32
}

// TCResult is what the TC engine does with one skb. Reason is an enum reason
// below bpf.RelayTcTcReasonTC_REASON_GSO, else an enum tc_reason.
type TCResult struct {
	Verdict TCVerdict
	Reason  bpf.RelayReason
	Frame   []byte
	Learned *Learned
	Counted *channelmap.Key
	DataLen int
	// RedirectNeigh: relayed with bpf_redirect_neigh, counted under
	// TC_REASON_REDIRECT_NEIGH beside Reason.
	RedirectNeigh bool
	// Priority and Mark are skb->priority and skb->mark after the program:
	// a relayed skb leaves as a socket's datagram with its TOS would
	// (TOSPriority; mark 0), any other as it came.
	Priority, Mark uint32
}

// ProcessTC is the TC engine for one skb arriving on the interface with the
// given ifindex: Process with the skb path's rules (rule 8).
func (m *Model) ProcessTC(ingress int, frame []byte, skb SKB) TCResult {
	if skb.GSO {
		return TCResult{Verdict: TCNext, Reason: bpf.RelayReason(bpf.RelayTcTcReasonTC_REASON_GSO), Frame: frame,
			Priority: skb.Priority, Mark: skb.Mark}
	}
	if skb.VLAN {
		return TCResult{Verdict: TCNext, Reason: bpf.RelayReasonREASON_NOT_IP, Frame: frame, Priority: skb.Priority, Mark: skb.Mark}
	}
	if skb.L3 && skb.OuterHeaders {
		return TCResult{Verdict: TCNext, Reason: bpf.RelayReason(bpf.RelayTcTcReasonTC_REASON_L3OUTER_HEADERS), Frame: frame,
			Priority: skb.Priority, Mark: skb.Mark}
	}
	m.skb = &skb
	in := frame
	if skb.L3 {
		in = withEthernet(frame)
	}
	r := m.Process(ingress, in)
	m.skb = nil
	if skb.L3 && (r.Verdict == Pass || r.Verdict == Drop) {
		r.Frame = frame // passed (or shot) as it came, without the header the model put in front
	}
	v := TCNext
	switch r.Verdict {
	case Drop:
		v = TCShot
	case TX, Redirect:
		v = TCRedirect
	}
	res := TCResult{Verdict: v, Reason: r.Reason, Frame: r.Frame, Learned: r.Learned, Counted: r.Counted, DataLen: r.DataLen,
		RedirectNeigh: r.RedirectNeigh, Priority: skb.Priority, Mark: skb.Mark}
	if v == TCRedirect {
		res.Priority, res.Mark = 0, 0
		if len(r.Frame) > 15 && r.Frame[12] == 0x08 && r.Frame[13] == 0x00 {
			res.Priority = TOSPriority(r.Frame[15])
		}
	}
	return res
}

// TOSPriority is the skb priority the kernel gives an IPv4 packet of that TOS
// where it derives one (rt_tos2priority: a socket's IP_TOS sets
// sk_priority so, ip_forward sets skb->priority so): egress qdiscs that sort
// by priority (pfifo_fast's and prio's bands) see it. ip_tos2prio indexed by
// the TOS's four bits above the lowest: 0 best effort, 2 bulk, 6
// interactive, 4 interactive bulk (EF's 0xb8 among them). IPv6 has none: its
// forward path and IPV6_TCLASS leave the priority 0.
func TOSPriority(tos uint8) uint32 {
	return [4]uint32{0, 2, 6, 4}[(tos>>1&0xf)>>2]
}

// withEthernet is an L3 skb's bytes behind the Ethernet header that the
// engine reads in its place: the ethertype of the version nibble (none
// where it is neither 4 nor 6, or there is no byte: not IP).
func withEthernet(ip []byte) []byte {
	f := make([]byte, 14+len(ip))
	if len(ip) > 0 {
		switch ip[0] >> 4 {
		case 4:
			f[12], f[13] = 0x08, 0x00
		case 6:
			f[12], f[13] = 0x86, 0xdd
		}
	}
	copy(f[14:], ip)
	return f
}
