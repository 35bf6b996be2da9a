//go:build ignore

// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/* XDP fast path of stunnerd-xdp: relays TURN ChannelData over UDP for the
 * channel bindings pion/turn mirrors into the maps. Clients use IPv4 or IPv6;
 * relays and peers are IPv4.
 *
 *   client->peer: ChannelData to a destination a listener accepts (its own
 *                 port, or one a DNAT translates to it: wire_ports), from a
 *                 bound (client, listener, channel): strip the 4-byte header
 *                 and any padding, send relay (as the peer sees it) -> peer.
 *   peer->client: UDP to a relay port (or the port a source NAT gave a relay on
 *                 the wire: nat_relay_ports) from the exact bound peer
 *                 address:port: prepend the header, send from the address and
 *                 port the client's packets arrived at on the wire -> client.
 *
 * What leaves is what pion/turn and the node's kernel would send: TTL less one,
 * a UDP checksum that verifies exactly when the input's did (a full one for a
 * CHECKSUM_PARTIAL input). Anything else, and anything the program cannot do as
 * faithfully, is XDP_PASSed untouched so that the kernel hands it to pion/turn.
 * The program never answers a packet; it drops one only when its egress
 * vanished between the lookup and the redirect (the frame is rewritten by then)
 * and, when the operator asked for it (--over-limit=drop), a bound packet over
 * its allocation's rate limit. */
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/udp.h>
#include <bpf_helpers.h>
#include <bpf_endian.h>

#include "consts.h"
#include "parsing.h"
#include "csum.h"
#include "maps.h"
#include "rate.h"

char __license[] SEC("license") = "Dual BSD/GPL";

/* A compiler barrier: the BPF JITs emit loads and stores in program order,
 * which the CPU keeps on TSO machines (cfg.tso). */
#define barrier() asm volatile("" ::: "memory")
#define READ_ONCE(x) (*(volatile typeof(x) *)&(x))

/* Set by the loader through spec.Variables before the program is loaded. */
volatile const struct config cfg = {};

/* Force the enum into BTF for bpf2go (enum dev_flag is struct dev_cap's). */
const enum reason *_unused_reason __attribute__((unused));
const enum shield_flag *_unused_shield_flag __attribute__((unused));

static __always_inline __be32 addr_v4(const struct addr *a)
{
	return *(const __be32 *)&a->b[12];
}

static __always_inline void addr_set_v4(struct addr *a, __be32 v4)
{
	__builtin_memset(a, 0, sizeof(*a));
	a->b[10] = 0xff;
	a->b[11] = 0xff;
	*(__be32 *)&a->b[12] = v4;
}

/* addr_is_v4 tells an IPv4-mapped address (::ffff:a.b.c.d) from an IPv6 one. */
static __always_inline int addr_is_v4(const struct addr *a)
{
	const __u32 *w = (const __u32 *)a->b;
	return w[0] == 0 && w[1] == 0 && w[2] == bpf_htonl(0xffff);
}

static __always_inline int addr_is_zero(const struct addr *a)
{
	const __u32 *w = (const __u32 *)a->b;
	return (w[0] | w[1] | w[2] | w[3]) == 0;
}

/* words_eq compares n 32-bit words, n at most 9 (struct p2c_key). */
static __always_inline int words_eq(const void *a, const void *b, int n)
{
	const __u32 *x = a, *y = b;
	__u32 d = 0;
#pragma unroll
	for (int i = 0; i < 9; i++) {
		if (i < n)
			d |= x[i] ^ y[i];
	}
	return d == 0;
}

static __always_inline int addr_eq(const struct addr *a, const struct addr *b)
{
	return words_eq(a->b, b->b, 4);
}

static __always_inline int is_listener_port(__be16 port)
{
	__u16 n = cfg.listener_port_count; /* cfg is volatile: read it once */
#pragma unroll
	for (int i = 0; i < MAX_LISTENER_PORTS; i++) {
		if (i < n && cfg.listener_ports[i] == port)
			return 1;
	}
	return 0;
}

static __always_inline int is_relay_port(__be16 port)
{
	__u16 p = bpf_ntohs(port);
	return cfg.min_relay_port != 0 && p >= cfg.min_relay_port && p <= cfg.max_relay_port;
}

/* port_bit tells whether port's bit is set in a port bitmap (wire_ports,
 * nat_relay_ports: bit port % 64 of word port / 64), written by userspace.
 * One inlined array access. */
static __always_inline int port_bit(void *bitmap, __be16 port)
{
	__u16 p = bpf_ntohs(port);
	__u32 word = p >> 6;
	const __u64 *bits = bpf_map_lookup_elem(bitmap, &word);
	return bits && (*bits >> (p & 63)) & 1;
}

/* Which path a UDP destination port takes, in this order: a listener port,
 * a relay port, a port a DNAT translates to a listener port (a NodePort:
 * wire_ports), the port a source NAT gave a relay on the wire (a masquerade:
 * nat_relay_ports). A translated port inside the relay range is a relay port.
 * One answer, so that each engine inlines each path once per family. */
enum port_kind {
	PORT_NOT_OURS = 0,
	PORT_CLIENT, /* client->peer */
	PORT_PEER,   /* peer->client */
};

static __always_inline enum port_kind port_kind(__be16 port)
{
	if (is_listener_port(port))
		return PORT_CLIENT;
	if (is_relay_port(port))
		return PORT_PEER;
	if (port_bit(&wire_ports, port))
		return PORT_CLIENT;
	return port_bit(&nat_relay_ports, port) ? PORT_PEER : PORT_NOT_OURS;
}

/* flow_mix folds 8 bytes into a flow cache index hash (a multiplicative hash:
 * a few instructions where a hash map lookup costs tens of nanoseconds). */
static __always_inline __u64 flow_mix(__u64 h, __u64 w)
{
	h = (h ^ w) * 0x9e3779b97f4a7c15ULL;
	return h ^ (h >> 29);
}

/* flow_index is the entry for hash h in this CPU's region of a flow cache
 * (the program runs to its end on one CPU, and no other writes there): the
 * top bits of h, the only ones of a product that every input bit reaches. */
static __always_inline __u32 flow_index(__u64 h)
{
	return (bpf_get_smp_processor_id() << cfg.flow_shift) | (__u32)(h >> (64 - cfg.flow_shift));
}

static __always_inline __u64 addr_hash(__u64 h, const struct addr *a)
{
	const __u64 *q = (const __u64 *)a->b;
	return flow_mix(flow_mix(h, q[0]), q[1]);
}

/* A rewrite computed before the packet is touched: if forwarding fails we still
 * hold the original packet and can pass it. */
struct rewrite {
	struct addr saddr; /* IPv4-mapped for an IPv4 output */
	struct addr daddr;
	unsigned char dmac[ETH_ALEN];
	unsigned char smac[ETH_ALEN];
	__be16 sport;
	__be16 dport;
	__u16 len;      /* output packet length from the IP header on, host order */
	__u16 udp_csum; /* new UDP checksum, as stored */
	__u32 egress_ifindex;
	__u8 family;    /* of the output: AF_INET or AF_INET6 */
	__u8 tos;       /* IPv4 TOS, or IPv6 traffic class */
	__u8 ttl;       /* TTL or hop limit of the output */
};

/* fib_generation reads the FIB generation; read it before the binding, so
 * that a next hop resolved for an address userspace has since replaced is
 * stored as stale. */
static __always_inline __u32 fib_generation(void)
{
	__u32 zero = 0;
	__u32 *g = bpf_map_lookup_elem(&fib_gen, &zero);
	return g ? *g : 0;
}

/* flow_generation is the generation the flow caches are used in: gen, or 0
 * (not used) when the program was loaded without them or while they stand
 * aside (FLOWS_ASIDE). */
static __always_inline __u32 flow_generation(__u32 gen)
{
	return cfg.flow_cache && !(gen & FLOWS_ASIDE) ? gen : 0;
}

/* hop_valid tells whether a cached next hop answers this lookup as
 * bpf_fib_lookup would now. */
static __always_inline int hop_valid(const struct next_hop *h, __u32 gen, __u32 in_ifindex, const struct rewrite *rw)
{
	return h->gen == gen && h->in_ifindex == in_ifindex && h->tos == rw->tos && rw->len <= h->max_len;
}

/* xdp_xmit_refused tells whether a frame the program sends out of egress
 * (XDP_TX when it is the ingress, else XDP_REDIRECT) would be lost after the
 * program returned: from a native-mode ingress, a redirected frame goes to the
 * egress driver's ndo_xdp_xmit, which a bridge, a VLAN, macvlan or tunnel
 * device, and a veth whose peer runs no XDP (and no GRO), do not have or
 * refuse; XDP_TX out of a veth is that same transmit into its peer
 * (drivers/net/veth.c: veth_xdp_tx -> veth_xdp_xmit). From a generic-mode
 * ingress both go out through the skb path (generic_xdp_tx), which every
 * device takes. Nothing known of the ingress: as native; of the egress: it
 * transmits nothing. Asked on the slow path only: the cached next hop is
 * stored only when the answer was "transmitted". A global function: one copy,
 * verified once, called (a few ns) only after a bpf_fib_lookup. */
__attribute__((noinline)) int xdp_xmit_refused(__u32 in_ifindex, __u32 out_ifindex)
{
	const struct dev_cap *in = bpf_map_lookup_elem(&dev_caps, &in_ifindex);
	if (in && (in->flags & DEV_ATTACHED_GENERIC))
		return 0;
	if (out_ifindex == in_ifindex)
		return !in || !(in->flags & DEV_XDP_TX);
	const struct dev_cap *out = bpf_map_lookup_elem(&dev_caps, &out_ifindex);
	return !out || !(out->flags & DEV_XDP_XMIT);
}

/* The input, whichever its family. */
struct input {
	struct addr saddr, daddr; /* IPv4-mapped for IPv4 */
	__u32 l3_len;             /* IP header length: 20 or 40 */
	__u32 l3_total;           /* IP header plus payload */
	__u8 family;
	__u8 tos;                 /* TOS or traffic class */
	__u8 ttl;                 /* TTL or hop limit */
	/* ctx->ingress_ifindex, read once at entry: clang may otherwise keep
	 * its address, and the verifier refuses loads through a moved ctx. */
	__u32 ifindex;
};

/* The loopback device's ifindex in every network namespace (LOOPBACK_IFINDEX). */
#define LOOPBACK_IFINDEX 1

/* reverse_path is the stack's reverse-path filter (fib_validate_source) for
 * an IPv4 packet from a device whose dev_caps say the stack filters there
 * (DEV_RP_*): the route back to the packet's source from its destination,
 * looked up as the kernel looks it up for a packet it delivers locally (as
 * an input from lo), must leave through the ingress (strict) or exist
 * (loose). A local, broadcast, blackholed or unreachable source, or none
 * routed, fails both. -1 when the stack would take the packet, else the
 * reason to pass it. fib is the caller's lookup buffer (one on the stack).
 * Not matched: a multipath route back, which the stack accepts if any of
 * its next hops leaves through the ingress and bpf_fib_lookup names one (the
 * others pass), and rules on ports or marks (the lookup carries neither). */
static __always_inline int reverse_path(void *ctx, const struct input *in, struct bpf_fib_lookup *fib)
{
	if (in->family != AF_INET)
		return -1; /* IPv6 has no rp_filter setting */
	__u32 gen = fib_generation();
	if (gen && !(gen & GEN_RP_FILTER))
		return -1; /* no device filters */
	__u32 ifindex = in->ifindex;
	const struct dev_cap *cap = bpf_map_lookup_elem(&dev_caps, &ifindex);
	if (!cap || !(cap->flags & (DEV_RP_STRICT | DEV_RP_LOOSE)))
		return -1;
	__builtin_memset(fib, 0, sizeof(*fib));
	fib->family = AF_INET;
	fib->ifindex = LOOPBACK_IFINDEX;
	fib->tos = in->tos;
	/* The filter does not measure. A length that fits any IPv4 MTU: without
	 * one TC's lookup measures the skb against the route's device (the route
	 * back may leave through a smaller MTU than the packet came in on). */
	fib->tot_len = sizeof(struct iphdr);
	fib->ipv4_src = addr_v4(&in->daddr);
	fib->ipv4_dst = addr_v4(&in->saddr);
	switch (bpf_fib_lookup(ctx, fib, sizeof(*fib), 0)) {
	case BPF_FIB_LKUP_RET_SUCCESS:
	case BPF_FIB_LKUP_RET_NO_NEIGH: /* the device is named before the neighbour */
		break;
	case BPF_FIB_LKUP_RET_BLACKHOLE:
	case BPF_FIB_LKUP_RET_UNREACHABLE:
	case BPF_FIB_LKUP_RET_PROHIBIT:
	case BPF_FIB_LKUP_RET_NOT_FWDED: /* local, broadcast, no route */
		return REASON_RP_FILTER;
	default:
		/* Forwarding off on lo, an LWT route, errors: not as the stack. */
		return REASON_RP_UNCHECKED;
	}
	if ((cap->flags & DEV_RP_STRICT) && fib->ifindex != ifindex)
		return REASON_RP_FILTER;
	return -1;
}

/* next_hop resolves the rewritten packet's next hop and fills in the MACs,
 * from the binding's cached one when it is still valid (gen 0: no cache). It
 * returns -1 when the packet can be forwarded, else the PASS reason. A next
 * hop is resolved only for a packet the stack's reverse-path filter would
 * take (reverse_path): a cached one for this ingress stands for that check
 * too, whose answer depends on nothing that does not move the FIB
 * generation (routes, addresses, dev_caps). */
static __always_inline int next_hop(struct xdp_md *ctx, const struct input *in, struct rewrite *rw,
				    struct binding_state *st, int c2p, __u32 gen)
{
	__u32 in_ifindex = in->ifindex;
	struct next_hop *h = 0;
	if (st && gen) {
		int hit = 0;
		h = c2p ? &st->c2p_hop : &st->p2c_hop;
		if (cfg.tso) {
			/* A seqcount read: the entry is used only if no writer was in
			 * it (seq even) and none came between the two reads of seq. */
			__u32 seq = READ_ONCE(h->seq);
			barrier();
			if (!(seq & 1) && hop_valid(h, gen, in_ifindex, rw)) {
				__builtin_memcpy(rw->dmac, h->dmac, ETH_ALEN);
				__builtin_memcpy(rw->smac, h->smac, ETH_ALEN);
				rw->egress_ifindex = h->ifindex;
				barrier();
				hit = READ_ONCE(h->seq) == seq;
			}
		} else {
			bpf_spin_lock(&st->lock);
			if (hop_valid(h, gen, in_ifindex, rw)) {
				__builtin_memcpy(rw->dmac, h->dmac, ETH_ALEN);
				__builtin_memcpy(rw->smac, h->smac, ETH_ALEN);
				rw->egress_ifindex = h->ifindex;
				hit = 1;
			}
			bpf_spin_unlock(&st->lock);
		}
		if (hit)
			return -1;
	}

	struct bpf_fib_lookup fib;
	int r = reverse_path(ctx, in, &fib);
	if (r >= 0)
		return r;
	__builtin_memset(&fib, 0, sizeof(fib));
	fib.family = rw->family;
	fib.l4_protocol = IPPROTO_UDP;
	fib.sport = rw->sport;
	fib.dport = rw->dport;
	/* The whole packet against the MTU: for IPv6, stricter than payload-only. */
	fib.tot_len = rw->len;
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

	long rc = bpf_fib_lookup(ctx, &fib, sizeof(fib), 0);
	switch (rc) {
	case BPF_FIB_LKUP_RET_SUCCESS:
		break;
	case BPF_FIB_LKUP_RET_NO_NEIGH:
		/* The kernel resolves the neighbour while userspace relays this one. */
		return REASON_FIB_NO_NEIGH;
	case BPF_FIB_LKUP_RET_FRAG_NEEDED:
		return REASON_FIB_FRAG_NEEDED;
	case BPF_FIB_LKUP_RET_FWD_DISABLED:
		/* bpf_fib_lookup needs forwarding on for the ingress device (for the
		 * output's family). */
		return REASON_FIB_FWD_DISABLED;
	default:
		/* Local (hairpin), blackhole, unreachable, prohibited, LWT, errors. */
		return REASON_FIB_NOT_FORWARDED;
	}
	__builtin_memcpy(rw->dmac, fib.dmac, ETH_ALEN);
	__builtin_memcpy(rw->smac, fib.smac, ETH_ALEN);
	rw->egress_ifindex = fib.ifindex;
	if (fib.ifindex != in_ifindex) {
		__u32 ifindex = fib.ifindex;
		if (!bpf_map_lookup_elem(&tx_ports, &ifindex))
			return REASON_EGRESS_NOT_ATTACHED;
	}
	if (xdp_xmit_refused(in_ifindex, fib.ifindex))
		return REASON_EGRESS_NO_XDP_XMIT;
	if (h) {
		bpf_spin_lock(&st->lock);
		h->seq++;
		barrier();
		/* A longer packet that fit widens the entry; anything else starts it
		 * afresh. */
		if (h->gen != gen || h->in_ifindex != in_ifindex || h->tos != rw->tos || h->ifindex != rw->egress_ifindex)
			h->max_len = 0;
		h->gen = gen;
		h->in_ifindex = in_ifindex;
		h->tos = rw->tos;
		h->ifindex = rw->egress_ifindex;
		if (rw->len > h->max_len)
			h->max_len = rw->len;
		__builtin_memcpy(h->dmac, rw->dmac, ETH_ALEN);
		__builtin_memcpy(h->smac, rw->smac, ETH_ALEN);
		barrier();
		h->seq++;
		bpf_spin_unlock(&st->lock);
	}
	return -1;
}

/* emit writes the new Ethernet, IP and UDP headers (and for peer->client the
 * ChannelData header) at the start of the resized packet and returns the XDP
 * action with its reason. ip4 is the IPv4 header to write for an IPv4 output
 * (its check is computed here); an IPv6 output is built from rw. */
static __always_inline int emit(struct xdp_md *ctx, __u32 in_ifindex, struct iphdr *ip4, struct rewrite *rw,
				__be16 channel, __u16 data_len, int c2p, __u32 *reason)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data;
	struct udphdr *udp;
	__u32 l3_len = rw->family == AF_INET ? sizeof(struct iphdr) : sizeof(struct ipv6hdr);

	if ((void *)(eth + 1) > data_end) {
		*reason = REASON_ADJUST_FAILED;
		return XDP_ABORTED; /* cannot happen: sizes were checked before */
	}
	if (rw->family == AF_INET) {
		struct iphdr *nip = (void *)(eth + 1);
		if ((void *)(nip + 1) > data_end) {
			*reason = REASON_ADJUST_FAILED;
			return XDP_ABORTED;
		}
		ip4->check = 0;
		ip4->check = ipv4_csum(ip4);
		*nip = *ip4;
		eth->h_proto = bpf_htons(ETH_P_IP);
		udp = (void *)(nip + 1);
	} else {
		struct ipv6hdr *nip6 = (void *)(eth + 1);
		if ((void *)(nip6 + 1) > data_end) {
			*reason = REASON_ADJUST_FAILED;
			return XDP_ABORTED;
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
	/* In 16-bit words: struct ethhdr is packed, and clang copies it byte by
	 * byte (24 instructions). The frame starts 2 bytes before a 4-byte
	 * boundary (NET_IP_ALIGN), so wider stores would be misaligned. */
	__u16 *mac = (__u16 *)eth;
	const __u16 *dmac = (const __u16 *)rw->dmac, *smac = (const __u16 *)rw->smac;
	mac[0] = dmac[0];
	mac[1] = dmac[1];
	mac[2] = dmac[2];
	mac[3] = smac[0];
	mac[4] = smac[1];
	mac[5] = smac[2];

	__u8 *cd = (void *)(udp + 1);
	if ((void *)cd > data_end) {
		*reason = REASON_ADJUST_FAILED;
		return XDP_ABORTED;
	}
	udp->source = rw->sport;
	udp->dest = rw->dport;
	udp->len = bpf_htons(rw->len - l3_len);
	udp->check = rw->udp_csum;
	if (!c2p) {
		if ((void *)(cd + CHANNEL_DATA_HDR_LEN) > data_end) {
			*reason = REASON_ADJUST_FAILED;
			return XDP_ABORTED;
		}
		*(__be16 *)cd = channel;
		*(__be16 *)(cd + 2) = bpf_htons(data_len);
	}

	if (rw->egress_ifindex == in_ifindex) {
		*reason = c2p ? REASON_RELAY_C2P_TX : REASON_RELAY_P2C_TX;
		return XDP_TX;
	}
	/* The frame is rewritten: if the egress left the devmap since next_hop
	 * looked, it must not reach the stack as if it had arrived. */
	int action = bpf_redirect_map(&tx_ports, rw->egress_ifindex, XDP_DROP);
	if (action == XDP_DROP)
		*reason = REASON_REDIRECT_FAILED;
	else
		*reason = c2p ? REASON_RELAY_C2P_REDIRECT : REASON_RELAY_P2C_REDIRECT;
	return action;
}

/* over_limit is next_hop's sequel for a bound packet that would be relayed:
 * -1 when it goes on, else the action for a packet over its allocation's
 * limit. Dropping is the operator's choice (--over-limit=drop); the program
 * drops nothing else that it could pass. */
static __always_inline int over_limit(const struct rate_limit *rl, __u32 alloc_id, __u16 data_len, __u32 *reason)
{
	struct alloc_rate *ar = bpf_map_lookup_elem(&alloc_rates, &alloc_id);
	if (!ar || !rate_limited(ar, rl, data_len))
		return -1;
	*reason = REASON_RATE_LIMITED;
	return rl->pass ? XDP_PASS : XDP_DROP;
}

static __always_inline void count_binding(struct binding_state *st, int c2p, __u16 data_len)
{
	if (c2p) {
		__sync_fetch_and_add(&st->stats.c2p_packets, 1);
		__sync_fetch_and_add(&st->stats.c2p_bytes, data_len);
	} else {
		__sync_fetch_and_add(&st->stats.p2c_packets, 1);
		__sync_fetch_and_add(&st->stats.p2c_bytes, data_len);
	}
}

/* resize drops `tail` bytes from the end of the frame (padding, Ethernet
 * trailer) and moves its start by `head` bytes (positive: shrink). */
static __always_inline int resize(struct xdp_md *ctx, __u32 tail, int head)
{
	if (tail && bpf_xdp_adjust_tail(ctx, -(int)tail))
		return -1;
	return bpf_xdp_adjust_head(ctx, head);
}


/* parse_input_v4 parses an IPv4 frame's IP and UDP headers (the cursor past
 * Ethernet) into *in and *udp: -1, or the reason to pass. Both engines call
 * it and parse_input_v6 on separate branches, so that each path after them is
 * inlined once per family, specialised for it. */
static __always_inline int parse_input_v4(struct cursor *c, struct input *in, struct udphdr **udp)
{
	struct iphdr *ip;
	int r;
	if ((r = parse_ipv4(c, &ip)) >= 0 || (r = parse_udp(c, bpf_ntohs(ip->tot_len) - sizeof(*ip), udp)) >= 0)
		return r;
	in->family = AF_INET;
	in->tos = ip->tos;
	in->ttl = ip->ttl;
	in->l3_len = sizeof(*ip);
	in->l3_total = ntohs_bounded(ip->tot_len);
	addr_set_v4(&in->saddr, ip->saddr);
	addr_set_v4(&in->daddr, ip->daddr);
	return -1;
}

/* parse_input_v6 is parse_input_v4 for an IPv6 frame. */
static __always_inline int parse_input_v6(struct cursor *c, struct input *in, struct udphdr **udp)
{
	struct ipv6hdr *ip6;
	int r;
	if ((r = parse_ipv6(c, &ip6)) >= 0 || (r = parse_udp(c, bpf_ntohs(ip6->payload_len), udp)) >= 0)
		return r;
	in->family = AF_INET6;
	in->tos = (ip6->priority << 4) | (ip6->flow_lbl[0] >> 4);
	in->ttl = ip6->hop_limit;
	in->l3_len = sizeof(*ip6);
	in->l3_total = sizeof(*ip6) + ntohs_bounded(ip6->payload_len);
	__builtin_memcpy(in->saddr.b, &ip6->saddr, 16);
	__builtin_memcpy(in->daddr.b, &ip6->daddr, 16);
	return -1;
}

/* pseudo_words adds an address pair of the input or output to a checksum word
 * array: 2 words for IPv4, 8 for IPv6. Returns the words written. */
static __always_inline int pseudo_words(__be32 *w, const struct addr *s, const struct addr *d, int v4)
{
	if (v4) {
		w[0] = addr_v4(s);
		w[1] = addr_v4(d);
		return 2;
	}
	__builtin_memcpy(w, s->b, 16);
	__builtin_memcpy(w + 4, d->b, 16);
	return 8;
}

/* pseudo_sum is the unfolded sum of a UDP pseudo header: addresses, protocol
 * and the UDP length as on the wire (RFC 768; RFC 8200 8.1). */
static __always_inline __u64 pseudo_sum(const struct addr *s, const struct addr *d, int v4, __be16 udp_len)
{
	__be32 w[9] = {};
	w[0] = bpf_htonl(IPPROTO_UDP << 16);
	__builtin_memcpy((__u8 *)&w[0] + 2, &udp_len, 2);
	if (v4) {
		w[1] = addr_v4(s);
		w[2] = addr_v4(d);
		return sum_words(w, 3, 0);
	}
	__builtin_memcpy(&w[1], s->b, 16);
	__builtin_memcpy(&w[5], d->b, 16);
	return sum_words(w, 9, 0);
}

/* is_partial tells a CHECKSUM_PARTIAL datagram (a veth or container sender with
 * tx checksum offload on): its checksum field holds only the folded pseudo-header
 * sum, and an incremental update of it would be wrong. */
static __always_inline int is_partial(const struct input *in, const struct udphdr *udp)
{
	__u16 ps = (__u16)~csum_fold(pseudo_sum(&in->saddr, &in->daddr, in->family == AF_INET, udp->len));
	return udp->check != 0 && udp->check == ps;
}

/* UDP_PROTO_WORD is the pseudo header's zero and protocol bytes as a word. */
#define UDP_PROTO_WORD bpf_htonl(IPPROTO_UDP << 16)

/* ingress_over_mtu tells a packet longer than its ingress device's MTU: it did
 * not come off that device's wire as one frame. Generic XDP sees a UDP GSO
 * super-packet (a pod sending with UDP_SEGMENT over a veth) as one datagram,
 * which relayed whole would be one ChannelData message the client drops; the
 * stack segments it. Only packets longer than any default MTU look it up. */
static __always_inline int ingress_over_mtu(const struct input *in)
{
	if (in->l3_total <= MTU_CHECK_ABOVE)
		return 0;
	__u32 ifindex = in->ifindex;
	const struct dev_cap *d = bpf_map_lookup_elem(&dev_caps, &ifindex);
	return !d || in->l3_total > d->mtu;
}

/* The shared halves of the two engines (this file's XDP program and
 * relay_tc.c's TC program): the binding lookups, the checks before a rewrite
 * and the checksum word arrays. Each returns -1 to go on, else the reason to
 * pass the packet with; each engine turns that into its own verdict. All are
 * inlined: their out-structs live in the caller's frame and fold away. */

/* c2p_mapped: IPv4-mapped addresses are not on an IPv6 wire (RFC 4291
 * 2.5.5.2): such a source would find an IPv4 client's binding (the maps store
 * IPv4 that way), such a destination an IPv4 listener's; the kernel gives
 * neither to them. */
static __always_inline int c2p_mapped(const struct input *in)
{
	if (in->family == AF_INET6) {
		if (addr_is_v4(&in->saddr))
			return REASON_NO_CHANNEL;
		if (addr_is_v4(&in->daddr))
			return REASON_NOT_LISTENER_ADDR;
	}
	return -1;
}

/* allocated tells whether the client of the flow key has an allocation on
 * its listener socket: this daemon's, or another's of the node. */
static __always_inline int allocated(const struct flow *f)
{
	return bpf_map_lookup_elem(&alloc_flows, f) || bpf_map_lookup_elem(&node_flows, f);
}

/* admitted charges a request of a client without an allocation to its source
 * address (model rule 13), a GCRA as rate.h's: it goes while what the address
 * owes is at most admit_burst_ns ahead of now, and then owes admit_cost_ns
 * more. The update is not atomic: CPUs racing on one address may each admit
 * a request the other paid for, a few at most. */
static __always_inline int admitted(const struct shield *sh, const struct addr *src)
{
	__u64 now = bpf_ktime_get_ns();
	__u64 *tat = bpf_map_lookup_elem(&admit_tats, src);
	if (!tat) {
		__u64 v = now + sh->admit_cost_ns;
		bpf_map_update_elem(&admit_tats, src, &v, BPF_ANY);
		return 1;
	}
	__u64 t = *tat > now ? *tat : now;
	if (t - now > sh->admit_burst_ns)
		return 0;
	*tat = t + sh->admit_cost_ns;
	return 1;
}

/* listener_shield is the listener's shield (model rule 12), for a packet to a listener
 * port that is not relayed for reason r: r to pass it, or the REASON_* of a
 * drop when the kernel would deliver it to a listener socket (listener_dsts)
 * and pion/turn would discard it unanswered. Its tests are pion/turn's own,
 * in its order (internal/server HandleRequest): ChannelData is what
 * proto.IsChannelData takes (first two bits 01, the length within the
 * payload), which pion/turn hands to the allocation of (client, listener
 * socket) or discards; anything else must decode as STUN
 * (stun.Message.Decode: 20 bytes, the magic cookie, the length within the
 * payload; its attributes are left to pion/turn) of a class and method with a
 * handler (Binding, Allocate, Refresh, CreatePermission and ChannelBind
 * requests, Send indications; the method read as stun reads it, without the
 * type's top two bits); and a request of a client without an allocation must
 * be admitted at its source address's rate (admitted). Only on the path of
 * packets not bound: a bound
 * packet never gets here. Any reason may come: the shield drops only what
 * it finds for a listener socket, where those reasons all mean "not bound". */
static __noinline int listener_shield(const struct cursor *c, const struct input *in, const struct udphdr *udp, int r)
{
	__u32 zero = 0;
	const struct shield *sh = bpf_map_lookup_elem(&shields, &zero);
	if (!sh || !(sh->flags & SHIELD_JUNK) || c2p_mapped(in) >= 0)
		return r;
	struct shield_keys *k = bpf_map_lookup_elem(&shield_scratch, &zero);
	if (!k)
		return r;
	__builtin_memset(&k->dst, 0, sizeof(k->dst));
	k->dst.addr = in->daddr;
	k->dst.port = udp->dest;
	const struct dst_val *dst = bpf_map_lookup_elem(&listener_dsts, &k->dst);
	if (!dst)
		return r; /* not for a listener socket: the kernel's to decide */
	struct flow *f = &k->flow;
	f->group = dst->group;
	__builtin_memcpy(f->client_addr, in->saddr.b, sizeof(f->client_addr));
	f->client_port = udp->source;
	f->_pad = 0;
	const __u8 *h = (const void *)(udp + 1);
	__u16 len = bpf_ntohs(udp->len) - sizeof(*udp);
	if (len >= CHANNEL_DATA_HDR_LEN && (void *)(h + CHANNEL_DATA_HDR_LEN) <= c->end &&
	    (h[0] & CHANNEL_DATA_MASK) == CHANNEL_DATA_BITS &&
	    (((__u16)h[2] << 8) | h[3]) <= len - CHANNEL_DATA_HDR_LEN) {
		if (!(sh->flags & SHIELD_ALLOCS) || allocated(f))
			return r;
		return REASON_NO_ALLOCATION;
	}
	if (len < STUN_HDR_LEN || (void *)(h + STUN_HDR_LEN) > c->end)
		return REASON_NOT_TURN;
	__u32 cookie = ((__u32)h[4] << 24) | ((__u32)h[5] << 16) | ((__u32)h[6] << 8) | h[7];
	if (cookie != STUN_MAGIC_COOKIE || (((__u16)h[2] << 8) | h[3]) > len - STUN_HDR_LEN)
		return REASON_NOT_TURN;
	__u16 t = ((__u16)h[0] << 8) | h[1];
	__u16 class = ((t >> 4) & 1) | ((t >> 7) & 2);
	__u16 method = (t & 0xf) | ((t >> 1) & 0x70) | ((t >> 2) & 0xf80);
	if (class == STUN_CLASS_REQUEST && (method == STUN_BINDING || method == STUN_ALLOCATE || method == STUN_REFRESH ||
					    method == STUN_CREATE_PERMISSION || method == STUN_CHANNEL_BIND)) {
		if (sh->admit_cost_ns && !allocated(f) && !admitted(sh, &in->saddr))
			return REASON_ADMISSION;
		return r;
	}
	if (class == STUN_CLASS_INDICATION && method == STUN_SEND)
		return r;
	return REASON_STUN_UNHANDLED;
}

/* shield_drops tells the shield's reasons, which drop. */
static __always_inline int shield_drops(int r)
{
	return r >= REASON_NO_ALLOCATION && r <= REASON_ADMISSION;
}

/* c2p_found is a client->peer binding as found. alloc_id is set on a miss
 * only: on a hit it stays in the flow entry's second cache line, read only
 * when a rate limit needs it (c2p_alloc_id). */
struct c2p_found {
	struct binding_state *st;
	struct c2p_flow *f;
	__u32 alloc_id;
	__be32 peer_addr, relay_addr;
	__be16 peer_port, relay_port;
	int hit;
};

/* c2p_lookup finds the binding of a ChannelData message: from this CPU's flow
 * cache while the entry stands for it, else through the destination and
 * binding maps (and cached). The flow caches are shared by both engines:
 * their entries describe themselves. gen is flow_generation's: 0 leaves the
 * cache alone. */
static __always_inline int c2p_lookup(const struct input *in, const struct udphdr *udp, __be16 channel, __u32 gen,
				      struct c2p_found *b)
{
	__u32 binding_id;
	b->st = 0;
	b->f = 0;
	b->alloc_id = 0;
	b->hit = 0;
	if (gen) {
		__u64 h = addr_hash(addr_hash(cfg.flow_seed, &in->saddr), &in->daddr);
		__u32 idx = flow_index(flow_mix(h, ((__u64)udp->source << 32) | ((__u64)udp->dest << 16) | channel));
		b->f = bpf_map_lookup_elem(&c2p_flows, &idx);
	}
	struct c2p_flow *f = b->f;
	if (f && f->fib_gen == gen && f->client_port == udp->source && f->dst_port == udp->dest && f->channel == channel &&
	    addr_eq(&f->client_addr, &in->saddr) && addr_eq(&f->dst_addr, &in->daddr)) {
		binding_id = f->binding_id;
		b->st = bpf_map_lookup_elem(&binding_states, &binding_id);
		b->hit = b->st && b->st->gen == f->gen;
	}
	if (b->hit) {
		b->peer_addr = f->peer_addr;
		b->relay_addr = f->relay_addr;
		b->peer_port = f->peer_port;
		b->relay_port = f->relay_port;
		return -1;
	}
	/* Only what the kernel would deliver to a listener socket is a
	 * listener's: transit traffic (the node forwards) and other listeners'
	 * addresses are not, and must neither be relayed nor teach a reply
	 * source. */
	struct dst_key dk = {};
	dk.addr = in->daddr;
	dk.port = udp->dest;
	struct dst_val *dst = bpf_map_lookup_elem(&listener_dsts, &dk);
	if (!dst)
		return REASON_NOT_LISTENER_ADDR;
	struct c2p_key key = {};
	key.client_addr = in->saddr;
	key.client_port = udp->source;
	key.channel = channel;
	key.listener_id = dst->listener_id;
	struct c2p_val *v = bpf_map_lookup_elem(&c2p_bindings, &key);
	if (!v || !words_eq(&v->key, &key, sizeof(key) / 4))
		return REASON_NO_CHANNEL;
	barrier();
	binding_id = v->binding_id;
	b->alloc_id = v->alloc_id;
	b->peer_addr = addr_v4(&v->peer_addr);
	b->relay_addr = addr_v4(&v->relay_addr);
	b->peer_port = v->peer_port;
	b->relay_port = v->relay_port;
	__u32 bgen = v->gen;
	barrier();
	/* Still this binding's element (see c2p_val): the loads above are in
	 * program order on x86 (cfg.tso); elsewhere this narrows the window to
	 * the reads themselves. */
	if (!words_eq(&v->key, &key, sizeof(key) / 4))
		return REASON_NO_CHANNEL;
	b->st = bpf_map_lookup_elem(&binding_states, &binding_id);
	/* Cached only as installed: a slot of another generation is being
	 * taken back. */
	if (f && b->st && b->st->gen == bgen) {
		f->client_addr = in->saddr;
		f->dst_addr = in->daddr;
		f->client_port = udp->source;
		f->dst_port = udp->dest;
		f->channel = channel;
		f->gen = bgen;
		f->binding_id = binding_id;
		f->alloc_id = b->alloc_id;
		f->peer_addr = b->peer_addr;
		f->relay_addr = b->relay_addr;
		f->peer_port = b->peer_port;
		f->relay_port = b->relay_port;
		f->fib_gen = gen;
	}
	return -1;
}

/* c2p_alloc_id is the found binding's allocation, for its rate limit. */
static __always_inline __u32 c2p_alloc_id(const struct c2p_found *b)
{
	return b->hit ? b->f->alloc_id : b->alloc_id;
}

/* c2p_admit is what the kernel would drop before pion saw a client's packet,
 * and what would expire. */
static __always_inline int c2p_admit(const struct cursor *c, const struct input *in, const struct udphdr *udp)
{
	if (in->family == AF_INET) {
		struct iphdr *hdr = (void *)udp - sizeof(struct iphdr);
		if ((void *)(hdr + 1) > c->end)
			return REASON_MALFORMED_IP;
		if (!ipv4_csum_ok(hdr))
			return REASON_BAD_IP_CHECKSUM;
	} else if (udp->check == 0) {
		return REASON_NO_CHECKSUM;
	}
	if (in->ttl < MIN_RELAY_TTL)
		return REASON_TTL_EXPIRED;
	return -1;
}

/* learn_listener_addr learns the address and port the client's packets
 * arrive at on the wire: replies must come from them (behind a DNAT a VIP
 * that userspace never sees, and a port a NodePort translated). The port is
 * written first: a reader that finds the address finds its port (the
 * program's stores keep their order on TSO machines; elsewhere a packet may
 * see a half-changed pair while a client moves between destinations, which
 * its next packet corrects). The reply direction's next hop was resolved
 * from the old ones. */
static __always_inline void learn_listener_addr(struct binding_state *st, const struct addr *daddr, __be16 dport)
{
	if (!st || (addr_eq(&st->listener_addr, daddr) && st->listener_port == dport))
		return;
	st->listener_port = dport;
	barrier();
	st->listener_addr = *daddr;
	bpf_spin_lock(&st->lock);
	st->p2c_hop.seq++;
	barrier();
	st->p2c_hop.gen = 0;
	barrier();
	st->p2c_hop.seq++;
	bpf_spin_unlock(&st->lock);
}

/* c2p_pad_sum sums the padding bytes that leave the checksum: each sits at an
 * even or odd offset of the datagram (the data starts at an even one in both
 * old and new). -1 when the padding is not in the packet. */
static __always_inline int c2p_pad_sum(const struct cursor *c, __u16 data_len, __u16 pad, __u32 *sum)
{
	__u32 pad_sum = 0;
	__u8 *p = c->pos;
	/* The mask bounds the offset for the verifier, kept: clang knows
	 * data_len's bound and would drop it, and verifiers before 6.18 lose
	 * that bound on the way here. With it unbounded (up to 64 KiB, past
	 * MAX_PACKET_OFF) they do not extend a bounds check to the pointer. */
	__u32 off = data_len;
	asm volatile("" : "+r"(off));
	p += off & CHANNEL_DATA_MAX_LEN;
#pragma unroll
	for (int i = 0; i < CHANNEL_DATA_MAX_PAD; i++) {
		if (i < pad) {
			if ((void *)(p + i + 1) > c->end)
				return -1;
			__u32 v = p[i];
			pad_sum += ((data_len + i) & 1) ? v << 8 : v;
		}
	}
	*sum = pad_sum;
	return 0;
}

/* c2p_to_words is the relayed datagram's checksum words (4): its
 * pseudo-header addresses, ports and lengths (pseudo header and header). */
static __always_inline void c2p_to_words(__be32 *to, const struct rewrite *rw, __u16 new_udp_len)
{
	to[0] = addr_v4(&rw->saddr);
	to[1] = addr_v4(&rw->daddr);
	__builtin_memcpy(&to[2], &rw->sport, 2);
	__builtin_memcpy((__u8 *)&to[2] + 2, &rw->dport, 2);
	__builtin_memcpy(&to[3], &new_udp_len, 2);
	__builtin_memcpy((__u8 *)&to[3] + 2, &new_udp_len, 2);
}

/* c2p_from_words is the input's checksum words that leave it: pseudo-header
 * addresses, ports, lengths and the ChannelData header. The protocol number
 * is in both pseudo headers and cancels. Returns the words written. */
static __always_inline int c2p_from_words(__be32 *from, const struct input *in, const struct udphdr *udp)
{
	int n = pseudo_words(from, &in->saddr, &in->daddr, in->family == AF_INET);
	__builtin_memcpy(&from[n], &udp->source, 4);
	__builtin_memcpy(&from[n + 1], &udp->len, 2);
	__builtin_memcpy((__u8 *)&from[n + 1] + 2, &udp->len, 2);
	__builtin_memcpy(&from[n + 2], (__u8 *)(udp + 1), 4);
	return n + 3;
}

/* c2p_ip4 is the relayed packet's IPv4 header: the client's (ID, DF, TOS
 * kept) from IPv4, a fresh one from IPv6. -1 or the reason to pass. */
static __always_inline int c2p_ip4(const struct cursor *c, const struct input *in, const struct udphdr *udp,
				   const struct rewrite *rw, struct iphdr *ip4)
{
	if (in->family == AF_INET) {
		struct iphdr *old = (void *)udp - sizeof(struct iphdr);
		if ((void *)(old + 1) > c->end)
			return REASON_MALFORMED_IP;
		*ip4 = *old;
	} else {
		ip4->version = 4;
		ip4->ihl = 5;
		ip4->tos = in->tos;
		ip4->frag_off = bpf_htons(IP_DF);
		ip4->protocol = IPPROTO_UDP;
	}
	ip4->tot_len = bpf_htons(rw->len);
	ip4->ttl = rw->ttl;
	ip4->saddr = addr_v4(&rw->saddr);
	ip4->daddr = addr_v4(&rw->daddr);
	return -1;
}

/* p2c_lookup finds the binding of a peer's datagram: the flow entry's own
 * (this CPU's, stable while the program runs) while it stands for it, or a
 * copy (*v) of the hash map element's taken between checks (and cached;
 * gen is flow_generation's: 0 leaves the cache alone).
 * -1 with *bind and *st set, or the reason to pass. */
static __always_inline int p2c_lookup(const struct input *in, const struct udphdr *udp, __u32 gen,
				      struct p2c_binding *v, const struct p2c_binding **bind,
				      struct binding_state **st)
{
	__be32 peer_addr = addr_v4(&in->saddr), relay_addr = addr_v4(&in->daddr);
	struct p2c_flow *f = 0;
	int hit = 0;
	*st = 0;
	*bind = v;
	if (gen) {
		__u64 h = flow_mix(cfg.flow_seed, ((__u64)peer_addr << 32) | relay_addr);
		__u32 idx = flow_index(flow_mix(h, ((__u64)udp->source << 16) | udp->dest));
		f = bpf_map_lookup_elem(&p2c_flows, &idx);
	}
	if (f && f->fib_gen == gen && f->peer_addr == peer_addr && f->relay_addr == relay_addr &&
	    f->peer_port == udp->source && f->relay_port == udp->dest) {
		__u32 id = f->bind.binding_id;
		*st = bpf_map_lookup_elem(&binding_states, &id);
		hit = *st && (*st)->gen == f->bind.gen;
	}
	if (hit) {
		*bind = &f->bind;
		return -1;
	}
	struct p2c_key key = {};
	key.peer_addr = in->saddr;
	key.relay_addr = in->daddr;
	key.peer_port = udp->source;
	key.relay_port = udp->dest;
	struct p2c_val *b = bpf_map_lookup_elem(&p2c_bindings, &key);
	if (!b || !words_eq(&b->key, &key, sizeof(key) / 4))
		return REASON_NO_PEER_BINDING;
	barrier();
	*v = b->bind;
	barrier();
	/* Still this binding's element (see c2p_val and c2p_lookup). */
	if (!words_eq(&b->key, &key, sizeof(key) / 4))
		return REASON_NO_PEER_BINDING;
	*st = bpf_map_lookup_elem(&binding_states, &v->binding_id);
	if (f && *st && (*st)->gen == v->gen) {
		f->peer_addr = peer_addr;
		f->relay_addr = relay_addr;
		f->peer_port = udp->source;
		f->relay_port = udp->dest;
		f->bind = *v;
		f->fib_gen = gen;
	}
	return -1;
}

/* p2c_admit is what the kernel would drop before pion's relay socket saw a
 * peer's datagram, what would expire, and what does not fit a ChannelData
 * message; *ip is its IPv4 header, *data_len its payload length. */
static __always_inline int p2c_admit(const struct cursor *c, const struct input *in, const struct udphdr *udp,
				     const struct binding_state *st, const int to_v4, struct iphdr **ip,
				     __u16 *data_len)
{
	if (!st || (to_v4 ? addr_v4(&st->listener_addr) == 0 : addr_is_zero(&st->listener_addr)) ||
	    st->listener_port == 0)
		return REASON_CLIENT_ADDR_UNKNOWN;
	struct iphdr *old = (void *)udp - sizeof(struct iphdr);
	if ((void *)(old + 1) > c->end)
		return REASON_MALFORMED_IP;
	*ip = old;
	if (!ipv4_csum_ok(old))
		return REASON_BAD_IP_CHECKSUM;
	if (!to_v4 && udp->check == 0)
		return REASON_NO_CHECKSUM;
	*data_len = bpf_ntohs(udp->len) - sizeof(*udp);
	if (*data_len > CHANNEL_DATA_MAX_LEN)
		return REASON_OVERSIZE;
	if (in->ttl < MIN_RELAY_TTL)
		return REASON_TTL_EXPIRED;
	return -1;
}

/* p2c_rewrite is the rewrite's addresses, ports and length toward the client
 * (next hop not yet known). */
static __always_inline void p2c_rewrite(struct rewrite *rw, const struct input *in, const struct binding_state *st,
					const struct p2c_binding *bind, __u16 data_len, const int to_v4)
{
	rw->family = to_v4 ? AF_INET : AF_INET6;
	rw->tos = in->tos;
	rw->ttl = in->ttl - 1;
	rw->saddr = st->listener_addr;
	rw->daddr = bind->client_addr;
	rw->sport = st->listener_port;
	rw->dport = bind->client_port;
	rw->len = (to_v4 ? sizeof(struct iphdr) : sizeof(struct ipv6hdr)) + sizeof(struct udphdr) +
		  CHANNEL_DATA_HDR_LEN + data_len;
}

/* c2p_rewrite is the rewrite's addresses, ports and length toward the peer
 * (relays and peers are IPv4). */
static __always_inline void c2p_rewrite(struct rewrite *rw, const struct input *in, const struct c2p_found *b,
					__u16 data_len)
{
	rw->family = AF_INET;
	rw->tos = in->tos;
	rw->ttl = in->ttl - 1;
	addr_set_v4(&rw->saddr, b->relay_addr);
	addr_set_v4(&rw->daddr, b->peer_addr);
	rw->sport = b->relay_port;
	rw->dport = b->peer_port;
	rw->len = sizeof(struct iphdr) + sizeof(struct udphdr) + data_len;
}

/* p2c_to_words is the ChannelData datagram's checksum words: pseudo-header
 * addresses, ports, lengths and the ChannelData header. Returns the words
 * written (5 or 11). */
static __always_inline int p2c_to_words(__be32 *to, const struct rewrite *rw, __u16 new_udp_len, __be16 channel,
					__u16 data_len, const int to_v4)
{
	__be16 cd_len = bpf_htons(data_len);
	int n = pseudo_words(to, &rw->saddr, &rw->daddr, to_v4);
	__builtin_memcpy(&to[n], &rw->sport, 2);
	__builtin_memcpy((__u8 *)&to[n] + 2, &rw->dport, 2);
	__builtin_memcpy(&to[n + 1], &new_udp_len, 2);
	__builtin_memcpy((__u8 *)&to[n + 1] + 2, &new_udp_len, 2);
	__builtin_memcpy(&to[n + 2], &channel, 2);
	__builtin_memcpy((__u8 *)&to[n + 2] + 2, &cd_len, 2);
	return n + 3;
}

/* p2c_from_words is the peer's datagram's checksum words that leave it (4). */
static __always_inline void p2c_from_words(__be32 *from, const struct input *in, const struct udphdr *udp)
{
	from[0] = addr_v4(&in->saddr);
	from[1] = addr_v4(&in->daddr);
	__builtin_memcpy(&from[2], &udp->source, 4);
	__builtin_memcpy(&from[3], &udp->len, 2);
	__builtin_memcpy((__u8 *)&from[3] + 2, &udp->len, 2);
}

static __always_inline int client_to_peer(struct xdp_md *ctx, struct cursor *c, struct input *in,
					  struct udphdr *udp, __u32 *reason)
{
	if (ingress_over_mtu(in)) {
		*reason = REASON_INGRESS_OVER_MTU;
		return XDP_PASS;
	}
	__u16 payload_len = bpf_ntohs(udp->len) - sizeof(*udp);
	__be16 channel;
	__u16 data_len, pad;
	/* What is not bound meets the shield. */
	__u32 gen = fib_generation();
	struct c2p_found b;
	int r = parse_channel_data(c, payload_len, &channel, &data_len, &pad);
	if (r < 0 && (r = c2p_mapped(in)) < 0)
		r = c2p_lookup(in, udp, channel, flow_generation(gen), &b);
	if (r >= 0) {
		*reason = listener_shield(c, in, udp, r);
		return shield_drops(*reason) ? XDP_DROP : XDP_PASS;
	}
	if ((r = c2p_admit(c, in, udp)) >= 0) {
		*reason = r;
		return XDP_PASS;
	}
	struct binding_state *st = b.st;
	struct rewrite rw = {};
	c2p_rewrite(&rw, in, &b, data_len);
	r = next_hop(ctx, in, &rw, st, 1, gen);
	/* Learned whether or not it is relayed (it is bound), unless the stack
	 * would drop it: a packet forged from another device teaches nothing. */
	if (r != REASON_RP_FILTER && r != REASON_RP_UNCHECKED)
		learn_listener_addr(st, &in->daddr, udp->dest);
	if (r >= 0) {
		*reason = r;
		return XDP_PASS;
	}
	const struct rate_limit *rl = limit_on();
	if (rl && (r = over_limit(rl, c2p_alloc_id(&b), data_len, reason)) >= 0)
		return r;

	__u16 new_udp_len = bpf_htons(sizeof(struct udphdr) + data_len);
	__be32 from[12] = {}, to[5] = {};
	c2p_to_words(to, &rw, new_udp_len);
	if (is_partial(in, udp)) {
		/* Nobody summed the data yet: sum the output from scratch. */
		int ds = data_len <= SUM_INLINE_MAX ? sum_short(c->pos, c->end, data_len)
						    : sum_data(ctx, (__u32)(c->pos - (void *)(long)ctx->data), data_len);
		if (ds < 0) {
			*reason = REASON_MALFORMED_CHANNEL_DATA;
			return XDP_PASS;
		}
		rw.udp_csum = csum_finish(sum_words(to, 4, UDP_PROTO_WORD) + (__u32)ds);
	} else {
		__u32 pad_sum;
		if (c2p_pad_sum(c, data_len, pad, &pad_sum)) {
			*reason = REASON_MALFORMED_CHANNEL_DATA;
			return XDP_PASS;
		}
		int n = c2p_from_words(from, in, udp);
		rw.udp_csum = udp_csum_update(udp->check, from, n, to, 4, pad_sum);
	}

	struct iphdr ip4 = {};
	if ((r = c2p_ip4(c, in, udp, &rw, &ip4)) >= 0) {
		*reason = r;
		return XDP_PASS;
	}

	/* Tail: Ethernet trailer and padding. Head: the ChannelData header and,
	 * from IPv6, the 20 bytes IPv4's header is shorter. */
	__u32 tail = (__u32)((void *)c->end - (void *)udp) + in->l3_len - in->l3_total + pad;
	int head = CHANNEL_DATA_HDR_LEN + (int)in->l3_len - (int)sizeof(struct iphdr);
	if (resize(ctx, tail, head)) {
		*reason = REASON_ADJUST_FAILED;
		return XDP_PASS;
	}
	int action = emit(ctx, in->ifindex, &ip4, &rw, channel, data_len, 1, reason);
	if (action != XDP_DROP && st)
		count_binding(st, 1, data_len);
	return action;
}

/* peer_to_client's second half, once per client family (to_v4 a constant:
 * each copy holds only its family's rewrite). */
static __always_inline int p2c_out(struct xdp_md *ctx, struct cursor *c, struct input *in, struct udphdr *udp,
				   __u32 *reason, struct binding_state *st, const struct p2c_binding *bind, __u32 gen,
				   const int to_v4)
{
	struct iphdr *old;
	__u16 data_len;
	int r = p2c_admit(c, in, udp, st, to_v4, &old, &data_len);
	if (r >= 0) {
		*reason = r;
		return XDP_PASS;
	}

	struct rewrite rw = {};
	p2c_rewrite(&rw, in, st, bind, data_len, to_v4);
	__u32 out_l3 = to_v4 ? sizeof(struct iphdr) : sizeof(struct ipv6hdr);
	r = next_hop(ctx, in, &rw, st, 0, gen);
	if (r >= 0) {
		*reason = r;
		return XDP_PASS;
	}
	const struct rate_limit *rl = limit_on();
	if (rl && (r = over_limit(rl, bind->alloc_id, data_len, reason)) >= 0)
		return r;

	__be16 channel = bind->channel;
	__u16 new_udp_len = bpf_htons(sizeof(struct udphdr) + CHANNEL_DATA_HDR_LEN + data_len);
	__be32 from[4] = {}, to[12] = {};
	int n = p2c_to_words(to, &rw, new_udp_len, channel, data_len, to_v4);
	if (is_partial(in, udp)) {
		int ds = data_len <= SUM_INLINE_MAX ? sum_short(c->pos, c->end, data_len)
						    : sum_data(ctx, (__u32)(c->pos - (void *)(long)ctx->data), data_len);
		if (ds < 0) {
			*reason = REASON_MALFORMED_UDP;
			return XDP_PASS;
		}
		rw.udp_csum = csum_finish(sum_words(to, n, UDP_PROTO_WORD) + (__u32)ds);
	} else {
		p2c_from_words(from, in, udp);
		rw.udp_csum = udp_csum_update(udp->check, from, 4, to, n, 0);
	}

	struct iphdr ip4 = *old;
	ip4.tot_len = bpf_htons(rw.len);
	ip4.ttl = rw.ttl;
	ip4.saddr = addr_v4(&rw.saddr);
	ip4.daddr = addr_v4(&rw.daddr);

	__u32 tail = (__u32)((void *)c->end - (void *)old) - in->l3_total;
	int head = -(int)CHANNEL_DATA_HDR_LEN - ((int)out_l3 - (int)sizeof(struct iphdr));
	if (resize(ctx, tail, head)) {
		*reason = REASON_ADJUST_FAILED;
		return XDP_PASS;
	}
	int action = emit(ctx, in->ifindex, &ip4, &rw, channel, data_len, 0, reason);
	if (action != XDP_DROP)
		count_binding(st, 0, data_len);
	return action;
}

static __always_inline int peer_to_client(struct xdp_md *ctx, struct cursor *c, struct input *in,
					  struct udphdr *udp, __u32 *reason)
{
	if (ingress_over_mtu(in)) {
		*reason = REASON_INGRESS_OVER_MTU;
		return XDP_PASS;
	}
	if (in->family != AF_INET) {
		/* Relays are IPv4: no binding can match an IPv6 peer. */
		*reason = REASON_NO_PEER_BINDING;
		return XDP_PASS;
	}
	__u32 gen = fib_generation();
	struct binding_state *st;
	struct p2c_binding v;
	const struct p2c_binding *bind;
	int r = p2c_lookup(in, udp, flow_generation(gen), &v, &bind, &st);
	if (r >= 0) {
		*reason = r;
		return XDP_PASS;
	}
	if (addr_is_v4(&bind->client_addr))
		return p2c_out(ctx, c, in, udp, reason, st, bind, gen, 1);
	return p2c_out(ctx, c, in, udp, reason, st, bind, gen, 0);
}

static __always_inline int relay(struct xdp_md *ctx, __u32 ingress_ifindex, __u32 *reason)
{
	struct cursor c = {
		.pos = (void *)(long)ctx->data,
		.end = (void *)(long)ctx->data_end,
	};
	struct ethhdr *eth;
	struct udphdr *udp;
	struct input in = {};
	__u16 proto;
	int r;

	in.ifindex = ingress_ifindex;
	if ((r = parse_eth(&c, &eth, &proto)) >= 0) {
		*reason = r;
		return XDP_PASS;
	}
	if (proto == ETH_P_IP) {
		if ((r = parse_input_v4(&c, &in, &udp)) >= 0) {
			*reason = r;
			return XDP_PASS;
		}
		/* The paths are inlined once per family, each specialised for it:
		 * a relayed packet runs (and fetches) only its family's code. */
		switch (port_kind(udp->dest)) {
		case PORT_CLIENT:
			return client_to_peer(ctx, &c, &in, udp, reason);
		case PORT_PEER:
			return peer_to_client(ctx, &c, &in, udp, reason);
		default:
			break;
		}
	} else {
		if ((r = parse_input_v6(&c, &in, &udp)) >= 0) {
			*reason = r;
			return XDP_PASS;
		}
		switch (port_kind(udp->dest)) {
		case PORT_CLIENT:
			return client_to_peer(ctx, &c, &in, udp, reason);
		case PORT_PEER:
			return peer_to_client(ctx, &c, &in, udp, reason);
		default:
			break;
		}
	}
	*reason = REASON_NOT_OURS;
	return XDP_PASS;
}

static __always_inline int xdp_relay_counted(struct xdp_md *ctx, __u32 ingress_ifindex)
{
	__u32 reason = REASON_NOT_OURS;
	int action = relay(ctx, ingress_ifindex, &reason);
	__u64 *n = bpf_map_lookup_elem(&verdicts, &reason);
	if (n)
		(*n)++;
	return action;
}

/* relay_tc.c builds the TC engine on this file's helpers, without this entry;
 * relay_ingress.c the test build below. */
#if !defined(RELAY_TC_ENGINE) && !defined(RELAY_INGRESS_IN_FRAME)
SEC("xdp")
int xdp_turn_relay(struct xdp_md *ctx)
{
	return xdp_relay_counted(ctx, ctx->ingress_ifindex);
}
#endif

#ifdef RELAY_INGRESS_IN_FRAME
/* A build for the tests only (relay_ingress.c), for kernels whose
 * BPF_PROG_RUN takes no XDP context (before 5.15: 5.10), so that no run can
 * say which interface a frame arrived on (ingress_ifindex is the loopback's):
 * the frame comes after the ingress ifindex (4 bytes, host order), which the
 * program takes off before it runs the relay as above. */
SEC("xdp")
int xdp_turn_relay(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	if (data + sizeof(__u32) > (void *)(long)ctx->data_end)
		return XDP_ABORTED;
	__u32 ingress_ifindex = *(__u32 *)data;
	if (bpf_xdp_adjust_head(ctx, sizeof(__u32)))
		return XDP_ABORTED;
	return xdp_relay_counted(ctx, ingress_ifindex);
}
#endif
