//go:build ignore

// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/* SO_REUSEPORT steering for rolling updates: two stunnerd-xdp processes on one
 * node (the old pod draining, the new one taking over) bind the same TURN
 * listener addresses, and this program picks which of them gets each packet:
 *
 *   UDP from a client with an allocation: the socket of the process that owns
 *       the allocation (steer_flows, written by that process when pion/turn
 *       creates and deletes the allocation);
 *   anything else (new clients, STUN Binding, TCP connections): one of the
 *       sockets registered last for the listener address (steer_active), i.e.
 *       the newest process's; a process with several sockets per listener
 *       (one read loop each) registers them in consecutive slots, and the
 *       packet's 4-tuple hash picks one, so a client's retries land where its
 *       first request did.
 *
 * A socket that closes leaves steer_sockets by itself; if a lookup names a
 * slot that is empty, the kernel's hash over the remaining sockets decides.
 * The maps are pinned (one directory per network namespace) so that every
 * process on the node sees the same ones, whichever loaded the program. */
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <bpf_helpers.h>
#include <bpf_endian.h>

char __license[] SEC("license") = "Dual BSD/GPL";

#define AF_INET 2
#define AF_INET6 10

#include "steer_maps.h"

static __always_inline int count(__u32 verdict)
{
	__u64 *n = bpf_map_lookup_elem(&steer_stats, &verdict);
	if (n)
		*n += 1;
	return SK_PASS;
}

static __always_inline int select_slot(struct sk_reuseport_md *md, void *map, const void *key)
{
	__u32 *slot = bpf_map_lookup_elem(map, key);
	if (!slot)
		return -1;
	return bpf_sk_select_reuseport(md, &steer_sockets, slot, 0);
}

SEC("sk_reuseport")
int steer_reuseport(struct sk_reuseport_md *md)
{
	struct bpf_sock *sk = md->sk;
	struct flow f = {};
	__u32 family = sk->family;

	f.group.protocol = md->ip_protocol;
	f.group.port = sk->src_port;
	if (family == AF_INET) {
		__u32 a = sk->src_ip4;
		f.group.family = AF_INET;
		f.group.addr[10] = 0xff;
		f.group.addr[11] = 0xff;
		__builtin_memcpy(&f.group.addr[12], &a, 4);
	} else if (family == AF_INET6) {
		__u32 a[4] = { sk->src_ip6[0], sk->src_ip6[1], sk->src_ip6[2], sk->src_ip6[3] };
		f.group.family = AF_INET6;
		__builtin_memcpy(f.group.addr, a, 16);
	} else {
		return count(STEER_HASH);
	}

	if (md->ip_protocol == IPPROTO_UDP) {
		/* data starts at the UDP header; the addresses are in the network
		 * header before it. */
		__be16 ports[2];
		int err = -1;

		if (bpf_skb_load_bytes(md, 0, ports, sizeof(ports)) == 0) {
			f.client_port = ports[0];
			if (md->eth_protocol == bpf_htons(ETH_P_IP)) {
				f.client_addr[10] = 0xff;
				f.client_addr[11] = 0xff;
				err = bpf_skb_load_bytes_relative(md, offsetof(struct iphdr, saddr),
								  &f.client_addr[12], 4, BPF_HDR_START_NET);
			} else if (md->eth_protocol == bpf_htons(ETH_P_IPV6)) {
				err = bpf_skb_load_bytes_relative(md, offsetof(struct ipv6hdr, saddr),
								  f.client_addr, 16, BPF_HDR_START_NET);
			}
		}
		if (err == 0 && select_slot(md, &steer_flows, &f) == 0)
			return count(STEER_OWNER);
	}
	__u32 *active = bpf_map_lookup_elem(&steer_active, &f.group);
	if (active) {
		__u32 slot = *active & 0xffff, n = *active >> 16;
		if (n > 1) /* the kernel's own reuseport scaling: hash * n / 2^32 */
			slot += (__u32)(((__u64)md->hash * n) >> 32);
		if (bpf_sk_select_reuseport(md, &steer_sockets, &slot, 0) == 0)
			return count(STEER_ACTIVE);
	}
	return count(STEER_HASH);
}
