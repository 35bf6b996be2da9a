/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* The TC engine's own verdict reasons and counters (relay_tc.c). */
#ifndef STUNNERD_XDP_TC_H
#define STUNNERD_XDP_TC_H

#include "consts.h"
#include "maps.h"

/* The TC engine counts a packet under the enum reason both engines share
 * (parsing, bindings, the FIB, rate limits, relayed) or under one of its own,
 * numbered from TC_REASON_BASE so that enum reason can grow below it. */
#define TC_REASON_BASE 64
_Static_assert(REASON_MAX <= TC_REASON_BASE, "enum reason reached the TC engine's reasons");

enum tc_reason {
	TC_REASON_GSO = TC_REASON_BASE, /* a GSO skb (UDP GSO, GRO): several datagrams; passed */
	TC_REASON_PARTIAL_ELSEWHERE,    /* CHECKSUM_PARTIAL for another header than this UDP
	                                   one (a tunnel's): passed */
	TC_REASON_REWRITE_FAILED,       /* a helper failed after the data moved: the half
	                                   rewritten skb is dropped (TC_ACT_SHOT) */
	TC_REASON_REDIRECT_NEIGH,       /* relayed with bpf_redirect_neigh into an egress
	                                   whose transmit needs a route on the skb
	                                   (DEV_XMIT_NEEDS_ROUTE): counted beside the
	                                   relay reason, a subset of the relayed */
	TC_REASON_L3_OUTER_HEADERS,     /* on a device without a link-layer header, the
	                                   skb still has a MAC header (mac_len): the
	                                   tunnel left the outer headers in front of
	                                   the IP packet (5.10's ip_tunnel_rcv):
	                                   passed */
	TC_REASON_L3_FAMILY,            /* from a device without a link-layer header
	                                   (tc_turn_relay_l3), a relay that would
	                                   change the family (an IPv6 client's):
	                                   passed, see relay_tc.c */
	TC_REASON_MAX,
};

/* One counter per reason (enum reason below TC_REASON_BASE, enum tc_reason
 * from it), per CPU. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__type(key, __u32);
	__type(value, __u64);
	__uint(max_entries, TC_REASON_MAX);
} tc_verdicts SEC(".maps");

/* A buffer per CPU for the data the TC engine moves by 4 bytes. */
struct tc_buf {
	__u8 b[CHANNEL_DATA_MAX_LEN + 1];
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__type(key, __u32);
	__type(value, struct tc_buf);
	__uint(max_entries, 1);
} tc_scratch SEC(".maps");

/* tcx's TCX_NEXT (linux/bpf.h of 6.6+, which the build's headers may predate):
 * the hook's next program sees the skb; after the last one, the stack. Under
 * cls_bpf it reads as TC_ACT_UNSPEC, which goes on as well. */
#define TC_NEXT (-1)

#endif
