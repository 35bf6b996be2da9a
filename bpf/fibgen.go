package bpf

import (
	"fmt"
	"sync"

	"github.com/cilium/ebpf"
)

var (
	// fibGenMu serialises the read-modify-write of a fib_gen map in this
	// process.
	fibGenMu sync.Mutex
	// fibGenHigh is the highest generation each fib_gen map held: after the
	// cache was off (0), it comes back above every generation the program
	// may have tagged a cached flow or next hop with.
	fibGenHigh = map[*ebpf.Map]uint32{}
)

// BumpFibGen advances the FIB generation in fibGen (the program's fib_gen map):
// every next hop and flow the program cached before is resolved again on its
// next packet. A generation of 0 (the caches are off: nobody follows the
// FIB's changes) stays 0.
func BumpFibGen(fibGen *ebpf.Map) error { return bumpFibGen(fibGen, false) }

// EnableFibGen is BumpFibGen that also turns the caches on: for the one who
// follows the FIB's changes (loader.WatchFIB).
func EnableFibGen(fibGen *ebpf.Map) error { return bumpFibGen(fibGen, true) }

// DisableFibGen turns the caches off (generation 0) until EnableFibGen.
func DisableFibGen(fibGen *ebpf.Map) error {
	fibGenMu.Lock()
	defer fibGenMu.Unlock()
	var gen uint32
	if err := fibGen.Lookup(uint32(0), &gen); err == nil && gen > fibGenHigh[fibGen] {
		fibGenHigh[fibGen] = gen
	}
	if err := fibGen.Put(uint32(0), uint32(0)); err != nil {
		return fmt.Errorf("turn the FIB generation off: %w", err)
	}
	return nil
}

// ForgetFibGen drops what is remembered of a fib_gen map (when it is closed).
func ForgetFibGen(fibGen *ebpf.Map) {
	fibGenMu.Lock()
	defer fibGenMu.Unlock()
	delete(fibGenHigh, fibGen)
}

func bumpFibGen(fibGen *ebpf.Map, enable bool) error {
	fibGenMu.Lock()
	defer fibGenMu.Unlock()
	var gen uint32
	if err := fibGen.Lookup(uint32(0), &gen); err != nil {
		return fmt.Errorf("read the FIB generation: %w", err)
	}
	if gen == 0 && !enable {
		return nil
	}
	gen = max(gen, fibGenHigh[fibGen])
	if gen++; gen == 0 {
		gen = 1 // wrapped: 0 would turn the caches off
	}
	if err := fibGen.Put(uint32(0), gen); err != nil {
		return fmt.Errorf("write the FIB generation: %w", err)
	}
	fibGenHigh[fibGen] = gen
	return nil
}
