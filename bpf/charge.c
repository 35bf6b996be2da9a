//go:build ignore

// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/* The charge program: pion/turn's userspace relay charges an allocation's
 * rate-limit bucket with it, the bucket the relay engines charge (rate.h), so
 * that an allocation splitting its traffic between the kernel path
 * (ChannelData) and userspace (Send indications, datagrams the program
 * passes) still has one budget. Userspace runs it with BPF_PROG_RUN, once per
 * datagram it would relay, over the relay program's alloc_rates and
 * rate_limits maps: the check and the charge are one step under the bucket's
 * lock, as the engines' are (a read and a write of the map value from
 * userspace would be two, and lose a charge a CPU relaying in between made).
 *
 * An XDP program only for BPF_PROG_RUN (never attached): its test run is the
 * cheapest on hand (the packet is copied in, nothing out; a syscall program's
 * context round trip measured slower), it may take the bucket's spin lock
 * (tracing programs may not) and it runs on every kernel the relay does. The
 * "packet" is a struct charge_args (padded to an Ethernet header's length,
 * the least BPF_PROG_RUN takes); the verdict is the return value. */
#include <linux/bpf.h>
#include <bpf_helpers.h>

#include "consts.h"
#include "maps.h"
#include "rate.h"

char __license[] SEC("license") = "Dual BSD/GPL";

/* What a charge tells: the program's return value. */
enum charge_verdict {
	CHARGE_OK = 0,        /* charged, or no limit is set: relay it */
	CHARGE_OVER = 1,      /* over the limit: nothing charged, drop it */
	CHARGE_NO_BUCKET = 2, /* alloc_id is outside alloc_rates (or the input is
	                         short): nothing charged */
};

struct charge_args {
	__u32 alloc_id; /* the allocation's bucket, as its bindings carry it */
	__u32 data_len; /* application-data bytes (the UDP payload to or from the peer) */
};

/* Force the types into BTF for bpf2go. */
const enum charge_verdict *_unused_charge_verdict __attribute__((unused));
const struct charge_args *_unused_charge_args __attribute__((unused));

SEC("xdp")
int charge(struct xdp_md *ctx)
{
	struct charge_args *args = (void *)(long)ctx->data;
	if ((void *)(args + 1) > (void *)(long)ctx->data_end)
		return CHARGE_NO_BUCKET;
	__u32 id = args->alloc_id;
	/* The engines charge application data of one datagram (at most 64 KiB);
	 * a longer length is not a datagram's. */
	__u32 len = args->data_len;
	if (len > 0xFFFF)
		len = 0xFFFF;
	struct alloc_rate *ar = bpf_map_lookup_elem(&alloc_rates, &id);
	if (!ar)
		return CHARGE_NO_BUCKET;
	const struct rate_limit *rl = limit_on();
	if (!rl)
		return CHARGE_OK;
	return rate_limited(ar, rl, (__u16)len) ? CHARGE_OVER : CHARGE_OK;
}
