// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/* The key of a UDP allocation as the node's programs know it: the listener
 * steering's steer_flows (bpf/steer.c, internal/steering) and the relay's
 * listener shield (bpf/relay.c, internal/allocflows) share it, so that the
 * relay reads the steering's pinned map as its own. */
#ifndef FLOW_H
#define FLOW_H

#include <linux/types.h>

/* A reuseport group: the address and port its sockets are bound to. Addresses
 * are 16 bytes, IPv4 as ::ffff:a.b.c.d (so 0.0.0.0 is ::ffff:0.0.0.0). */
struct group {
	__u8 addr[16];
	__u16 port; /* host order */
	__u8 protocol; /* IPPROTO_UDP or IPPROTO_TCP */
	__u8 family; /* AF_INET or AF_INET6: the sockets', not the packet's */
};

/* A UDP client of a group: the 5-tuple of an allocation. */
struct flow {
	struct group group;
	__u8 client_addr[16];
	__be16 client_port;
	__u16 _pad;
};

#endif
