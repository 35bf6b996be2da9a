/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* bpf2go builds for bpfel (see types.h). */
#include <linux/byteorder/little_endian.h>
