/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* Internet checksum helpers (RFC 1071, incremental update per RFC 1624). All sums
 * are over 16-bit words in memory order, as bpf_csum_diff computes them. */
#ifndef STUNNERD_XDP_CSUM_H
#define STUNNERD_XDP_CSUM_H

#include <linux/ip.h>
#include <bpf_helpers.h>

static __always_inline __u16 csum_fold(__u64 sum)
{
	sum = (sum & 0xffffffff) + (sum >> 32);
	sum = (sum & 0xffffffff) + (sum >> 32);
	sum = (sum & 0xffff) + (sum >> 16);
	sum = (sum & 0xffff) + (sum >> 16);
	return (__u16)~sum;
}

/* ipv4_csum computes the header checksum of an option-less IPv4 header whose
 * check field is zero. */
static __always_inline __u16 ipv4_csum(struct iphdr *ip)
{
	__u16 *w = (__u16 *)ip;
	__u64 sum = 0;
#pragma unroll
	for (int i = 0; i < (int)sizeof(*ip) / 2; i++)
		sum += w[i];
	return csum_fold(sum);
}

/* udp_csum_update turns the UDP checksum `old` into the checksum of a datagram in
 * which the 32-bit words `from` were replaced by `to` and `sub` (an unfolded sum
 * of removed bytes) was taken away. A zero (absent) checksum stays absent: it is
 * legal on IPv4 and cannot be updated incrementally. */
static __always_inline __u16 udp_csum_update(__u16 old, __be32 *from, __u32 from_size,
					     __be32 *to, __u32 to_size, __u32 sub)
{
	if (old == 0)
		return 0;
	__s64 diff = bpf_csum_diff(from, from_size, to, to_size, (__u16)~old);
	__u64 sum = (__u32)diff;
	/* Subtracting x in ones' complement is adding ~x, and csum_fold(sub) is ~x. */
	sum += csum_fold(sub);
	__u16 folded = csum_fold(sum);
	/* RFC 768: a computed zero is sent as all ones. */
	return folded == 0 ? 0xffff : folded;
}

#endif
