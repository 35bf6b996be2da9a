//go:build tools

// Package tools pins the STUNner binaries the end-to-end tests and benchmarks
// compare against. Build them with ./build.sh BIN_DIR.
package tools

import (
	_ "github.com/l7mp/stunner/cmd/stunnerd"
	_ "github.com/l7mp/stunner/cmd/turncat"
)
