package bpf

import (
	"fmt"
	"sync"

	"github.com/cilium/ebpf"
)

// fibGenMu serialises the read-modify-write of a fib_gen map in this process.
var fibGenMu sync.Mutex

// BumpFibGen advances the FIB generation in fibGen (the program's fib_gen map):
// every next hop the program cached before is resolved again on its next
// packet. A generation of 0 (the cache is off: nobody follows the FIB's
// changes) stays 0.
func BumpFibGen(fibGen *ebpf.Map) error { return bumpFibGen(fibGen, false) }

// EnableFibGen is BumpFibGen that also turns the cache on: for the one who
// follows the FIB's changes (loader.WatchFIB).
func EnableFibGen(fibGen *ebpf.Map) error { return bumpFibGen(fibGen, true) }

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
	if gen++; gen == 0 {
		gen = 1 // wrapped: 0 would turn the cache off
	}
	if err := fibGen.Put(uint32(0), gen); err != nil {
		return fmt.Errorf("write the FIB generation: %w", err)
	}
	return nil
}
