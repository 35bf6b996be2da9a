/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* Constants of the TURN ChannelData fast path. Every one of them is shared with
 * Go through the generated bindings (enums) or the load-time config. */
#ifndef STUNNERD_XDP_CONSTS_H
#define STUNNERD_XDP_CONSTS_H

/* RFC 8656 §12.4: a ChannelData message starts with 0b01 in its first two bits
 * (channel numbers 0x4000-0x7FFF); STUN messages start with 0b00. */
#define CHANNEL_DATA_MASK 0xC0
#define CHANNEL_DATA_BITS 0x40
#define CHANNEL_DATA_HDR_LEN 4
/* STUN (RFC 8489 §5): the header, its magic cookie; the classes and methods
 * pion/turn's server handles (internal/server getMessageHandler). */
#define STUN_HDR_LEN 20
#define STUN_MAGIC_COOKIE 0x2112A442
#define STUN_CLASS_REQUEST 0
#define STUN_CLASS_INDICATION 1
#define STUN_BINDING 0x001
#define STUN_ALLOCATE 0x003
#define STUN_REFRESH 0x004
#define STUN_SEND 0x006
#define STUN_CREATE_PERMISSION 0x008
#define STUN_CHANNEL_BIND 0x009

/* Over UDP a ChannelData message may carry 0-3 bytes of padding (RFC 8656 §12.5);
 * more trailing bytes than that are not ours: pion/turn decides about them. */
#define CHANNEL_DATA_MAX_PAD 3

/* The largest application data we relay. It bounds variable packet offsets for
 * the verifier and is above any XDP linear frame, so nothing real is cut off. */
#define CHANNEL_DATA_MAX_LEN 0x1fff

/* Relayed packets leave with the TTL (hop limit) they came with less one, as
 * RFC 8656 section 14 prefers: a relay loop through TURN servers dies out. What
 * would leave with 0 is pion/turn's (which sends with its own TTL). */
#define MIN_RELAY_TTL 2

/* A rate-limited allocation may run ahead of its rate by this much time's worth
 * of packets and bytes (its burst): 50 ms absorbs a video frame's packets
 * without letting a flood through. Userspace applies the same (internal/userspace). */
#define RATE_LIMIT_BURST_NS 50000000ULL
#define NS_PER_SEC 1000000000ULL

/* Entries of each flow cache per CPU (a power of two): 4,096 client->peer
 * flows of 128 B and 4,096 peer->client flows of 64 B take 768 KiB per CPU. */
#define FLOW_CACHE_SLOTS 4096

/* Packets (from the IP header on) up to this length fit every Ethernet
 * device's default MTU: only longer ones look up their ingress device's MTU
 * (dev_caps), so that a normal-size packet pays no hash lookup for it. */
#define MTU_CHECK_ABOVE 1500

/* How many UDP listener ports one program serves (set at load time). */
#define MAX_LISTENER_PORTS 8

#define ETH_ALEN 6
#define ETH_P_IP 0x0800
#define ETH_P_IPV6 0x86DD
#define IPPROTO_UDP 17
#define AF_INET6 10
/* Relayed IPv4 packets made from IPv6 ones: don't fragment, as a Linux UDP
 * socket with path MTU discovery sends them. */
#define IP_DF 0x4000
#define IP_MF 0x2000
#define IP_OFFSET 0x1FFF
#define AF_INET 2

/* Why the program let a packet go the way it did; one per-CPU counter each.
 * REASON_RELAY_* are relayed, everything else is XDP_PASSed untouched. */
enum reason {
	REASON_RELAY_C2P_TX = 0,       /* client->peer, out the ingress interface */
	REASON_RELAY_C2P_REDIRECT,     /* client->peer, to another attached interface */
	REASON_RELAY_P2C_TX,           /* peer->client, out the ingress interface */
	REASON_RELAY_P2C_REDIRECT,     /* peer->client, to another attached interface */
	REASON_NOT_IP,                 /* neither IPv4 nor IPv6 (incl. VLAN-tagged) */
	REASON_NOT_UDP,                /* IPv4 but not UDP */
	REASON_NOT_OURS,               /* UDP to neither a listener nor a relay port */
	REASON_MALFORMED_IP,           /* truncated, bad version/IHL, length lies */
	REASON_IP_OPTIONS,             /* IHL > 5 */
	REASON_IP_FRAGMENT,            /* MF set or fragment offset != 0 */
	REASON_MALFORMED_UDP,          /* UDP header truncated or its length lies */
	REASON_STUN,                   /* listener port, not ChannelData (STUN/TURN) */
	REASON_MALFORMED_CHANNEL_DATA, /* short, length beyond payload, 4+ bytes pad */
	REASON_OVERSIZE,               /* data above CHANNEL_DATA_MAX_LEN */
	REASON_NO_CHANNEL,             /* ChannelData for no bound channel */
	REASON_NO_PEER_BINDING,        /* relay port, no channel bound to this peer */
	REASON_CLIENT_ADDR_UNKNOWN,    /* listener address on the wire not learned yet */
	REASON_FIB_NO_NEIGH,           /* next hop has no neighbour entry yet */
	REASON_FIB_FRAG_NEEDED,        /* result above the egress MTU */
	REASON_FIB_FWD_DISABLED,       /* forwarding is off on the ingress device */
	REASON_FIB_NOT_FORWARDED,      /* local, blackhole, unreachable, ... */
	REASON_EGRESS_NOT_ATTACHED,    /* egress interface not in the devmap */
	REASON_ADJUST_FAILED,          /* bpf_xdp_adjust_head/tail refused */
	REASON_IPV6_EXTENSION,         /* IPv6 with extension headers */
	REASON_NO_CHECKSUM,            /* UDP checksum 0 where IPv6 needs one: an IPv6
	                                  client's ChannelData (Linux drops it, RFC 8200
	                                  8.1), or an IPv4 peer datagram for an IPv6
	                                  client (pion/turn sums it) */
	REASON_NOT_LISTENER_ADDR,      /* ChannelData to an address no listener accepts
	                                  (transit traffic, another listener's address) */
	REASON_TTL_EXPIRED,            /* TTL or hop limit <= 1 */
	REASON_BAD_IP_CHECKSUM,        /* IPv4 header checksum does not verify */
	REASON_REDIRECT_FAILED,        /* egress left the devmap after the lookup: the
	                                  rewritten frame is dropped (XDP_DROP) */
	REASON_RATE_LIMITED,           /* the allocation is over its rate limit: dropped
	                                  (XDP_DROP) or passed to pion/turn as
	                                  rate_limit.pass says */
	REASON_EGRESS_NO_XDP_XMIT,     /* a native-mode ingress, and the egress would
	                                  not transmit the XDP frame (XDP_REDIRECT: no
	                                  ndo_xdp_xmit, e.g. a veth whose peer runs no
	                                  XDP, a bridge, a tunnel; XDP_TX: the same for
	                                  a veth ingress), or nothing is known of it */
	REASON_INGRESS_OVER_MTU,       /* longer than the ingress device's MTU (or its
	                                  MTU unknown): a GSO super-packet that generic
	                                  XDP sees as one datagram */
	REASON_RP_FILTER,              /* IPv4 from a device whose rp_filter the route
	                                  back to the source fails (dev_caps
	                                  DEV_RP_*): the stack drops it */
	REASON_RP_UNCHECKED,           /* the route back could not be looked up as
	                                  the stack does (forwarding off on lo, an
	                                  LWT route): the stack decides */
	/* The listener's shield (shields): to a listener socket, what pion/turn
	 * would discard unanswered, dropped. */
	REASON_NO_ALLOCATION,          /* ChannelData (pion/turn's test) from a client
	                                  with no allocation on that listener socket
	                                  (alloc_flows, node_flows) */
	REASON_NOT_TURN,               /* neither that nor a STUN message whose header
	                                  decodes (magic cookie, length) */
	REASON_STUN_UNHANDLED,         /* STUN of a class and method pion/turn has no
	                                  handler for (a response, an unknown method) */
	REASON_ADMISSION,              /* a request of a client without an allocation,
	                                  over its source address's admission rate */
	REASON_MAX,
};

#endif
