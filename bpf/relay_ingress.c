//go:build ignore

// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/* The XDP program for the tests on kernels whose BPF_PROG_RUN takes no XDP
 * context (before 5.15): the ingress ifindex travels in front of the frame
 * (relay.c, RELAY_INGRESS_IN_FRAME). Never loaded by the daemon. */
#define RELAY_INGRESS_IN_FRAME
#include "relay.c"
