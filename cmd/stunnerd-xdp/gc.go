package main

import "runtime/debug"

// defaultGCPercent is the daemon's GOGC unless the environment sets one.
// The userspace relay path allocates about 130 B per datagram inside
// pion/turn (the arguments of its debug-log calls, built even with debug off)
// on a live heap of a few MB: under Go's default of 100 that is a collection every few MB of
// traffic (7 a second at 100,000 packets/s in the bench's userspace stage),
// each stopping the world twice and preempting the read loops. 400 collects
// about a fifth as often, for a heap of up to five times the live one;
// GOMEMLIMIT, when set, still caps it.
const defaultGCPercent = 400

// setGCDefault applies defaultGCPercent unless GOGC is set.
func setGCDefault(getenv func(string) string) {
	if getenv("GOGC") == "" {
		debug.SetGCPercent(defaultGCPercent)
	}
}
