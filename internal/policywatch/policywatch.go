// Package policywatch follows two things the node's stack consults for every
// packet and the kernel path does not: conntrack, whose entries CNIs and
// kube-proxy delete when policy or endpoints change (conntrack -D, -F), and
// the xfrm policy database (IPsec, and xfrm's own block policies). The mirror
// (internal/mirror) takes a binding out of the kernel's maps when the
// conntrack entry of one of its flows is removed, and keeps out of them the
// bindings whose flows an xfrm policy would block or encrypt: the rule of the
// kernel's own flow offload (nf_flowtable), where a flow is offloaded after
// the ruleset accepted it and leaves the fast path when conntrack removes it.
//
// Both are read through netlink notifications in the calling thread's
// network namespace: ctnetlink's destroy group (NFNLGRP_CONNTRACK_DESTROY)
// and xfrm's policy group (XFRMNLGRP_POLICY). See docs/datapath.md ("What the
// kernel path consults").
package policywatch
