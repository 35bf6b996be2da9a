package main

import "testing"

// TestLatestKeepsNewest: the CDS reader never blocks on the daemon; a config
// the daemon has not taken yet is replaced by a newer one.
func TestLatestKeepsNewest(t *testing.T) {
	out := make(chan []byte, 1)
	for _, c := range []string{"one", "two", "three"} {
		latest(out, []byte(c))
	}
	if got := string(<-out); got != "three" {
		t.Errorf("got %q, want the newest config", got)
	}
	select {
	case b := <-out:
		t.Errorf("a stale config was kept: %q", b)
	default:
	}
}
