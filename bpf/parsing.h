/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* Packet parsing: every read is bounds-checked here, before it happens.
 * A cursor walks the frame; each parse_* checks `hdr + 1 > data_end` first. */
#ifndef STUNNERD_XDP_PARSING_H
#define STUNNERD_XDP_PARSING_H

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/udp.h>
#include <bpf_helpers.h>
#include <bpf_endian.h>
#include "consts.h"

struct cursor {
	void *pos;
	void *end;
};

/* ntohs_bounded is bpf_ntohs of a length that moves a packet pointer, with
 * its bounds kept for the verifier: those before 6.18 (5.10, 6.1, 6.12) know
 * nothing of a register after a byte swap ("math between pkt pointer and
 * register with unbounded min value"). The mask gives them its 16 bits back;
 * the barrier keeps clang from dropping it as redundant. One ALU instruction. */
static __always_inline __u32 ntohs_bounded(__be16 v)
{
	__u32 x = bpf_ntohs(v);
	asm volatile("" : "+r"(x));
	return x & 0xffff;
}

/* parse_eth returns -1 and the ethertype for IPv4 and IPv6 frames. */
static __always_inline int parse_eth(struct cursor *c, struct ethhdr **eth, __u16 *proto)
{
	struct ethhdr *h = c->pos;
	if ((void *)(h + 1) > c->end)
		return REASON_NOT_IP;
	*proto = bpf_ntohs(h->h_proto);
	if (*proto != ETH_P_IP && *proto != ETH_P_IPV6)
		return REASON_NOT_IP;
	c->pos = h + 1;
	*eth = h;
	return -1;
}

/* parse_ipv4 accepts only option-less, unfragmented IPv4/UDP whose total length
 * fits in the frame; the frame may be longer (Ethernet minimum-size trailer). */
static __always_inline int parse_ipv4(struct cursor *c, struct iphdr **ip)
{
	struct iphdr *h = c->pos;
	if ((void *)(h + 1) > c->end)
		return REASON_MALFORMED_IP;
	if (h->version != 4 || h->ihl < 5)
		return REASON_MALFORMED_IP;
	if (h->ihl != 5)
		return REASON_IP_OPTIONS;
	if (h->protocol != IPPROTO_UDP)
		return REASON_NOT_UDP;
	if (h->frag_off & bpf_htons(IP_MF | IP_OFFSET))
		return REASON_IP_FRAGMENT;
	__u32 tot_len = ntohs_bounded(h->tot_len);
	if (tot_len < sizeof(*h) + sizeof(struct udphdr) || (void *)h + tot_len > c->end)
		return REASON_MALFORMED_IP;
	c->pos = h + 1;
	*ip = h;
	return -1;
}

static __always_inline int ipv6_extension(__u8 nexthdr)
{
	switch (nexthdr) {
	case 0:   /* hop-by-hop options */
	case 43:  /* routing */
	case 44:  /* fragment */
	case 50:  /* ESP */
	case 51:  /* AH */
	case 60:  /* destination options */
	case 135: /* mobility */
	case 139: /* HIP */
	case 140: /* shim6 */
	case 253: /* experiments */
	case 254:
		return 1;
	}
	return 0;
}

/* parse_ipv6 accepts IPv6 whose next header is UDP and whose payload fits in
 * the frame (which may be longer: an Ethernet trailer). Extension headers are
 * not walked: such packets are pion/turn's. */
static __always_inline int parse_ipv6(struct cursor *c, struct ipv6hdr **ip6)
{
	struct ipv6hdr *h = c->pos;
	if ((void *)(h + 1) > c->end)
		return REASON_MALFORMED_IP;
	if (h->version != 6)
		return REASON_MALFORMED_IP;
	if (h->nexthdr != IPPROTO_UDP)
		return ipv6_extension(h->nexthdr) ? REASON_IPV6_EXTENSION : REASON_NOT_UDP;
	__u32 plen = ntohs_bounded(h->payload_len);
	if (plen < sizeof(struct udphdr) || (void *)(h + 1) + plen > c->end)
		return REASON_MALFORMED_IP;
	c->pos = h + 1;
	*ip6 = h;
	return -1;
}

/* parse_udp requires the UDP length to agree exactly with the IP total length. */
static __always_inline int parse_udp(struct cursor *c, __u16 ip_payload_len, struct udphdr **udp)
{
	struct udphdr *h = c->pos;
	if ((void *)(h + 1) > c->end)
		return REASON_MALFORMED_UDP;
	if (bpf_ntohs(h->len) != ip_payload_len)
		return REASON_MALFORMED_UDP;
	c->pos = h + 1;
	*udp = h;
	return -1;
}

/* parse_channel_data validates a ChannelData message that fills the UDP payload of
 * payload_len bytes: the header, the length against the payload, padding of at
 * most 3 bytes. It returns -1 and the data length and padding on success. */
static __always_inline int parse_channel_data(struct cursor *c, __u16 payload_len,
					      __be16 *channel, __u16 *data_len, __u16 *pad)
{
	__u8 *h = c->pos;
	/* Too short to be ChannelData; a STUN message is longer still. The frame
	 * end is not enough: bytes after the datagram (an Ethernet trailer) are
	 * not part of the message and must not be read as its header. */
	if (payload_len < CHANNEL_DATA_HDR_LEN || (void *)(h + CHANNEL_DATA_HDR_LEN) > c->end)
		return REASON_MALFORMED_CHANNEL_DATA;
	if ((h[0] & CHANNEL_DATA_MASK) != CHANNEL_DATA_BITS)
		return REASON_STUN;
	__u16 len = ((__u16)h[2] << 8) | h[3];
	if ((__u32)len + CHANNEL_DATA_HDR_LEN > payload_len)
		return REASON_MALFORMED_CHANNEL_DATA;
	if (payload_len - CHANNEL_DATA_HDR_LEN - len > CHANNEL_DATA_MAX_PAD)
		return REASON_MALFORMED_CHANNEL_DATA;
	if (len > CHANNEL_DATA_MAX_LEN)
		return REASON_OVERSIZE;
	*channel = *(__be16 *)h;
	*data_len = len;
	*pad = payload_len - CHANNEL_DATA_HDR_LEN - len;
	c->pos = h + CHANNEL_DATA_HDR_LEN;
	return -1;
}

#endif
