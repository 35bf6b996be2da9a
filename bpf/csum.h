/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* Internet checksum helpers (RFC 1071, incremental update per RFC 1624). All sums
 * are over 16-bit words in memory order, as bpf_csum_diff computes them. */
#ifndef STUNNERD_XDP_CSUM_H
#define STUNNERD_XDP_CSUM_H

#include <linux/ip.h>
#include <bpf_helpers.h>
#include "consts.h"

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

/* ipv4_csum_ok tells whether an option-less IPv4 header's checksum verifies. */
static __always_inline int ipv4_csum_ok(const struct iphdr *ip)
{
	const __u16 *w = (const __u16 *)ip;
	__u64 sum = 0;
#pragma unroll
	for (int i = 0; i < (int)sizeof(*ip) / 2; i++)
		sum += w[i];
	return csum_fold(sum) == 0;
}

/* sum_words adds n 32-bit words to an unfolded ones' complement sum. */
static __always_inline __u64 sum_words(const __be32 *w, int n, __u64 sum)
{
#pragma unroll
	for (int i = 0; i < 12; i++) {
		if (i < n)
			sum += w[i];
	}
	return sum;
}

/* csum_chunk adds the n bytes at data + off to sum when they are all in the
 * frame; n is a constant multiple of 4, at most 512 (bpf_csum_diff's limit). */
#define csum_chunk(data, end, off, n, sum)                                   \
	({                                                                   \
		__u8 *__q = (__u8 *)(data) + (off);                          \
		int __ok = (void *)(__q + (n)) <= (end);                     \
		if (__ok)                                                    \
			*(sum) += (__u32)bpf_csum_diff(0, 0, (__be32 *)__q, (n), 0); \
		__ok;                                                        \
	})

/* sum_data returns the folded ones' complement sum (memory order, not
 * complemented) of the len bytes at offset off of the frame, which start at an
 * even offset of their datagram; -1 when they are not all in the frame. It is
 * a global function: the verifier checks it once, not once for every path of
 * its callers. off is a header length (below 128), len at most
 * CHANNEL_DATA_MAX_LEN. */
__attribute__((noinline)) int sum_data(struct xdp_md *ctx, __u32 off, __u32 len)
{
	void *data = (void *)(long)ctx->data;
	void *end = (void *)(long)ctx->data_end;
	__u64 sum = 0;
	__u32 done = 0;

	off &= 0x7f;
	len &= CHANNEL_DATA_MAX_LEN;
	data += off;
	for (int i = 0; i < (CHANNEL_DATA_MAX_LEN + 1) / 512 && len - done >= 512; i++) {
		if (!csum_chunk(data, end, done & CHANNEL_DATA_MAX_LEN, 512, &sum))
			return -1;
		done += 512;
	}
	/* Then one call per set bit of what is left down to 128 (a 1200-byte
	 * datagram takes 3 helper calls). */
#define SUM_DATA_BIT(n)                                                      \
	if ((len - done) & (n)) {                                            \
		if (!csum_chunk(data, end, done & CHANNEL_DATA_MAX_LEN, (n), &sum)) \
			return -1;                                           \
		done += (n);                                                 \
	}
	SUM_DATA_BIT(256)
	SUM_DATA_BIT(128)
#undef SUM_DATA_BIT
	/* Below 128 bytes a helper call costs more than adding the words here:
	 * 8-byte loads, each added as its two memory-order 32-bit words. */
#define SUM_DATA_WORDS(n)                                                    \
	if ((len - done) & (n)) {                                            \
		__u8 *__q = (__u8 *)data + (done & CHANNEL_DATA_MAX_LEN);    \
		if ((void *)(__q + (n)) > end)                               \
			return -1;                                           \
		_Pragma("unroll") for (int __k = 0; __k < (n) / 8; __k++) { \
			__u64 __v = *(__u64 *)(__q + 8 * __k);               \
			sum += (__u32)__v;                                   \
			sum += __v >> 32;                                    \
		}                                                            \
		done += (n);                                                 \
	}
	SUM_DATA_WORDS(64)
	SUM_DATA_WORDS(32)
	SUM_DATA_WORDS(16)
	SUM_DATA_WORDS(8)
#undef SUM_DATA_WORDS
	if ((len - done) & 4) {
		__u8 *q4 = (__u8 *)data + (done & CHANNEL_DATA_MAX_LEN);
		if ((void *)(q4 + 4) > end)
			return -1;
		sum += *(__u32 *)q4;
		done += 4;
	}
	/* The last 0-3 bytes; done is a multiple of 4, so the first is at an even
	 * offset (the low byte of a memory-order word). */
	__u8 *q = (__u8 *)data + (done & CHANNEL_DATA_MAX_LEN);
	__u32 rest = len - done;
	if (rest >= 1) {
		if ((void *)(q + 1) > end)
			return -1;
		sum += q[0];
	}
	if (rest >= 2) {
		if ((void *)(q + 2) > end)
			return -1;
		sum += (__u32)q[1] << 8;
	}
	if (rest >= 3) {
		if ((void *)(q + 3) > end)
			return -1;
		sum += q[2];
	}
	return (__u16)~csum_fold(sum);
}

/* SUM_INLINE_MAX: data up to this long (most audio packets) is summed by
 * sum_short, inline; longer data by sum_data. A subprogram call and its return
 * cost more on a live path than the loads of a short datagram. */
#define SUM_INLINE_MAX 255

/* sum_short is sum_data for len <= SUM_INLINE_MAX, inline at its call site,
 * from q, the start of the data in the frame: 32-byte blocks with one bounds
 * check each, then the bits of what is left. Two sums, so that the adds do not
 * wait on each other. Written for the verifier: which block the loop ends in
 * leaves no trace in the state after it (the tail's offsets come from len), so
 * the paths through it merge there. */
static __always_inline int sum_short(__u8 *q, void *end, __u32 len)
{
	__u64 s0 = 0, s1 = 0;
	__u32 blocks = (len & SUM_INLINE_MAX) >> 5;
	for (__u32 i = 0; i < (SUM_INLINE_MAX + 1) / 32 && i < blocks; i++) {
		__u8 *w = q + 32 * i;
		/* Keeps clang from comparing against end moved by a constant,
		 * which the verifier refuses. */
		asm volatile("" : "+r"(w));
		if ((void *)(w + 32) > end)
			return -1;
		const __u32 *x = (const __u32 *)w;
		s0 += x[0];
		s1 += x[1];
		s0 += x[2];
		s1 += x[3];
		s0 += x[4];
		s1 += x[5];
		s0 += x[6];
		s1 += x[7];
	}
	/* The last 0-31 bytes; the first is at an even offset of the datagram
	 * (the low byte of a memory-order word). */
	__u8 *t = q + (len & (SUM_INLINE_MAX & ~31));
	if (len & 16) {
		if ((void *)(t + 16) > end)
			return -1;
		const __u32 *x = (const __u32 *)t;
		s0 += x[0];
		s1 += x[1];
		s0 += x[2];
		s1 += x[3];
		t += 16;
	}
	if (len & 8) {
		if ((void *)(t + 8) > end)
			return -1;
		const __u32 *x = (const __u32 *)t;
		s0 += x[0];
		s1 += x[1];
		t += 8;
	}
	if (len & 4) {
		if ((void *)(t + 4) > end)
			return -1;
		s0 += *(__u32 *)t;
		t += 4;
	}
	if (len & 2) {
		if ((void *)(t + 2) > end)
			return -1;
		s1 += *(__u16 *)t;
		t += 2;
	}
	if (len & 1) {
		if ((void *)(t + 1) > end)
			return -1;
		s0 += t[0];
	}
	return (__u16)~csum_fold(s0 + s1);
}

/* csum_finish turns an unfolded sum over a whole datagram (pseudo header
 * included, checksum field zero) into the checksum to store. */
static __always_inline __u16 csum_finish(__u64 sum)
{
	__u16 c = csum_fold(sum);
	return c == 0 ? 0xffff : c; /* RFC 768: a computed zero is sent as all ones */
}

/* udp_csum_update turns the UDP checksum `old` into the checksum of a datagram in
 * which the nfrom 32-bit words `from` were replaced by the nto words `to` (at
 * most 12 each) and `sub` (an unfolded sum of removed bytes) was taken away:
 * RFC 1624's HC' = ~(~HC + ~m + m'), added here rather than by bpf_csum_diff (a
 * helper call costs more than the few adds). A zero (absent) checksum stays
 * absent: it is legal on IPv4 and cannot be updated incrementally. */
static __always_inline __u16 udp_csum_update(__u16 old, const __be32 *from, int nfrom,
					     const __be32 *to, int nto, __u32 sub)
{
	if (old == 0)
		return 0;
	__u64 sum = (__u16)~old;
#pragma unroll
	for (int i = 0; i < 12; i++) {
		if (i < nfrom)
			sum += (__u32)~from[i];
	}
	sum = sum_words(to, nto, sum);
	/* Subtracting x in ones' complement is adding ~x, and csum_fold(sub) is ~x.
	 * Nothing to subtract (csum_fold(0), negative zero) changes no result. */
	if (sub)
		sum += csum_fold(sub);
	__u16 folded = csum_fold(sum);
	/* RFC 768: a computed zero is sent as all ones. */
	return folded == 0 ? 0xffff : folded;
}

#endif
