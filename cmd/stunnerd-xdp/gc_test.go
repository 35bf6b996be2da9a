package main

import (
	"runtime/debug"
	"testing"
)

// TestGCDefault: the daemon collects at defaultGCPercent unless GOGC says
// otherwise (the runtime has then applied GOGC itself).
func TestGCDefault(t *testing.T) {
	defer debug.SetGCPercent(debug.SetGCPercent(100))
	for _, tc := range []struct {
		gogc string
		want int
	}{
		{"", defaultGCPercent},
		{"50", 100}, // what the runtime holds, here the test's 100
		{"off", 100},
	} {
		t.Run("GOGC="+tc.gogc, func(t *testing.T) {
			debug.SetGCPercent(100)
			setGCDefault(func(k string) string {
				if k == "GOGC" {
					return tc.gogc
				}
				return ""
			})
			if got := debug.SetGCPercent(100); got != tc.want {
				t.Errorf("GC percent %d, want %d", got, tc.want)
			}
		})
	}
}
