/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* BPF is a 64-bit target (see types.h). */
#define __BITS_PER_LONG 64
#include <asm-generic/bitsperlong.h>
