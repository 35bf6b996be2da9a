/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* See types.h. */
#include <asm-generic/posix_types.h>
