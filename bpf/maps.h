/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* The maps shared with internal/channelmap, the only Go code that writes them.
 * Addresses are 16 bytes (IPv4 as ::ffff:a.b.c.d) so Go has one address type;
 * ports and channel numbers are in network byte order, as on the wire. */
#ifndef STUNNERD_XDP_MAPS_H
#define STUNNERD_XDP_MAPS_H

#include <linux/bpf.h>
#include <bpf_helpers.h>

#include "flow.h"
#include "consts.h"

struct addr {
	__u8 b[16];
};

/* The destinations the UDP listeners accept, written by userspace: a client's
 * packet to (addr, port) is delivered by the kernel to the listener socket with
 * this id. Specific listeners accept their own address; wildcard listeners the
 * node's local addresses; both also the VIPs the node DNATs to them (XDP sees
 * the pre-DNAT address). Anything else (transit traffic the node would forward,
 * packets to addresses of other listeners) is not this listener's. */
struct dst_key {
	struct addr addr;
	__be16 port;
	__u16 _pad;
};

struct dst_val {
	__u32 listener_id;
	/* The listener socket's group (flow.h): the shield's allocation key. */
	struct group group;
};

/* A client's ChannelData arriving at an accepted destination. The listener is
 * part of the identity: one client address:port may hold allocations on two
 * listeners sharing a port (a browser shares its socket across TURN servers; a
 * NAT maps two users to one address), each with its own channels. */
struct c2p_key {
	struct addr client_addr;
	__be16 client_port;
	__be16 channel;
	__u32 listener_id;
};

/* A hash map hands a deleted or replaced element to the next insert at once,
 * while a program may still read it: each value starts with its own key, which
 * the program reads before and after the fields it uses (userspace and the
 * kernel write a value from its start), so that it never takes another
 * binding's fields for this packet's. */
struct c2p_val {
	struct c2p_key key;
	struct addr peer_addr;
	struct addr relay_addr;
	__be16 peer_port;
	__be16 relay_port;
	__u32 binding_id; /* index into binding_states */
	__u32 alloc_id;   /* the allocation's, index into alloc_rates */
	__u32 gen;        /* the slot's generation when installed */
};

/* A peer's datagram to a relayed transport address. The relay address is part of
 * the key: pion/turn's relay socket is bound to it and takes nothing else. */
struct p2c_key {
	struct addr peer_addr;
	struct addr relay_addr;
	__be16 peer_port;
	__be16 relay_port;
};

/* Where a peer's datagram goes, and whose it is. The source it leaves from is
 * not here: it is what the client's packets arrived at on the wire (address
 * and port), which the program learns (binding_state). */
struct p2c_binding {
	struct addr client_addr;
	__be16 client_port;
	__be16 channel;
	__u32 binding_id;
	__u32 alloc_id;
	__u32 gen; /* the slot's generation when installed */
};

struct p2c_val {
	struct p2c_key key; /* see c2p_val */
	struct p2c_binding bind;
};

/* A binding's next hop in one direction as bpf_fib_lookup resolved it, reused
 * while nothing the lookup depends on changed: the FIB generation (userspace
 * bumps it on every neighbour, route, rule, address or link change and when it
 * changes the devmap or a binding's addresses), the ingress device and TOS of
 * the lookup, and a length the route's MTU took. */
struct next_hop {
	__u32 seq;        /* odd while a writer (holding the slot's lock) changes it */
	__u32 gen;        /* fib_gen when resolved; 0: empty */
	__u32 ifindex;    /* egress */
	__u32 in_ifindex; /* the ingress it was resolved for */
	__u16 max_len;    /* the longest packet the route took (from the IP header on) */
	__u8 tos;         /* TOS or traffic class it was resolved for */
	__u8 _pad;
	unsigned char dmac[ETH_ALEN];
	unsigned char smac[ETH_ALEN];
};

/* Per binding and direction: packets and application-data bytes relayed. */
struct binding_stats {
	__u64 c2p_packets;
	__u64 c2p_bytes;
	__u64 p2c_packets;
	__u64 p2c_bytes;
};

/* Per binding, indexed by binding id: what the program learns and caches. One
 * array slot instead of a second hash lookup per packet. */
struct binding_state {
	/* Source for packets to the client: the address the client's packets
	 * arrived at on the wire (a VIP in front of the node, the local address a
	 * wildcard listener was reached at), learned from the client's accepted
	 * ChannelData. Userspace never seeds it: a DNAT it cannot see may stand
	 * in between. All zero: not known yet, the packet goes to userspace. */
	struct addr listener_addr;
	/* Serialises writers of the next hops: two CPUs may resolve one binding
	 * at once, and a torn entry would pair one lookup's MAC with another's
	 * device. Readers take it too, unless cfg.tso (then the seq counts). */
	struct bpf_spin_lock lock;
	/* Set by userspace when it gives the slot to a binding (unique per
	 * install, never 0), 0 when it takes the slot back: a flow cached for
	 * another generation is not this binding's. */
	__u32 gen;
	/* The port the client's packets arrived at on the wire, learned with
	 * listener_addr: the listener's own, or the port a DNAT translated to
	 * it (a NodePort: the client sends to 31478, the listener has 3478, and
	 * the node's conntrack would send pion's replies from 31478). 0: not
	 * known. */
	__be16 listener_port;
	__u16 _pad;
	struct next_hop c2p_hop;
	struct next_hop p2c_hop;
	/* Added atomically: one copy per binding whatever the number of CPUs (a
	 * per-CPU array costs bindings x CPUs x 32 B: 2 GiB at 1M and 64). */
	struct binding_stats stats;
};

/* Per allocation (relayed transport address), indexed by the alloc_id that
 * userspace gives all its bindings: its rate limit as a GCRA (a token bucket
 * in virtual time): the bpf_ktime_get_ns instant by which everything it
 * relayed so far is paid for at the limit's rates, for packets and for bytes.
 * A packet goes while that instant is at most RATE_LIMIT_BURST_NS ahead of
 * now. Zero (as userspace hands a slot out): nothing owed. */
struct alloc_rate {
	/* The check and the charge are one step: with RSS, an allocation's
	 * channels and directions arrive on several CPUs at once. */
	struct bpf_spin_lock lock;
	__u32 _pad;
	__u64 pkt_tat;
	__u64 byte_tat;
};

/* The rate limit of every allocation, all its channels and both directions
 * together: written by userspace (--max-alloc-pps, --max-alloc-bps), read per packet, so a change
 * needs no reload. Zero rates: no limit. */
struct rate_limit {
	__u64 pkt_cost_ns; /* NS_PER_SEC / packets per second; 0: no packet limit */
	__u64 bytes_per_sec; /* application-data bytes; 0: no byte limit */
	__u32 pass;        /* over the limit: 1 XDP_PASS to pion/turn, 0 XDP_DROP */
	__u32 _pad;
};


/* Load-time configuration (rewritten by the loader before load, so the verifier
 * sees constants). Ports in network byte order; relay range inclusive. */
struct config {
	__be16 listener_ports[MAX_LISTENER_PORTS];
	__u16 listener_port_count;
	__u16 min_relay_port; /* host order, for range comparison */
	__u16 max_relay_port; /* host order */
	/* The CPU keeps stores and loads in program order (x86 TSO): cached next
	 * hops are read without the lock, under their sequence count. */
	__u8 tso;
	/* The flow caches are used (off only to measure what they save). */
	__u8 flow_cache;
	/* The flow caches: a random seed for their index hash (a stranger
	 * cannot aim at another client's entry) and the log2 of the entries
	 * of one CPU's region. */
	__u32 flow_seed;
	__u32 flow_shift; /* log2 of the entries per CPU */
	/* The TC engine reads the kernel's skb with bpf_probe_read_kernel: the
	 * kernel has no bpf_cast_to_kern_ctx (before 6.2). The XDP program
	 * ignores it. */
	__u8 tc_no_kfunc;
};

/* The ports of relays the node source-NATs (a masquerade maps pion's relay
 * socket to another address and a port of conntrack's choosing, often outside
 * the relay port range: natcheck's Translated), as a bitmap indexed by port
 * (host order): bit port % 64 of word port / 64. The program takes UDP to a
 * port that is neither a listener's nor a relay port as a peer's datagram only
 * when its bit is set; only an exact (peer, relay on the wire) in p2c_bindings
 * is a binding's. Written by userspace (internal/channelmap) as translated
 * bindings come and go; one array lookup, inlined by the verifier, on the path
 * of packets that are not the relay's. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, __u64);
	__uint(max_entries, 1024);
} nat_relay_ports SEC(".maps");

/* Sized by the loader from --max-bindings; max_entries here are the defaults. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, struct dst_key);
	__type(value, struct dst_val);
	__uint(max_entries, 4096);
} listener_dsts SEC(".maps");

/* The destination ports a DNAT translates to a listener's port (NodePort
 * 31478 -> listener 3478), as a bitmap indexed by port (host order) / 64:
 * bit port % 64 of word port / 64. The program looks at ChannelData to a port
 * that is neither a listener's nor a relay port only when its bit is set, and
 * then takes it as any listener port: only a destination in listener_dsts is
 * a listener's. Written by userspace (internal/channelmap) from the learned
 * destinations; one array lookup, inlined by the verifier, on the path of
 * packets that are not the relay's. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, __u64);
	__uint(max_entries, 1024);
} wire_ports SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, struct c2p_key);
	__type(value, struct c2p_val);
	__uint(max_entries, 131072);
} c2p_bindings SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, struct p2c_key);
	__type(value, struct p2c_val);
	__uint(max_entries, 131072);
} p2c_bindings SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, struct binding_state);
	__uint(max_entries, 131072);
} binding_states SEC(".maps");

/* The FIB generation: cached next hops resolved in another one are stale.
 * [0] is what the program compares; zero (as created) turns the cache off
 * until userspace sets it. [1] is the highest generation [0] ever held, kept
 * by userspace (bpf.FibGen) so that a cache turned on again starts above
 * every generation an entry may carry; the program never reads it.
 * The top bit of a generation (FLOWS_ASIDE) sets the flow caches aside:
 * neither read nor filled. Userspace (internal/channelmap) sets it while
 * more bindings send than a CPU's region holds well, where most packets
 * would read an entry that stands for another flow and refill it, which
 * costs more than the hash lookups alone. It rides in the word every packet
 * reads anyway (no second lookup on the path). Changing it starts a new
 * generation, so nothing cached before is used after. */
#define FLOWS_ASIDE 0x80000000u
/* The next bit (GEN_RP_FILTER): some device's dev_caps entry has DEV_RP_*,
 * so the program looks up the ingress's before it relays (reverse_path);
 * clear, no device filters and it does not look, which would otherwise cost
 * the TC engine a hash lookup per packet. Userspace sets it after writing
 * such an entry. A generation of 0 carries no flag: the program looks. */
#define GEN_RP_FILTER 0x40000000u
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, __u32);
	__uint(max_entries, 2);
} fib_gen SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, struct alloc_rate);
	__uint(max_entries, 131072);
} alloc_rates SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, struct rate_limit);
	__uint(max_entries, 1);
} rate_limits SEC(".maps");

/* Flow caches, direct-mapped, a region per CPU: the last bindings each CPU relayed,
 * found by one array access instead of the hash lookups (listener destination
 * and binding for a client's ChannelData, binding for a peer's datagram). An
 * entry stands for the binding while both generations hold: the binding's
 * slot generation (it was removed or its slot reused otherwise) and the FIB
 * generation, which userspace bumps after every change of the destination
 * table and of a binding's addresses (and on every routing change). Userspace
 * never writes them; a miss or a stale entry takes the hash lookups and
 * refills the entry. */
struct c2p_flow {
	/* The key, as the packet shows it. */
	struct addr client_addr;
	struct addr dst_addr;
	__be16 client_port;
	__be16 dst_port;
	__be16 channel;
	__u16 _pad;
	__u32 fib_gen; /* 0: empty */
	__u32 gen;
	__u32 binding_id;
	__be32 peer_addr; /* relays and peers are IPv4 */
	__be32 relay_addr;
	__be16 peer_port;
	__be16 relay_port;
	/* The first cache line holds what a relayed packet reads; this one
	 * only a rate-limited one. */
	__u32 alloc_id;
	__u8 _pad2[60];
};

struct p2c_flow {
	__be32 peer_addr;
	__be32 relay_addr;
	__be16 peer_port;
	__be16 relay_port;
	__u32 fib_gen; /* 0: empty */
	struct p2c_binding bind;
	__u8 _pad[16]; /* one cache line */
};

/* Plain arrays, a region of 2^cfg.flow_shift entries per possible CPU (set by
 * the loader; the sizes here are placeholders): one access finds an entry
 * (a per-CPU array would first read the element's per-CPU pointer), and
 * BPF_F_MMAPABLE puts the values on a page boundary, so that every entry
 * starts a cache line. Each CPU writes only its own region. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(map_flags, BPF_F_MMAPABLE);
	__type(key, __u32);
	__type(value, struct c2p_flow);
	__uint(max_entries, FLOW_CACHE_SLOTS);
} c2p_flows SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(map_flags, BPF_F_MMAPABLE);
	__type(key, __u32);
	__type(value, struct p2c_flow);
	__uint(max_entries, FLOW_CACHE_SLOTS);
} p2c_flows SEC(".maps");

/* The listener's shield: what of it is on (SHIELD_* flags). Written by
 * userspace (internal/channelmap): SHIELD_JUNK with --listener-shield, and
 * SHIELD_ALLOCS while alloc_flows holds every allocation of this daemon. */
enum shield_flag {
	SHIELD_JUNK = 1,   /* drop what pion/turn discards unanswered */
	SHIELD_ALLOCS = 2, /* and ChannelData from a client without an allocation */
};

struct shield {
	__u32 flags;
	__u32 _pad;
	/* Admission: what a request of a client without an allocation costs
	 * its source address (ns; 0: no limit), and how far ahead of now it
	 * may run (ns). */
	__u64 admit_cost_ns;
	__u64 admit_burst_ns;
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, struct shield);
	__uint(max_entries, 1);
} shields SEC(".maps");

/* What each source address owes its admission: the instant (bpf_ktime_get_ns)
 * by which its requests are paid for. An LRU: a flood of spoofed sources
 * evicts the addresses that sent least recently, which then start afresh. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__type(key, struct addr);
	__type(value, __u64);
	__uint(max_entries, 65536);
} admit_tats SEC(".maps");

/* The UDP allocations: this daemon's (alloc_flows, written by
 * internal/allocflows before pion/turn answers the Allocate) and the node's
 * (node_flows: the listener steering's pinned steer_flows, which every daemon
 * of the node's network namespace writes, replaces it when the steering is
 * on; without it no other daemon serves these listeners). The same spec as
 * steer_flows, so that either can stand for the other. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, struct flow);
	__type(value, __u32);
	__uint(max_entries, 1 << 20);
	__uint(map_flags, BPF_F_NO_PREALLOC);
} alloc_flows SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, struct flow);
	__type(value, __u32);
	__uint(max_entries, 1 << 20);
	__uint(map_flags, BPF_F_NO_PREALLOC);
} node_flows SEC(".maps");

/* The shield's keys, built per CPU outside the program's stack (the TC
 * engine's frame has no room for them). */
struct shield_keys {
	struct dst_key dst;
	struct flow flow;
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__type(key, __u32);
	__type(value, struct shield_keys);
	__uint(max_entries, 1);
} shield_scratch SEC(".maps");

/* One counter per enum reason, per CPU: no atomics on the packet path. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__type(key, __u32);
	__type(value, __u64);
	__uint(max_entries, REASON_MAX);
} verdicts SEC(".maps");

/* The interfaces the program is attached to, keyed by ifindex: the only valid
 * redirect targets. Written from the interfaces' network namespace. */
struct {
	__uint(type, BPF_MAP_TYPE_DEVMAP_HASH);
	__type(key, __u32);
	__type(value, __u32);
	__uint(max_entries, 64);
} tx_ports SEC(".maps");


/* What the program must know of a network device before it sends a frame out
 * of it, or takes one in: written by userspace (internal/loader) for every
 * device of the namespace, from rtnetlink and the netdev generic-netlink
 * family's xdp-features, and kept live (every change bumps fib_gen, so that
 * the cached next hops, which carry the decision, are decided again).
 * DEV_* flags. */
enum dev_flag {
	DEV_ATTACHED_NATIVE = 1,  /* the program runs here in the driver */
	DEV_ATTACHED_GENERIC = 2, /* the program runs here on skbs (generic XDP):
	                             its XDP_REDIRECT and XDP_TX go through the skb
	                             path, which every device takes */
	DEV_XDP_XMIT = 4,         /* a native XDP_REDIRECT out of it is transmitted
	                             (NETDEV_XDP_ACT_NDO_XMIT; a veth has it only
	                             while its peer can receive XDP frames) */
	DEV_XDP_TX = 8,           /* a native XDP_TX out of it is transmitted (a
	                             veth: as DEV_XDP_XMIT; a NIC with native XDP:
	                             always) */
	DEV_XMIT_NEEDS_ROUTE = 16, /* its transmit takes the outer destination from
	                             the route attached to the skb (an ip_tunnel
	                             device without a fixed remote: Calico's tunl0,
	                             an NBMA GRE): an skb redirected without one is
	                             dropped (tx_fifo_errors), so the TC engine
	                             redirects into it with bpf_redirect_neigh */
	DEV_RP_STRICT = 32,       /* the stack filters what arrives here by reverse
	                             path, strictly: the route back to a packet's
	                             source must leave through this device
	                             (net.ipv4.conf.{all,DEV}.rp_filter's larger
	                             value 1, or 2 on a device without an IPv4
	                             address, where fib_validate_source falls back
	                             to strict) */
	DEV_RP_LOOSE = 64,        /* loosely: some unicast route back to the source
	                             must exist (rp_filter 2) */
};

struct dev_cap {
	enum dev_flag flags; /* a set of them (the enum is 32 bits wide) */
	__u32 mtu;   /* the device's MTU */
};

/* Keyed by ifindex. No entry: nothing is known, the program assumes the worst
 * (a native ingress, an egress that transmits no XDP frame, an MTU that no
 * packet longer than MTU_CHECK_ABOVE fits). */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, __u32);
	__type(value, struct dev_cap);
	__uint(max_entries, 4096);
} dev_caps SEC(".maps");

#endif
