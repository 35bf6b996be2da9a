//go:build ignore

// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/* XDP fast path of stunnerd-xdp: relays TURN ChannelData over UDP/IPv4 for the
 * channel bindings pion/turn mirrors into the maps.
 *
 *   client->peer: ChannelData to a listener port from a bound (client, channel):
 *                 strip the 4-byte header and any padding, send relay -> peer.
 *   peer->client: UDP to a relay port from the exact bound peer address:port:
 *                 prepend the header, send listener (as on the wire) -> client.
 *
 * Anything else, and anything the program cannot forward itself, is XDP_PASSed
 * untouched so that the kernel hands it to pion/turn. The program never answers
 * a packet and never drops one. */
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/ip.h>
#include <linux/udp.h>
#include <bpf_helpers.h>
#include <bpf_endian.h>

#include "consts.h"
#include "parsing.h"
#include "csum.h"
#include "maps.h"

char __license[] SEC("license") = "Dual BSD/GPL";

/* Set by the loader through spec.Variables before the program is loaded. */
volatile const struct config cfg = {};

/* Force the types into BTF for bpf2go. */
const enum reason *_unused_reason __attribute__((unused));

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

/* Only a unicast destination can be the source of replies: a client packet
 * sent to 0.0.0.0, a broadcast or a multicast group teaches nothing. */
static __always_inline int is_unicast_v4(__be32 addr)
{
	__u32 a = bpf_ntohl(addr);
	return a != 0 && a != 0xffffffff && (a >> 28) != 0xe;
}

static __always_inline int is_listener_port(__be16 port)
{
#pragma unroll
	for (int i = 0; i < MAX_LISTENER_PORTS; i++) {
		if (i < cfg.listener_port_count && cfg.listener_ports[i] == port)
			return 1;
	}
	return 0;
}

static __always_inline int is_relay_port(__be16 port)
{
	__u16 p = bpf_ntohs(port);
	return cfg.min_relay_port != 0 && p >= cfg.min_relay_port && p <= cfg.max_relay_port;
}

/* A rewrite computed before the packet is touched: if forwarding fails we still
 * hold the original packet and can pass it. */
struct rewrite {
	unsigned char dmac[ETH_ALEN];
	unsigned char smac[ETH_ALEN];
	__be32 saddr;
	__be32 daddr;
	__be16 sport;
	__be16 dport;
	__u16 tot_len;  /* new IP total length, host order */
	__u16 udp_csum; /* new UDP checksum, network order as stored */
	__u32 egress_ifindex;
};

/* next_hop resolves the rewritten packet's next hop and fills in the MACs. It
 * returns -1 when it can be forwarded, else the PASS reason. */
static __always_inline int next_hop(struct xdp_md *ctx, struct iphdr *ip, struct rewrite *rw)
{
	struct bpf_fib_lookup fib = {};
	fib.family = AF_INET;
	fib.l4_protocol = IPPROTO_UDP;
	fib.sport = rw->sport;
	fib.dport = rw->dport;
	fib.tot_len = rw->tot_len;
	fib.tos = ip->tos;
	fib.ifindex = ctx->ingress_ifindex;
	fib.ipv4_src = rw->saddr;
	fib.ipv4_dst = rw->daddr;

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
		/* bpf_fib_lookup needs forwarding on for the ingress device. */
		return REASON_FIB_FWD_DISABLED;
	default:
		/* Local (hairpin), blackhole, unreachable, prohibited, LWT, errors. */
		return REASON_FIB_NOT_FORWARDED;
	}
	__builtin_memcpy(rw->dmac, fib.dmac, ETH_ALEN);
	__builtin_memcpy(rw->smac, fib.smac, ETH_ALEN);
	rw->egress_ifindex = fib.ifindex;
	if (fib.ifindex != ctx->ingress_ifindex) {
		__u32 ifindex = fib.ifindex;
		if (!bpf_map_lookup_elem(&tx_ports, &ifindex))
			return REASON_EGRESS_NOT_ATTACHED;
	}
	return -1;
}

/* emit writes the new Ethernet, IPv4 and UDP headers at the (moved) start of the
 * packet and returns the XDP action with its reason. */
static __always_inline int emit(struct xdp_md *ctx, struct iphdr *old_ip, struct rewrite *rw,
				__be16 channel, __u16 data_len, int c2p, __u32 *reason)
{
	struct iphdr ip = *old_ip;
	ip.tot_len = bpf_htons(rw->tot_len);
	ip.ttl = RELAY_TTL;
	ip.saddr = rw->saddr;
	ip.daddr = rw->daddr;
	ip.check = 0;
	ip.check = ipv4_csum(&ip);

	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data;
	struct iphdr *nip = (void *)(eth + 1);
	struct udphdr *udp = (void *)(nip + 1);
	__u8 *cd = (void *)(udp + 1);
	/* Cannot fail, sizes were checked before; the verifier needs to see it. */
	if ((void *)cd > data_end || (!c2p && (void *)(cd + CHANNEL_DATA_HDR_LEN) > data_end)) {
		*reason = REASON_ADJUST_FAILED;
		return XDP_ABORTED;
	}
	__builtin_memcpy(eth->h_dest, rw->dmac, ETH_ALEN);
	__builtin_memcpy(eth->h_source, rw->smac, ETH_ALEN);
	eth->h_proto = bpf_htons(ETH_P_IP);
	*nip = ip;
	udp->source = rw->sport;
	udp->dest = rw->dport;
	udp->len = bpf_htons(rw->tot_len - sizeof(struct iphdr));
	udp->check = rw->udp_csum;
	if (!c2p && (void *)(cd + CHANNEL_DATA_HDR_LEN) <= data_end) {
		*(__be16 *)cd = channel;
		*(__be16 *)(cd + 2) = bpf_htons(data_len);
	}

	if (rw->egress_ifindex == ctx->ingress_ifindex) {
		*reason = c2p ? REASON_RELAY_C2P_TX : REASON_RELAY_P2C_TX;
		return XDP_TX;
	}
	*reason = c2p ? REASON_RELAY_C2P_REDIRECT : REASON_RELAY_P2C_REDIRECT;
	return bpf_redirect_map(&tx_ports, rw->egress_ifindex, XDP_PASS);
}

static __always_inline void count_binding(__u32 id, int c2p, __u16 data_len)
{
	struct binding_stats *st = bpf_map_lookup_elem(&binding_counters, &id);
	if (!st)
		return;
	if (c2p) {
		st->c2p_packets++;
		st->c2p_bytes += data_len;
	} else {
		st->p2c_packets++;
		st->p2c_bytes += data_len;
	}
}

/* trim drops `len` bytes from the end of the frame (padding, Ethernet trailer). */
static __always_inline int trim(struct xdp_md *ctx, __u32 len)
{
	if (len == 0)
		return 0;
	return bpf_xdp_adjust_tail(ctx, -(int)(len & 0xfff));
}

static __always_inline int client_to_peer(struct xdp_md *ctx, struct cursor *c, struct iphdr *ip,
					  struct udphdr *udp, __u32 *reason)
{
	__u16 payload_len = bpf_ntohs(udp->len) - sizeof(*udp);
	__be16 channel;
	__u16 data_len, pad;
	int r = parse_channel_data(c, payload_len, &channel, &data_len, &pad);
	if (r >= 0) {
		*reason = r;
		return XDP_PASS;
	}

	struct c2p_key key = {};
	addr_set_v4(&key.client_addr, ip->saddr);
	key.client_port = udp->source;
	key.listener_port = udp->dest;
	key.channel = channel;
	struct c2p_val *b = bpf_map_lookup_elem(&c2p_bindings, &key);
	if (!b) {
		*reason = REASON_NO_CHANNEL;
		return XDP_PASS;
	}

	/* Learn the address the client's packets arrive at on the wire: replies must
	 * come from it (behind a DNAT it is a VIP that userspace never sees). */
	struct p2c_key back = {};
	back.peer_addr = b->peer_addr;
	back.relay_addr = b->relay_addr;
	back.peer_port = b->peer_port;
	back.relay_port = b->relay_port;
	struct p2c_val *bv = bpf_map_lookup_elem(&p2c_bindings, &back);
	if (bv && addr_v4(&bv->listener_addr) != ip->daddr && is_unicast_v4(ip->daddr))
		addr_set_v4(&bv->listener_addr, ip->daddr);

	struct rewrite rw = {};
	rw.saddr = addr_v4(&b->relay_addr);
	rw.daddr = addr_v4(&b->peer_addr);
	rw.sport = b->relay_port;
	rw.dport = b->peer_port;
	rw.tot_len = sizeof(struct iphdr) + sizeof(struct udphdr) + data_len;
	r = next_hop(ctx, ip, &rw);
	if (r >= 0) {
		*reason = r;
		return XDP_PASS;
	}

	/* Padding bytes leave the checksum: each sits at an even or odd offset of
	 * the datagram (the data starts at an even one in both old and new). */
	__u32 pad_sum = 0;
	__u8 *p = c->pos;
	p += data_len & CHANNEL_DATA_MAX_LEN;
#pragma unroll
	for (int i = 0; i < CHANNEL_DATA_MAX_PAD; i++) {
		if (i < pad) {
			if ((void *)(p + i + 1) > c->end) {
				*reason = REASON_MALFORMED_CHANNEL_DATA;
				return XDP_PASS;
			}
			__u32 v = p[i];
			pad_sum += ((data_len + i) & 1) ? v << 8 : v;
		}
	}
	__u16 new_udp_len = bpf_htons(sizeof(struct udphdr) + data_len);
	__be32 from[5] = {ip->saddr, ip->daddr, 0, 0, 0};
	__be32 to[5] = {rw.saddr, rw.daddr, 0, 0, 0};
	__builtin_memcpy(&from[2], &udp->source, 4);  /* sport, dport */
	__builtin_memcpy(&from[3], &udp->len, 2);     /* length in the pseudo header */
	__builtin_memcpy((__u8 *)&from[3] + 2, &udp->len, 2); /* and in the header */
	__builtin_memcpy(&from[4], (__u8 *)(udp + 1), 4);     /* ChannelData header */
	__builtin_memcpy(&to[2], &rw.sport, 2);
	__builtin_memcpy((__u8 *)&to[2] + 2, &rw.dport, 2);
	__builtin_memcpy(&to[3], &new_udp_len, 2);
	__builtin_memcpy((__u8 *)&to[3] + 2, &new_udp_len, 2);
	rw.udp_csum = udp_csum_update(udp->check, from, sizeof(from), to, sizeof(to), pad_sum);

	__u32 binding_id = b->binding_id;
	struct iphdr old_ip = *ip;
	__u32 tail = (void *)c->end - ((void *)ip + bpf_ntohs(ip->tot_len)) + pad;
	if (trim(ctx, tail) || bpf_xdp_adjust_head(ctx, CHANNEL_DATA_HDR_LEN)) {
		*reason = REASON_ADJUST_FAILED;
		return XDP_PASS;
	}
	int action = emit(ctx, &old_ip, &rw, channel, data_len, 1, reason);
	count_binding(binding_id, 1, data_len);
	return action;
}

static __always_inline int peer_to_client(struct xdp_md *ctx, struct iphdr *ip, struct udphdr *udp,
					  __u32 *reason)
{
	struct p2c_key key = {};
	addr_set_v4(&key.peer_addr, ip->saddr);
	addr_set_v4(&key.relay_addr, ip->daddr);
	key.peer_port = udp->source;
	key.relay_port = udp->dest;
	struct p2c_val *b = bpf_map_lookup_elem(&p2c_bindings, &key);
	if (!b) {
		*reason = REASON_NO_PEER_BINDING;
		return XDP_PASS;
	}
	__be32 listener = addr_v4(&b->listener_addr);
	if (listener == 0) {
		*reason = REASON_CLIENT_ADDR_UNKNOWN;
		return XDP_PASS;
	}
	__u16 data_len = bpf_ntohs(udp->len) - sizeof(*udp);
	if (data_len > CHANNEL_DATA_MAX_LEN) {
		*reason = REASON_OVERSIZE;
		return XDP_PASS;
	}

	struct rewrite rw = {};
	rw.saddr = listener;
	rw.daddr = addr_v4(&b->client_addr);
	rw.sport = b->listener_port;
	rw.dport = b->client_port;
	rw.tot_len = sizeof(struct iphdr) + sizeof(struct udphdr) + CHANNEL_DATA_HDR_LEN + data_len;
	int r = next_hop(ctx, ip, &rw);
	if (r >= 0) {
		*reason = r;
		return XDP_PASS;
	}

	__be16 channel = b->channel;
	__u16 new_udp_len = bpf_htons(sizeof(struct udphdr) + CHANNEL_DATA_HDR_LEN + data_len);
	__be16 cd_len = bpf_htons(data_len);
	__be32 from[5] = {ip->saddr, ip->daddr, 0, 0, 0};
	__be32 to[5] = {rw.saddr, rw.daddr, 0, 0, 0};
	__builtin_memcpy(&from[2], &udp->source, 4);
	__builtin_memcpy(&from[3], &udp->len, 2);
	__builtin_memcpy((__u8 *)&from[3] + 2, &udp->len, 2);
	__builtin_memcpy(&to[2], &rw.sport, 2);
	__builtin_memcpy((__u8 *)&to[2] + 2, &rw.dport, 2);
	__builtin_memcpy(&to[3], &new_udp_len, 2);
	__builtin_memcpy((__u8 *)&to[3] + 2, &new_udp_len, 2);
	__builtin_memcpy(&to[4], &channel, 2);
	__builtin_memcpy((__u8 *)&to[4] + 2, &cd_len, 2);
	rw.udp_csum = udp_csum_update(udp->check, from, sizeof(from), to, sizeof(to), 0);

	__u32 binding_id = b->binding_id;
	struct iphdr old_ip = *ip;
	void *data_end = (void *)(long)ctx->data_end;
	__u32 tail = data_end - ((void *)ip + bpf_ntohs(ip->tot_len));
	if (trim(ctx, tail) || bpf_xdp_adjust_head(ctx, -CHANNEL_DATA_HDR_LEN)) {
		*reason = REASON_ADJUST_FAILED;
		return XDP_PASS;
	}
	int action = emit(ctx, &old_ip, &rw, channel, data_len, 0, reason);
	count_binding(binding_id, 0, data_len);
	return action;
}

static __always_inline int relay(struct xdp_md *ctx, __u32 *reason)
{
	struct cursor c = {
		.pos = (void *)(long)ctx->data,
		.end = (void *)(long)ctx->data_end,
	};
	struct ethhdr *eth;
	struct iphdr *ip;
	struct udphdr *udp;
	int r;

	if ((r = parse_eth(&c, &eth)) >= 0 || (r = parse_ipv4(&c, &ip)) >= 0 ||
	    (r = parse_udp(&c, ip, &udp)) >= 0) {
		*reason = r;
		return XDP_PASS;
	}
	if (is_listener_port(udp->dest))
		return client_to_peer(ctx, &c, ip, udp, reason);
	if (is_relay_port(udp->dest))
		return peer_to_client(ctx, ip, udp, reason);
	*reason = REASON_NOT_OURS;
	return XDP_PASS;
}

SEC("xdp")
int xdp_turn_relay(struct xdp_md *ctx)
{
	__u32 reason = REASON_NOT_OURS;
	int action = relay(ctx, &reason);
	__u64 *n = bpf_map_lookup_elem(&verdicts, &reason);
	if (n)
		(*n)++;
	return action;
}
