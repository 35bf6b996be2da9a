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

// reversePath is GEN_RP_FILTER, the next bit: set, some device's dev_caps
// entry says the stack filters there by reverse path, and the program looks
// the ingress's entry up before it relays; clear, it skips that lookup (which
// the TC engine would otherwise pay on every packet). Kept like flowsAside.
const reversePath = 1 << 30

// genFlags are the bits of a generation that are not its count.
const genFlags = flowsAside | reversePath

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
	flags := high & genFlags
	gen = max(gen&^genFlags, high&^genFlags)
	if gen = (gen + 1) &^ genFlags; gen == 0 {
		gen = 1 // wrapped: 0 would turn the caches off
	}
	// The mark first: a generation is never current before it is recorded.
	if err := g.m.Put(fibGenHigh, gen|flags); err != nil {
		return fmt.Errorf("write the FIB generation: %w", err)
	}
	if err := g.m.Put(fibGenCurrent, gen|flags); err != nil {
		return fmt.Errorf("write the FIB generation: %w", err)
	}
	return nil
}

// SetFlowsAside makes the program leave its flow caches alone (aside) or use
// them again, from a new generation on: what they hold describes itself, and
// nothing cached before the change is used after it.
func (g *FibGen) SetFlowsAside(aside bool) error {
	if err := g.setFlag(flowsAside, aside); err != nil {
		return fmt.Errorf("set the flow caches aside (%v): %w", aside, err)
	}
	return nil
}

// FlowsAside tells whether the flow caches are set aside.
func (g *FibGen) FlowsAside() (bool, error) { return g.flag(flowsAside) }

// SetReversePath tells the program whether any device's dev_caps entry says
// the stack filters there by reverse path (DEV_RP_*): without it the program
// does not look. Set it after writing such an entry and clear it after the
// last one is gone. A generation of 0 (caches off) carries no flag: the
// program then always looks.
func (g *FibGen) SetReversePath(on bool) error {
	if err := g.setFlag(reversePath, on); err != nil {
		return fmt.Errorf("tell the program about reverse-path filters (%v): %w", on, err)
	}
	return nil
}

// ReversePath tells what SetReversePath last said.
func (g *FibGen) ReversePath() (bool, error) { return g.flag(reversePath) }

// setFlag sets or clears one of genFlags in the high mark and starts a new
// generation that carries it.
func (g *FibGen) setFlag(flag uint32, on bool) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	var high uint32
	if err := g.m.Lookup(fibGenHigh, &high); err != nil {
		return fmt.Errorf("read the FIB generation: %w", err)
	}
	if (high&flag != 0) == on {
		return nil
	}
	if err := g.m.Put(fibGenHigh, high^flag); err != nil {
		return err
	}
	return g.bumpLocked(false)
}

func (g *FibGen) flag(flag uint32) (bool, error) {
	var high uint32
	if err := g.m.Lookup(fibGenHigh, &high); err != nil {
		return false, fmt.Errorf("read the FIB generation: %w", err)
	}
	return high&flag != 0, nil
}
