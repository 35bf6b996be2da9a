// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/* The listener steering's structs and maps (bpf/steer.c, internal/steering):
 * pinned by name, so that every stunnerd-xdp process of a node's network
 * namespace shares them, whichever loaded the program. */
#ifndef STEER_MAPS_H
#define STEER_MAPS_H

#include <linux/bpf.h>
#include <bpf_helpers.h>

#include "flow.h"

enum verdict {
	STEER_OWNER, /* a known client went to its allocation's socket */
	STEER_ACTIVE, /* a new flow went to the newest socket */
	STEER_HASH, /* no usable entry: the kernel's hash chose */
	STEER_VERDICT_MAX,
};
/* Keeps the enum in BTF for bpf2go. */
const enum verdict *_unused_verdict __attribute__((unused));

/* Who holds a slot, written by the process that claims it (the program does
 * not read it): the registration's socket cookie and the process's
 * generation, its start time, so that an older process never takes new flows
 * from a newer one. */
struct slot_info {
	__u64 cookie;
	__u64 generation;
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, struct slot_info);
	__uint(max_entries, 256);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} steer_slots SEC(".maps");

/* Slots are claimed by the processes under a lock (internal/steering). */
struct {
	__uint(type, BPF_MAP_TYPE_REUSEPORT_SOCKARRAY);
	__type(key, __u32);
	__type(value, __u64);
	__uint(max_entries, 256);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} steer_sockets SEC(".maps");

/* The newest process's sockets of a group: the first slot in the low 16 bits,
 * how many consecutive slots in the high 16 (0 means 1: the layout of
 * versions with one socket per listener, whose pinned maps stay usable). */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, struct group);
	__type(value, __u32);
	__uint(max_entries, 256);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} steer_active SEC(".maps");

/* One entry per live UDP allocation on the node; not preallocated. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, struct flow);
	__type(value, __u32);
	__uint(max_entries, 1 << 20);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} steer_flows SEC(".maps");

/* The program's verdicts (enum verdict). */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__type(key, __u32);
	__type(value, __u64);
	__uint(max_entries, STEER_VERDICT_MAX);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} steer_stats SEC(".maps");

#endif /* STEER_MAPS_H */
