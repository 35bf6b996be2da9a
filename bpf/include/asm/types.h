/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* The BPF target's asm/ headers: 64-bit little-endian (bpfel) whatever the
 * build host, so `make generate` needs no /usr/include/<host triple>. */
#include <asm-generic/types.h>
