package bpf

import (
	"fmt"
	"sync"

	"github.com/cilium/ebpf"
)

// fib_gen's entries (maps.h).
const (
	fibGenCurrent uint32 = 0 // what the program compares; 0: caches off
	fibGenHigh    uint32 = 1 // the highest generation ever current
)

// flowsAside is FLOWS_ASIDE, the top bit of a generation: set in the current
// one, the program's flow caches stand aside. The high mark keeps it too, so
// that it outlives the caches being off and holds for every FibGen over the
// map; generations count in the other 31 bits.
const flowsAside = 1 << 31

// FibGen is the program's FIB generation (its fib_gen map): every next hop
// and flow the program cached in an older generation is resolved again on its
// next packet. Everything it remembers is in the map, so the program's owner
// and the writers it hands the value to (channelmap, the device capability
// follower) share one lock over one map.
type FibGen struct {
	m  *ebpf.Map
	mu sync.Mutex // serialises the read-modify-writes
}

// NewFibGen returns the generation kept in m, a fib_gen map.
func NewFibGen(m *ebpf.Map) *FibGen { return &FibGen{m: m} }

// Bump advances the generation. A generation of 0 (the caches are off:
// nobody follows the FIB's changes) stays 0.
func (g *FibGen) Bump() error { return g.bump(false) }

// Enable is Bump that also turns the caches on: for the one who follows the
// FIB's changes (loader.WatchFIB).
func (g *FibGen) Enable() error { return g.bump(true) }

// Invalidate is Bump that turns the caches off when it cannot bump: a stale
// next hop must never be used.
func (g *FibGen) Invalidate() error {
	err := g.Bump()
	if err != nil {
		_ = g.Disable()
	}
	return err
}

// Disable turns the caches off (generation 0) until Enable.
func (g *FibGen) Disable() error {
	g.mu.Lock()
	defer g.mu.Unlock()
	if err := g.m.Put(fibGenCurrent, uint32(0)); err != nil {
		return fmt.Errorf("turn the FIB generation off: %w", err)
	}
	return nil
}

func (g *FibGen) bump(enable bool) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.bumpLocked(enable)
}

func (g *FibGen) bumpLocked(enable bool) error {
	var gen, high uint32
	if err := g.m.Lookup(fibGenCurrent, &gen); err != nil {
		return fmt.Errorf("read the FIB generation: %w", err)
	}
	if gen == 0 && !enable {
		return nil
	}
	if err := g.m.Lookup(fibGenHigh, &high); err != nil {
		return fmt.Errorf("read the FIB generation: %w", err)
	}
	aside := high & flowsAside
	gen = max(gen&^flowsAside, high&^flowsAside)
	if gen = (gen + 1) &^ flowsAside; gen == 0 {
		gen = 1 // wrapped: 0 would turn the caches off
	}
	// The mark first: a generation is never current before it is recorded.
	if err := g.m.Put(fibGenHigh, gen|aside); err != nil {
		return fmt.Errorf("write the FIB generation: %w", err)
	}
	if err := g.m.Put(fibGenCurrent, gen|aside); err != nil {
		return fmt.Errorf("write the FIB generation: %w", err)
	}
	return nil
}

// SetFlowsAside makes the program leave its flow caches alone (aside) or use
// them again, from a new generation on: what they hold describes itself, and
// nothing cached before the change is used after it.
func (g *FibGen) SetFlowsAside(aside bool) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	var high uint32
	if err := g.m.Lookup(fibGenHigh, &high); err != nil {
		return fmt.Errorf("read the FIB generation: %w", err)
	}
	if (high&flowsAside != 0) == aside {
		return nil
	}
	high ^= flowsAside
	if err := g.m.Put(fibGenHigh, high); err != nil {
		return fmt.Errorf("set the flow caches aside (%v): %w", aside, err)
	}
	if err := g.bumpLocked(false); err != nil {
		return fmt.Errorf("set the flow caches aside (%v): %w", aside, err)
	}
	return nil
}

// FlowsAside tells whether the flow caches are set aside.
func (g *FibGen) FlowsAside() (bool, error) {
	var high uint32
	if err := g.m.Lookup(fibGenHigh, &high); err != nil {
		return false, fmt.Errorf("read the FIB generation: %w", err)
	}
	return high&flowsAside != 0, nil
}
