//go:build ignore

// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/* The TC engine of stunnerd-xdp: the XDP program's relay (relay.c) on the skb
 * path, attached with tcx at ingress where XDP cannot do the job:
 *
 *   - on the interfaces that run the XDP program, it sees what XDP passed
 *     (e.g. client->peer whose egress cannot transmit XDP frames: a pod's
 *     veth, a VXLAN/Geneve/WireGuard device, a bridge);
 *   - on pods' host-side veths and tunnel devices, where nothing else runs, it
 *     sees peer->client from a pod on this node (and decapsulated traffic).
 *
 * Same bindings, same maps, same rules as the XDP program (test/model
 * ProcessTC is the spec), with the skb path's differences:
 *
 *   - any egress: bpf_redirect reaches every device (the skb goes through
 *     dev_queue_xmit), so the devmap is not consulted and the binding's cached
 *     next hops (XDP's, valid only for devmap egresses) are neither read nor
 *     written: every relayed packet takes bpf_fib_lookup;
 *   - checksums by the skb's own ip_summed (read through bpf_cast_to_kern_ctx,
 *     or bpf_probe_read_kernel where the kernel lacks it), not guessed from
 *     the checksum field:
 *       CHECKSUM_PARTIAL: the field holds the pseudo-header sum and the egress
 *       (device or skb_checksum_help) sums from skb->csum_start, a head-relative
 *       offset no helper moves. The rewrite keeps the UDP header where it is
 *       relative to skb->head: the ChannelData header is taken out (or put in)
 *       by moving the data 4 bytes and changing the tail, and an IPv4<->IPv6
 *       change (bpf_skb_change_proto) grows or shrinks the room before the
 *       network header, leaving L4 in place. The field gets the output's
 *       pseudo-header sum; the skb stays PARTIAL.
 *       Anything else: the field carries a full checksum, updated
 *       incrementally as XDP does (the input's error travels on).
 *       CHECKSUM_COMPLETE: every rewrite changes the tail with
 *       bpf_skb_change_tail, whose grow and trim turn COMPLETE into
 *       CHECKSUM_NONE (__skb_grow_rcsum, __skb_trim_rcsum): the receiver
 *       verifies the (correct) field in software; no stale skb->csum travels.
 *   - a GSO skb (UDP GSO or GRO: several datagrams) is passed, never relayed
 *     as one datagram.
 *
 * Verdicts: TC_ACT_REDIRECT (relayed; with bpf_redirect_neigh into an egress
 * whose transmit needs a route on the skb, DEV_XMIT_NEEDS_ROUTE), TCX_NEXT (the hook's next program, then
 * the stack and pion/turn get the skb, untouched), TC_ACT_SHOT (over a dropping rate limit, or a rewrite
 * that failed half way). Counters: tc_verdicts, indexed by enum reason for the
 * reasons both engines share and by enum tc_reason for the TC engine's own. */
#define RELAY_TC_ENGINE
#include "relay.c"

#include <linux/pkt_cls.h>
#include "tc.h"

/* Force the enum into BTF for bpf2go. */
const enum tc_reason *_unused_tc_reason __attribute__((unused));

/* Weak: on kernels without it (before 6.2: Debian's 5.10 and 6.1) the loader
 * finds it missing, sets cfg.tc_no_kfunc, and the call, never reached, is
 * left out by the verifier (cfg is read-only: it knows the branch). */
extern void *bpf_cast_to_kern_ctx(void *obj) __ksym __attribute__((weak));

/* The fields of the kernel's struct sk_buff the engine reads, relocated
 * against the running kernel's BTF (CO-RE). */
struct sk_buff {
	unsigned char *head;
	unsigned char *data;
	__u16 mac_len;
	__u16 csum_start;
	__u16 csum_offset;
	__u8 ip_summed : 2;
} __attribute__((preserve_access_index));

#define CHECKSUM_COMPLETE 2
#define CHECKSUM_PARTIAL 3

/* The kernel's skb is read one of two ways, the same fields at the same
 * (CO-RE) offsets: directly through bpf_cast_to_kern_ctx (6.2+), or, where
 * the kernel lacks it (cfg.tc_no_kfunc), with bpf_probe_read_kernel from the
 * context pointer, which is the kernel's struct sk_buff (a helper call per
 * field; root may pass the pointer: the loader runs as root). Both give the
 * same values: one program, one model (test/model ProcessTC). */

/* skb_kern is the skb to read, NULL on the probe-read path. */
static __always_inline struct sk_buff *skb_kern(struct __sk_buff *ctx)
{
	if (cfg.tc_no_kfunc)
		return 0;
	return bpf_cast_to_kern_ctx(ctx);
}

/* skb_read reads size bytes (1, 2, 4 or 8) at byte offset off of the skb
 * into the low bytes of a __u64 (little-endian). */
static __always_inline __u64 skb_read(struct __sk_buff *ctx, const struct sk_buff *kern, __u32 off, __u32 size)
{
	__u64 v = 0;
	if (!kern) {
		if (bpf_probe_read_kernel(&v, size & 15, (const void *)ctx + off))
			return 0;
		return v;
	}
	const void *p = (const void *)kern + off;
	switch (size) {
	case 1:
		v = *(const __u8 *)p;
		break;
	case 2:
		v = *(const __u16 *)p;
		break;
	case 4:
		v = *(const __u32 *)p;
		break;
	default:
		v = *(const __u64 *)p;
	}
	return v;
}

/* SKB_FIELD reads the skb's field f (not a bitfield), relocated. */
#define SKB_FIELD(ctx, kern, f)                                                                 \
	((typeof(((struct sk_buff *)0)->f))skb_read(ctx, kern,                                    \
		__builtin_preserve_field_info(((struct sk_buff *)0)->f, 0 /* BYTE_OFFSET */),     \
		__builtin_preserve_field_info(((struct sk_buff *)0)->f, 1 /* BYTE_SIZE */)))

/* skb_ip_summed reads the 2-bit ip_summed bitfield (BPF_CORE_READ_BITFIELD
 * without libbpf's header). */
static __always_inline __u32 skb_ip_summed(struct __sk_buff *ctx, const struct sk_buff *kern)
{
	struct sk_buff *s = 0;
	__u64 v = skb_read(ctx, kern, __builtin_preserve_field_info(s->ip_summed, 0 /* BYTE_OFFSET */),
			   __builtin_preserve_field_info(s->ip_summed, 1 /* BYTE_SIZE */));
	v <<= __builtin_preserve_field_info(s->ip_summed, 4 /* LSHIFT_U64 */);
	v >>= __builtin_preserve_field_info(s->ip_summed, 5 /* RSHIFT_U64 */);
	return v;
}

/* partial_state tells how the skb's UDP checksum is to be written: 0 a full
 * checksum in the field (anything but CHECKSUM_PARTIAL), 1 CHECKSUM_PARTIAL
 * with the egress summing from this UDP header (udp_off bytes from the
 * frame's start), -1 CHECKSUM_PARTIAL for something else (another header, a
 * tunnel's outer one): not ours to rewrite. */
static __always_inline int partial_state(struct __sk_buff *ctx, __u32 udp_off)
{
	struct sk_buff *skb = skb_kern(ctx);
	if (skb_ip_summed(ctx, skb) != CHECKSUM_PARTIAL)
		return 0;
	/* At TC ingress skb->data is the frame's start (the MAC header pushed
	 * for the program), as __sk_buff's data. */
	__u64 start = (__u64)(SKB_FIELD(ctx, skb, data) - SKB_FIELD(ctx, skb, head)) + udp_off;
	if (SKB_FIELD(ctx, skb, csum_start) != start || SKB_FIELD(ctx, skb, csum_offset) != offsetof(struct udphdr, check))
		return -1;
	return 1;
}

/* complete_left tells an skb still CHECKSUM_COMPLETE after its rewrite,
 * which every rewrite's change of the tail turns to CHECKSUM_NONE: a stale
 * skb->csum must not reach a receiver ("hw csum failure"). */
static __always_inline int complete_left(struct __sk_buff *ctx)
{
	return skb_ip_summed(ctx, skb_kern(ctx)) == CHECKSUM_COMPLETE;
}

/* tc_count bumps the engine's verdict counter. */
static __always_inline void tc_count(__u32 reason)
{
	__u64 *n = bpf_map_lookup_elem(&tc_verdicts, &reason);
	if (n)
		(*n)++;
}

/* tc_next_hop is next_hop for the skb path: the FIB's answer for the
 * rewritten packet, forwarded from the ingress, to any egress. -1 when it can
 * be forwarded, else the PASS reason. */
static __always_inline int tc_next_hop(struct __sk_buff *ctx, __u32 in_ifindex, struct rewrite *rw)
{
	struct bpf_fib_lookup fib = {};
	fib.family = rw->family;
	fib.l4_protocol = IPPROTO_UDP;
	fib.sport = rw->sport;
	fib.dport = rw->dport;
	fib.tot_len = rw->len; /* checked against the egress MTU, as XDP's */
	fib.ifindex = in_ifindex;
	if (rw->family == AF_INET) {
		fib.tos = rw->tos;
		fib.ipv4_src = addr_v4(&rw->saddr);
		fib.ipv4_dst = addr_v4(&rw->daddr);
	} else {
		fib.flowinfo = bpf_htonl((__u32)rw->tos << 20);
		__builtin_memcpy(fib.ipv6_src, rw->saddr.b, 16);
		__builtin_memcpy(fib.ipv6_dst, rw->daddr.b, 16);
	}
	switch (bpf_fib_lookup(ctx, &fib, sizeof(fib), 0)) {
	case BPF_FIB_LKUP_RET_SUCCESS:
		break;
	case BPF_FIB_LKUP_RET_NO_NEIGH:
		return REASON_FIB_NO_NEIGH;
	case BPF_FIB_LKUP_RET_FRAG_NEEDED:
		return REASON_FIB_FRAG_NEEDED;
	case BPF_FIB_LKUP_RET_FWD_DISABLED:
		return REASON_FIB_FWD_DISABLED;
	default:
		return REASON_FIB_NOT_FORWARDED;
	}
	__builtin_memcpy(rw->dmac, fib.dmac, ETH_ALEN);
	__builtin_memcpy(rw->smac, fib.smac, ETH_ALEN);
	rw->egress_ifindex = fib.ifindex;
	return -1;
}

/* tc_move moves len bytes of the skb from offset from to offset to (4 apart)
 * through this CPU's scratch buffer: two helper calls whatever the length
 * (the program runs to its end on one CPU; nothing else on it uses the
 * buffer meanwhile). */
static __always_inline int tc_move(struct __sk_buff *skb, __u32 from, __u32 to, __u32 len)
{
	__u32 zero = 0;
	__u8 *buf = bpf_map_lookup_elem(&tc_scratch, &zero);
	if (!buf)
		return -1;
	/* The verifier's bound for the helpers, kept: clang knows the callers'
	 * bound on len and would otherwise drop the mask (or test a copy). */
	asm volatile("" : "+r"(len));
	if (len == 0)
		return 0;
	/* Bounded below too: the helpers take no zero length, and verifiers
	 * before 6.2 learn no lower bound from a test against zero. */
	__u64 n = ((len - 1) & CHANNEL_DATA_MAX_LEN) + 1;
	asm volatile("" : "+r"(n));
	if (bpf_skb_load_bytes(skb, from & 0xff, buf, n) || bpf_skb_store_bytes(skb, to & 0xff, buf, n, 0))
		return -1;
	return 0;
}

/* l2_len is the length of the skb's link-layer header at TC ingress: an
 * Ethernet header, or none on an L3 device (tc_turn_relay_l3). */
static __always_inline __u32 l2_len(const int l3)
{
	return l3 ? 0 : sizeof(struct ethhdr);
}

/* parse_l3 is parse_eth for an skb that starts at the IP header: the family
 * from the version nibble. skb->protocol would say the same on a real L3
 * device; the nibble is what the parser checks next anyway. */
static __always_inline int parse_l3(struct cursor *c, __u16 *proto)
{
	__u8 *v = c->pos;
	if ((void *)(v + 1) > c->end)
		return REASON_NOT_IP;
	switch (*v >> 4) {
	case 4:
		*proto = ETH_P_IP;
		return -1;
	case 6:
		*proto = ETH_P_IPV6;
		return -1;
	}
	return REASON_NOT_IP;
}

/* tc_push_eth puts room for an Ethernet header in front of an L3 skb (zeros,
 * written by tc_emit): what bpf_skb_change_head is for, an L3 skb pushing a
 * MAC header before a redirect into an L2 device. It makes the header the
 * skb's MAC header (mac_len 14), which the hook pulls after the program and
 * pushes again before the redirect; into an L3 egress the redirect takes it
 * off again (__bpf_redirect_no_mac), and bpf_redirect_neigh does as well.
 * Nothing later in the rewrite depends on mac_len but bpf_skb_change_proto,
 * which an L3 skb never reaches (TC_REASON_L3_FAMILY). */
static __always_inline int tc_push_eth(struct __sk_buff *ctx)
{
	return bpf_skb_change_head(ctx, sizeof(struct ethhdr), 0);
}

/* tos_priority is the kernel's rt_tos2priority: ip_tos2prio indexed by the
 * TOS's four bits above the lowest, in groups of four (best effort 0, bulk 2,
 * interactive 6, interactive bulk 4). */
static __always_inline __u32 tos_priority(__u8 tos)
{
	switch ((tos >> 3) & 3) {
	case 1:
		return 2;
	case 2:
		return 6;
	case 3:
		return 4;
	}
	return 0;
}

/* tc_emit writes the Ethernet, IP and UDP headers (and for peer->client the
 * ChannelData header) of the rewritten skb, whose UDP header is at udp_off,
 * and redirects it. */
static __always_inline int tc_emit(struct __sk_buff *skb, __u32 in_ifindex, struct iphdr *ip4, struct rewrite *rw,
				   __be16 channel, __u16 data_len, int c2p, __u32 *reason)
{
	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	struct udphdr *udp;
	__u32 l3_len = rw->family == AF_INET ? sizeof(struct iphdr) : sizeof(struct ipv6hdr);

	if ((void *)(eth + 1) > data_end) {
		*reason = TC_REASON_REWRITE_FAILED;
		return TC_ACT_SHOT;
	}
	if (rw->family == AF_INET) {
		struct iphdr *nip = (void *)(eth + 1);
		if ((void *)(nip + 1) > data_end) {
			*reason = TC_REASON_REWRITE_FAILED;
			return TC_ACT_SHOT;
		}
		ip4->check = 0;
		ip4->check = ipv4_csum(ip4);
		*nip = *ip4;
		eth->h_proto = bpf_htons(ETH_P_IP);
		udp = (void *)(nip + 1);
	} else {
		struct ipv6hdr *nip6 = (void *)(eth + 1);
		if ((void *)(nip6 + 1) > data_end) {
			*reason = TC_REASON_REWRITE_FAILED;
			return TC_ACT_SHOT;
		}
		__builtin_memset(nip6, 0, sizeof(*nip6));
		nip6->version = 6;
		nip6->priority = rw->tos >> 4;
		nip6->flow_lbl[0] = (rw->tos & 0xf) << 4;
		nip6->payload_len = bpf_htons(rw->len - sizeof(struct ipv6hdr));
		nip6->nexthdr = IPPROTO_UDP;
		nip6->hop_limit = rw->ttl;
		__builtin_memcpy(&nip6->saddr, rw->saddr.b, 16);
		__builtin_memcpy(&nip6->daddr, rw->daddr.b, 16);
		eth->h_proto = bpf_htons(ETH_P_IPV6);
		udp = (void *)(nip6 + 1);
	}
	__builtin_memcpy(eth->h_dest, rw->dmac, ETH_ALEN);
	__builtin_memcpy(eth->h_source, rw->smac, ETH_ALEN);

	__u8 *cd = (void *)(udp + 1);
	if ((void *)cd > data_end) {
		*reason = TC_REASON_REWRITE_FAILED;
		return TC_ACT_SHOT;
	}
	udp->source = rw->sport;
	udp->dest = rw->dport;
	udp->len = bpf_htons(rw->len - l3_len);
	udp->check = rw->udp_csum;
	if (!c2p) {
		if ((void *)(cd + CHANNEL_DATA_HDR_LEN) > data_end) {
			*reason = TC_REASON_REWRITE_FAILED;
			return TC_ACT_SHOT;
		}
		*(__be16 *)cd = channel;
		*(__be16 *)(cd + 2) = bpf_htons(data_len);
	}
	if (rw->egress_ifindex == in_ifindex)
		*reason = c2p ? REASON_RELAY_C2P_TX : REASON_RELAY_P2C_TX;
	else
		*reason = c2p ? REASON_RELAY_C2P_REDIRECT : REASON_RELAY_P2C_REDIRECT;
	/* An egress whose transmit routes by the skb's dst (an ip_tunnel device
	 * without a fixed remote: tunl0): bpf_redirect hands it an skb without
	 * one, dropped in the tunnel's transmit. bpf_redirect_neigh routes the
	 * packet out of that device, attaches the route and resolves the
	 * neighbour. Its params NULL and plen 0: on 5.10's two-argument form
	 * the second argument is the flags, 0 as well. */
	/* The skb leaves as the stack would send a datagram with its TOS:
	 * egress qdiscs that sort by priority (pfifo_fast's and prio's bands)
	 * see the priority ip_forward and a socket's IP_TOS give it
	 * (rt_tos2priority; IPv6 none), and no mark of the ingress's (a
	 * socket's, 0: pion/turn's set none) reaches the egress's rules. */
	skb->priority = rw->family == AF_INET ? tos_priority(rw->tos) : 0;
	skb->mark = 0;
	const struct dev_cap *out = bpf_map_lookup_elem(&dev_caps, &rw->egress_ifindex);
	if (out && (out->flags & DEV_XMIT_NEEDS_ROUTE)) {
		tc_count(TC_REASON_REDIRECT_NEIGH);
		return bpf_redirect_neigh(rw->egress_ifindex, 0, 0, 0);
	}
	/* Out of the egress through the skb path (dev_queue_xmit): any device.
	 * The MACs are the FIB's, as XDP's. */
	return bpf_redirect(rw->egress_ifindex, 0);
}

/* tc_over_limit is over_limit with TC's verdicts. */
static __always_inline int tc_over_limit(const struct rate_limit *rl, __u32 alloc_id, __u16 data_len, __u32 *reason)
{
	struct alloc_rate *ar = bpf_map_lookup_elem(&alloc_rates, &alloc_id);
	if (!ar || !rate_limited(ar, rl, data_len))
		return -1;
	*reason = REASON_RATE_LIMITED;
	return rl->pass ? TC_ACT_OK : TC_ACT_SHOT;
}

/* xdp_ran tells whether the XDP program ran on what arrives on the device
 * (its dev_caps say it is attached there, or nothing is known of it): then
 * its shield has passed the packet, and the engine's would charge a request's
 * admission twice. The shield runs once, in the first engine. */
static __always_inline int xdp_ran(__u32 ifindex)
{
	const struct dev_cap *d = bpf_map_lookup_elem(&dev_caps, &ifindex);
	return !d || (d->flags & (DEV_ATTACHED_NATIVE | DEV_ATTACHED_GENERIC));
}

static __always_inline int tc_client_to_peer(struct __sk_buff *ctx, struct cursor *c, struct input *in,
					     struct udphdr *udp, __u32 *reason, const int l3)
{
	__u16 payload_len = bpf_ntohs(udp->len) - sizeof(*udp);
	__be16 channel;
	__u16 data_len, pad;
	/* The binding, as XDP finds it (the flow caches are shared: their
	 * entries describe themselves), and learned as XDP learns it (and XDP's
	 * reply next hop dropped). What is not bound meets the shield. */
	struct c2p_found b;
	int r = parse_channel_data(c, payload_len, &channel, &data_len, &pad);
	if (r < 0 && (r = c2p_mapped(in)) < 0)
		r = c2p_lookup(in, udp, channel, flow_generation(fib_generation()), &b);
	if (r >= 0) {
		*reason = xdp_ran(in->ifindex) ? r : listener_shield(c, in, udp, r);
		return shield_drops(*reason) ? TC_ACT_SHOT : TC_ACT_OK;
	}
	if ((r = c2p_admit(c, in, udp)) >= 0) {
		*reason = r;
		return TC_ACT_OK;
	}
	struct binding_state *st = b.st;
	struct bpf_fib_lookup fib;
	if ((r = reverse_path(ctx, in, &fib)) >= 0) {
		*reason = r; /* the stack drops it: it teaches nothing */
		return TC_ACT_OK;
	}
	learn_listener_addr(st, &in->daddr, udp->dest);

	struct rewrite rw = {};
	c2p_rewrite(&rw, in, &b, data_len);
	r = tc_next_hop(ctx, in->ifindex, &rw);
	if (r >= 0) {
		*reason = r;
		return TC_ACT_OK;
	}
	__u32 udp_off = l2_len(l3) + in->l3_len;
	int partial = partial_state(ctx, udp_off);
	if (partial < 0) {
		*reason = TC_REASON_PARTIAL_ELSEWHERE;
		return TC_ACT_OK;
	}
	if (l3 && in->family == AF_INET6) {
		*reason = TC_REASON_L3_FAMILY;
		return TC_ACT_OK;
	}
	const struct rate_limit *rl = limit_on();
	if (rl && (r = tc_over_limit(rl, c2p_alloc_id(&b), data_len, reason)) >= 0)
		return r;

	__u16 new_udp_len = bpf_htons(sizeof(struct udphdr) + data_len);
	if (partial) {
		/* The egress sums the datagram from this header: the field holds
		 * the output's pseudo-header sum, as the sender's stack left it. */
		rw.udp_csum = (__u16)~csum_fold(pseudo_sum(&rw.saddr, &rw.daddr, 1, new_udp_len));
	} else {
		__be32 from[12] = {}, to[5] = {};
		__u32 pad_sum;
		c2p_to_words(to, &rw, new_udp_len);
		if (c2p_pad_sum(c, data_len, pad, &pad_sum)) {
			*reason = REASON_MALFORMED_CHANNEL_DATA;
			return TC_ACT_OK;
		}
		int n = c2p_from_words(from, in, udp);
		rw.udp_csum = udp_csum_update(udp->check, from, n, to, 4, pad_sum);
	}

	struct iphdr ip4 = {};
	if ((r = c2p_ip4(c, in, udp, &rw, &ip4)) >= 0) {
		*reason = r;
		return TC_ACT_OK;
	}

	/* The rewrite. Until the data moves, a failure leaves the packet as it
	 * came (an L3 skb's pushed header aside, which the hook pulls again): a
	 * change of the tail to its own length makes the skb linear and
	 * writable (and fails where the trim after the move would). */
	if (l3 && tc_push_eth(ctx)) {
		*reason = REASON_ADJUST_FAILED;
		return TC_ACT_OK;
	}
	__u32 data_off = sizeof(struct ethhdr) + in->l3_len + sizeof(struct udphdr) + CHANNEL_DATA_HDR_LEN;
	if (bpf_skb_change_tail(ctx, ctx->len, 0)) {
		*reason = REASON_ADJUST_FAILED;
		return TC_ACT_OK;
	}
	if (in->family == AF_INET6) {
		/* 20 bytes fewer before the network header: L4 stays in place. */
		if (bpf_skb_change_proto(ctx, bpf_htons(ETH_P_IP), 0)) {
			*reason = REASON_ADJUST_FAILED;
			return TC_ACT_OK;
		}
		data_off -= sizeof(struct ipv6hdr) - sizeof(struct iphdr);
	}
	/* The data 4 bytes down over the ChannelData header, then the tail cut
	 * after it (padding, Ethernet trailer, the data's old last 4 bytes). */
	if (tc_move(ctx, data_off, data_off - CHANNEL_DATA_HDR_LEN, data_len) ||
	    bpf_skb_change_tail(ctx, data_off - CHANNEL_DATA_HDR_LEN + data_len, 0) || complete_left(ctx)) {
		*reason = TC_REASON_REWRITE_FAILED;
		return TC_ACT_SHOT;
	}
	int action = tc_emit(ctx, in->ifindex, &ip4, &rw, channel, data_len, 1, reason);
	if (action == TC_ACT_REDIRECT && st)
		count_binding(st, 1, data_len);
	return action;
}

static __always_inline int tc_p2c_out(struct __sk_buff *ctx, struct cursor *c, struct input *in, struct udphdr *udp,
				      __u32 *reason, struct binding_state *st, const struct p2c_binding *bind,
				      const int to_v4, const int l3)
{
	struct iphdr *old;
	__u16 data_len;
	int r = p2c_admit(c, in, udp, st, to_v4, &old, &data_len);
	if (r >= 0) {
		*reason = r;
		return TC_ACT_OK;
	}

	struct bpf_fib_lookup fib;
	if ((r = reverse_path(ctx, in, &fib)) >= 0) {
		*reason = r;
		return TC_ACT_OK;
	}
	struct rewrite rw = {};
	p2c_rewrite(&rw, in, st, bind, data_len, to_v4);
	r = tc_next_hop(ctx, in->ifindex, &rw);
	if (r >= 0) {
		*reason = r;
		return TC_ACT_OK;
	}
	int partial = partial_state(ctx, l2_len(l3) + sizeof(struct iphdr));
	if (partial < 0) {
		*reason = TC_REASON_PARTIAL_ELSEWHERE;
		return TC_ACT_OK;
	}
	if (l3 && !to_v4) {
		*reason = TC_REASON_L3_FAMILY;
		return TC_ACT_OK;
	}
	const struct rate_limit *rl = limit_on();
	if (rl && (r = tc_over_limit(rl, bind->alloc_id, data_len, reason)) >= 0)
		return r;

	__be16 channel = bind->channel;
	__u16 new_udp_len = bpf_htons(sizeof(struct udphdr) + CHANNEL_DATA_HDR_LEN + data_len);
	if (partial) {
		rw.udp_csum = (__u16)~csum_fold(pseudo_sum(&rw.saddr, &rw.daddr, to_v4, new_udp_len));
	} else {
		__be32 from[4] = {}, to[12] = {};
		int n = p2c_to_words(to, &rw, new_udp_len, channel, data_len, to_v4);
		p2c_from_words(from, in, udp);
		rw.udp_csum = udp_csum_update(udp->check, from, 4, to, n, 0);
	}

	struct iphdr ip4 = *old;
	ip4.tot_len = bpf_htons(rw.len);
	ip4.ttl = rw.ttl;
	ip4.saddr = addr_v4(&rw.saddr);
	ip4.daddr = addr_v4(&rw.daddr);

	/* The tail first: the Ethernet trailer off, then 4 bytes on. Until the
	 * data moves a failure leaves what the stack reads unchanged (zeros
	 * after the IP packet are a trailer to it; an L3 skb's pushed header
	 * the hook pulls again). */
	if (l3 && tc_push_eth(ctx)) {
		*reason = REASON_ADJUST_FAILED;
		return TC_ACT_OK;
	}
	__u32 data_off = sizeof(struct ethhdr) + sizeof(struct iphdr) + sizeof(struct udphdr);
	__u32 end = data_off + data_len;
	if ((ctx->len != end && bpf_skb_change_tail(ctx, end, 0)) ||
	    bpf_skb_change_tail(ctx, end + CHANNEL_DATA_HDR_LEN, 0)) {
		*reason = REASON_ADJUST_FAILED;
		return TC_ACT_OK;
	}
	if (!to_v4) {
		/* 20 bytes more before the network header: L4 stays in place. */
		if (bpf_skb_change_proto(ctx, bpf_htons(ETH_P_IPV6), 0)) {
			*reason = REASON_ADJUST_FAILED;
			return TC_ACT_OK;
		}
		data_off += sizeof(struct ipv6hdr) - sizeof(struct iphdr);
	}
	if (tc_move(ctx, data_off, data_off + CHANNEL_DATA_HDR_LEN, data_len) || complete_left(ctx)) {
		*reason = TC_REASON_REWRITE_FAILED;
		return TC_ACT_SHOT;
	}
	int action = tc_emit(ctx, in->ifindex, &ip4, &rw, channel, data_len, 0, reason);
	if (action == TC_ACT_REDIRECT)
		count_binding(st, 0, data_len);
	return action;
}

static __always_inline int tc_peer_to_client(struct __sk_buff *ctx, struct cursor *c, struct input *in,
					     struct udphdr *udp, __u32 *reason, const int l3)
{
	if (in->family != AF_INET) {
		*reason = REASON_NO_PEER_BINDING;
		return TC_ACT_OK;
	}
	struct binding_state *st;
	struct p2c_binding v;
	const struct p2c_binding *bind;
	int r = p2c_lookup(in, udp, flow_generation(fib_generation()), &v, &bind, &st);
	if (r >= 0) {
		*reason = r;
		return TC_ACT_OK;
	}
	if (addr_is_v4(&bind->client_addr))
		return tc_p2c_out(ctx, c, in, udp, reason, st, bind, 1, l3);
	return tc_p2c_out(ctx, c, in, udp, reason, st, bind, 0, l3);
}

static __always_inline int tc_relay(struct __sk_buff *ctx, __u32 *reason, const int l3)
{
	/* Several datagrams in one skb (UDP GSO from a pod, GRO): the stack
	 * segments them; relaying the skb would send one datagram. */
	if (ctx->gso_size) {
		*reason = TC_REASON_GSO;
		return TC_ACT_OK;
	}
	/* A VLAN tag a device took off (skb->vlan_tci): the frame was tagged,
	 * which XDP sees and passes; the stack hands it to the VLAN device. */
	if (ctx->vlan_present) {
		*reason = REASON_NOT_IP;
		return TC_ACT_OK;
	}
	/* The parser reads the whole packet in the linear part, as XDP's frame. */
	if (ctx->data_end - ctx->data < ctx->len && bpf_skb_pull_data(ctx, ctx->len)) {
		*reason = REASON_ADJUST_FAILED;
		return TC_ACT_OK;
	}
	struct cursor c = {
		.pos = (void *)(long)ctx->data,
		.end = (void *)(long)ctx->data_end,
	};
	struct ethhdr *eth;
	struct udphdr *udp;
	struct input in = {};
	__u16 proto;
	int r;

	/* The device the skb arrived on: at TC ingress skb->dev, which
	 * __netif_receive_skb_core has just made skb_iif (ingress_ifindex) as
	 * well. Read from skb->dev: a BPF_PROG_RUN before 5.15 sets only that. */
	in.ifindex = ctx->ifindex;
	/* On a device without a link-layer header the hook pushed mac_len
	 * bytes in front of the IP header: none where the tunnel reset the
	 * MAC header at decapsulation (tun, WireGuard; ip_tunnel devices from
	 * 6.1 at the latest), the outer Ethernet and IP headers where it did
	 * not (5.10's tunl0). Not ours to parse past: pion/turn relays it.
	 * BPF_PROG_RUN sets no mac_len (0): the branch runs on real devices
	 * only (the kernel matrix's calico-ipip row on 5.10). */
	if (l3 && SKB_FIELD(ctx, skb_kern(ctx), mac_len)) {
		*reason = TC_REASON_L3_OUTER_HEADERS;
		return TC_ACT_OK;
	}
	if ((r = l3 ? parse_l3(&c, &proto) : parse_eth(&c, &eth, &proto)) >= 0) {
		*reason = r;
		return TC_ACT_OK;
	}
	if (proto == ETH_P_IP) {
		if ((r = parse_input_v4(&c, &in, &udp)) >= 0) {
			*reason = r;
			return TC_ACT_OK;
		}
		switch (port_kind(udp->dest)) {
		case PORT_CLIENT:
			return tc_client_to_peer(ctx, &c, &in, udp, reason, l3);
		case PORT_PEER:
			return tc_peer_to_client(ctx, &c, &in, udp, reason, l3);
		default:
			break;
		}
	} else {
		if ((r = parse_input_v6(&c, &in, &udp)) >= 0) {
			*reason = r;
			return TC_ACT_OK;
		}
		switch (port_kind(udp->dest)) {
		case PORT_CLIENT:
			return tc_client_to_peer(ctx, &c, &in, udp, reason, l3);
		case PORT_PEER:
			return tc_peer_to_client(ctx, &c, &in, udp, reason, l3);
		default:
			break;
		}
	}
	*reason = REASON_NOT_OURS;
	return TC_ACT_OK;
}

static __always_inline int tc_run(struct __sk_buff *ctx, const int l3)
{
	__u32 reason = REASON_NOT_OURS;
	int action = tc_relay(ctx, &reason, l3);
	tc_count(reason);
	/* What it does not relay goes on to the hook's next program (another
	 * Gateway's engine on the node), untouched, then to the stack: TC_ACT_OK
	 * would end the tcx chain there. */
	return action == TC_ACT_OK ? TC_NEXT : action;
}

/* The engine on a device with an Ethernet header: NICs, veths, VXLAN and
 * Geneve devices, bridges. */
SEC("tc")
int tc_turn_relay(struct __sk_buff *ctx)
{
	return tc_run(ctx, 0);
}

/* The engine on a device without a link-layer header (ARPHRD_NONE, TUNNEL,
 * IPGRE...: tunl0, a WireGuard or GRE device), where an overlay's
 * decapsulated media enter: the skb starts at the IP header. The loader
 * attaches the one or the other by the device's type. */
SEC("tc")
int tc_turn_relay_l3(struct __sk_buff *ctx)
{
	return tc_run(ctx, 1);
}
