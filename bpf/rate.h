/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* The allocations' rate limit (alloc_rates, rate_limits): one GCRA for every
 * program that charges an allocation's bucket, the relay engines (relay.c,
 * relay_tc.c) per packet they would relay and the charge program (charge.c)
 * per datagram pion/turn relays in userspace, so that an allocation has one
 * budget whichever path carries its traffic. test/model overLimit is the
 * spec. Include after maps.h. */
#ifndef STUNNERD_XDP_RATE_H
#define STUNNERD_XDP_RATE_H

#include <linux/bpf.h>
#include <bpf_helpers.h>
#include "consts.h"
#include "maps.h"

/* rate_limited charges a packet of data_len application-data bytes to the
 * allocation's rate limit and tells whether it is over it (then nothing is
 * charged). Only allocations under a limit pay for it. */
static __always_inline int rate_limited(struct alloc_rate *ar, const struct rate_limit *rl, __u16 data_len)
{
	__u64 pkt_cost = rl->pkt_cost_ns, bps = rl->bytes_per_sec;
	if (!pkt_cost && !bps)
		return 0;
	/* bpf_ktime_get_ns may not be called under the lock. */
	__u64 now = bpf_ktime_get_ns();
	__u64 byte_cost = bps ? (__u64)data_len * NS_PER_SEC / bps : 0;
	int over = 0;
	bpf_spin_lock(&ar->lock);
	__u64 pkt_tat = ar->pkt_tat > now ? ar->pkt_tat : now;
	__u64 byte_tat = ar->byte_tat > now ? ar->byte_tat : now;
	if ((pkt_cost && pkt_tat - now > RATE_LIMIT_BURST_NS) || (bps && byte_tat - now > RATE_LIMIT_BURST_NS)) {
		over = 1;
	} else {
		ar->pkt_tat = pkt_tat + pkt_cost;
		ar->byte_tat = byte_tat + byte_cost;
	}
	bpf_spin_unlock(&ar->lock);
	return over;
}

/* limit_on is the rate limit when there is one. */
static __always_inline const struct rate_limit *limit_on(void)
{
	__u32 zero = 0;
	const struct rate_limit *rl = bpf_map_lookup_elem(&rate_limits, &zero);
	return rl && (rl->pkt_cost_ns || rl->bytes_per_sec) ? rl : 0;
}

#endif
