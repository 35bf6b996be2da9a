package channelmap

import "github.com/l7mp/stunnerd-xdp/bpf"

// ReasonNames are the metric labels of the program's verdict reasons, indexed by
// the generated bpf.RelayReason values.
var ReasonNames = map[bpf.RelayReason]string{
	bpf.RelayReasonREASON_RELAY_C2P_TX:           "relay_client_to_peer_tx",
	bpf.RelayReasonREASON_RELAY_C2P_REDIRECT:     "relay_client_to_peer_redirect",
	bpf.RelayReasonREASON_RELAY_P2C_TX:           "relay_peer_to_client_tx",
	bpf.RelayReasonREASON_RELAY_P2C_REDIRECT:     "relay_peer_to_client_redirect",
	bpf.RelayReasonREASON_NOT_IP:                 "pass_not_ip",
	bpf.RelayReasonREASON_NOT_UDP:                "pass_not_udp",
	bpf.RelayReasonREASON_NOT_OURS:               "pass_not_ours",
	bpf.RelayReasonREASON_MALFORMED_IP:           "pass_malformed_ip",
	bpf.RelayReasonREASON_IP_OPTIONS:             "pass_ip_options",
	bpf.RelayReasonREASON_IP_FRAGMENT:            "pass_ip_fragment",
	bpf.RelayReasonREASON_MALFORMED_UDP:          "pass_malformed_udp",
	bpf.RelayReasonREASON_STUN:                   "pass_stun",
	bpf.RelayReasonREASON_MALFORMED_CHANNEL_DATA: "pass_malformed_channel_data",
	bpf.RelayReasonREASON_OVERSIZE:               "pass_oversize",
	bpf.RelayReasonREASON_NO_CHANNEL:             "pass_no_channel",
	bpf.RelayReasonREASON_NO_PEER_BINDING:        "pass_no_peer_binding",
	bpf.RelayReasonREASON_CLIENT_ADDR_UNKNOWN:    "pass_client_addr_unknown",
	bpf.RelayReasonREASON_FIB_NO_NEIGH:           "pass_fib_no_neigh",
	bpf.RelayReasonREASON_FIB_FRAG_NEEDED:        "pass_fib_frag_needed",
	bpf.RelayReasonREASON_FIB_FWD_DISABLED:       "pass_fib_forwarding_disabled",
	bpf.RelayReasonREASON_FIB_NOT_FORWARDED:      "pass_fib_not_forwarded",
	bpf.RelayReasonREASON_EGRESS_NOT_ATTACHED:    "pass_egress_not_attached",
	bpf.RelayReasonREASON_ADJUST_FAILED:          "pass_adjust_failed",
	bpf.RelayReasonREASON_IPV6EXTENSION:          "pass_ipv6_extension",
	bpf.RelayReasonREASON_NO_CHECKSUM:            "pass_no_checksum",
	bpf.RelayReasonREASON_NOT_LISTENER_ADDR:      "pass_not_listener_address",
	bpf.RelayReasonREASON_TTL_EXPIRED:            "pass_ttl_expired",
	bpf.RelayReasonREASON_BAD_IP_CHECKSUM:        "pass_bad_ip_checksum",
	bpf.RelayReasonREASON_REDIRECT_FAILED:        "drop_redirect_failed",
	// Dropped or passed as --over-limit says: a label for both, because the
	// choice is the operator's and one series shows the binding was over.
	bpf.RelayReasonREASON_RATE_LIMITED: "rate_limited",
	// The egress would have dropped the XDP frame after the program returned
	// (a veth whose peer runs no XDP, a bridge, a tunnel): the stack forwards it.
	bpf.RelayReasonREASON_EGRESS_NO_XDP_XMIT: "pass_egress_no_xdp_xmit",
	bpf.RelayReasonREASON_INGRESS_OVER_MTU:   "pass_ingress_over_mtu",
	// The stack's reverse-path filter would drop it (strict: the route back
	// leaves elsewhere; loose: there is none): it goes to the stack.
	bpf.RelayReasonREASON_RP_FILTER: "pass_rp_filter",
	// The route back could not be looked up as the stack looks it up.
	bpf.RelayReasonREASON_RP_UNCHECKED: "pass_rp_unchecked",
	// The listener shield (--listener-shield): to a listener socket, what
	// pion/turn would discard unanswered, dropped.
	bpf.RelayReasonREASON_NO_ALLOCATION:  "drop_shield_no_allocation",
	bpf.RelayReasonREASON_NOT_TURN:       "drop_shield_not_turn",
	bpf.RelayReasonREASON_STUN_UNHANDLED: "drop_shield_stun_unhandled",
	bpf.RelayReasonREASON_ADMISSION:      "drop_shield_admission",
}

// ReasonName is the metric label of Verdicts()[i].
func ReasonName(i int) string { return ReasonNames[bpf.RelayReason(i)] }

// TCReasonNames are the metric labels of the TC engine's own verdict reasons
// (bpf/tc.h enum tc_reason); for the reasons both engines share it counts
// under the enum reason values, named by ReasonNames.
var TCReasonNames = map[bpf.RelayTcTcReason]string{
	// Several datagrams in one skb (UDP GSO, GRO): the stack segments them.
	bpf.RelayTcTcReasonTC_REASON_GSO: "pass_gso",
	// CHECKSUM_PARTIAL for another header than the UDP one (a tunnel's).
	bpf.RelayTcTcReasonTC_REASON_PARTIAL_ELSEWHERE: "pass_checksum_partial_elsewhere",
	// A helper failed after the data moved: the half-rewritten skb is shot.
	bpf.RelayTcTcReasonTC_REASON_REWRITE_FAILED: "drop_rewrite_failed",
	// Relayed with bpf_redirect_neigh into a device whose transmit needs a
	// route on the skb (tunl0): counted beside the relay_* reason, a subset
	// of those, not another verdict.
	bpf.RelayTcTcReasonTC_REASON_REDIRECT_NEIGH: "relayed_via_redirect_neigh",
	// From a device without a link-layer header (tunl0, WireGuard), a relay
	// that would change the family (an IPv6 client's): userspace.
	bpf.RelayTcTcReasonTC_REASON_L3FAMILY: "pass_l3_family_change",
	// On a device without a link-layer header, an skb the tunnel handed on
	// with its outer headers in front (5.10's ipip): userspace.
	bpf.RelayTcTcReasonTC_REASON_L3OUTER_HEADERS: "pass_l3_outer_headers",
}

// TCReasonName is the metric label of the TC engine's Verdicts()[i] (loader
// TC.Verdicts): a shared reason's name below the TC engine's own reasons, and
// "" for the indices between the two ranges, which the engine never counts.
func TCReasonName(i int) string {
	if i < int(bpf.RelayTcTcReasonTC_REASON_GSO) {
		return ReasonName(i)
	}
	return TCReasonNames[bpf.RelayTcTcReason(i)]
}
