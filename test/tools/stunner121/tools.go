//go:build tools

// Package tools pins STUNner v1.2.1, the current release, whose stunnerd the
// benchmark runs beside v1.1.0 (test/tools): v1.2 builds against upstream
// pion/turn v5, so this module needs no replace directive, and keeping it apart
// leaves the v1.1.0 turncat the rigs use untouched.
package tools

import _ "github.com/l7mp/stunner/cmd/stunnerd"
