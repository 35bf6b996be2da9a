package bpf

import (
	"fmt"
	"sync"

	"github.com/cilium/ebpf"
)

// fib_gen's entries (maps.h).
const (
	fibGenCurrent    uint32 = 0 // what the program compares; 0: caches off
	fibGenHigh       uint32 = 1 // the highest generation ever current
	fibGenFlowsAside uint32 = 2 // FLOWS_ASIDE: nonzero, the flow caches are not used
)

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
	gen = max(gen, high)
	if gen++; gen == 0 {
		gen = 1 // wrapped: 0 would turn the caches off
	}
	// The mark first: a generation is never current before it is recorded.
	if err := g.m.Put(fibGenHigh, gen); err != nil {
		return fmt.Errorf("write the FIB generation: %w", err)
	}
	if err := g.m.Put(fibGenCurrent, gen); err != nil {
		return fmt.Errorf("write the FIB generation: %w", err)
	}
	return nil
}

// FlowGate is the program's switch between using its flow caches and
// setting them aside (fib_gen[FLOWS_ASIDE]): one word in the map the
// program reads the FIB generation from, written on its own.
type FlowGate struct{ m *ebpf.Map }

// NewFlowGate returns the switch kept in m, a fib_gen map.
func NewFlowGate(m *ebpf.Map) *FlowGate { return &FlowGate{m: m} }

// FlowsAside tells whether the flow caches are set aside.
func (g *FlowGate) FlowsAside() (bool, error) {
	var v uint32
	if err := g.m.Lookup(fibGenFlowsAside, &v); err != nil {
		return false, fmt.Errorf("read the flow caches' switch: %w", err)
	}
	return v != 0, nil
}

// SetFlowsAside makes the program leave its flow caches alone (aside) or use
// them again. Their entries describe themselves (both generations), so one
// left from before is used again only while it still stands for its binding.
func (g *FlowGate) SetFlowsAside(aside bool) error {
	var v uint32
	if aside {
		v = 1
	}
	if err := g.m.Put(fibGenFlowsAside, v); err != nil {
		return fmt.Errorf("set the flow caches aside (%v): %w", aside, err)
	}
	return nil
}
