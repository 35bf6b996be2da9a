/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* No architecture-specific byte swaps on BPF: linux/swab.h's generic ones. */
