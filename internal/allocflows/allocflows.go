// Package allocflows keeps a daemon's UDP allocations, the 5-tuples pion/turn
// relays for (client, listener socket), in the BPF hash map the relay
// programs read as alloc_flows: the listener shield drops ChannelData from a
// client with no allocation there, which pion/turn would discard, before it
// reaches a socket. The map outlives the programs (a node label can load them
// long after the first allocation), so it is created with the daemon and
// written from pion/turn's allocation hooks, before the Allocate is answered.
//
// The table keeps the same set in Go for the read loops' shield
// (internal/shield), and serves it alone where there is no BPF. A write to
// the map that fails leaves an allocation out: the table says so (Complete)
// until that allocation ends, and whoever sets the kernel's shield must stop
// it testing allocations, or the client's media would be dropped.
package allocflows

import (
	"errors"
	"fmt"
	"net/netip"
	"sync"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/l7mp/stunnerd-xdp/bpf"
)

// Table is the daemon's UDP allocations, in a BPF map and in Go.
type Table struct {
	m *ebpf.Map // nil: no BPF
	// onChange is called, outside the table's lock, whenever Complete
	// changes.
	onChange func()

	mu  sync.RWMutex
	set map[bpf.SteerFlow]struct{}
	// missing are the live allocations a write to the map left out.
	missing map[bpf.SteerFlow]struct{}
}

// New creates the table and its map, with the relay program's spec of
// alloc_flows. onChange (may be nil) is called whenever Complete changes.
// The table is usable when the map could not be made (the error says why):
// it then keeps the set in Go alone.
func New(onChange func()) (*Table, error) {
	t := &Table{onChange: onChange, set: map[bpf.SteerFlow]struct{}{}, missing: map[bpf.SteerFlow]struct{}{}}
	spec, err := bpf.LoadRelay()
	if err != nil {
		return t, fmt.Errorf("allocation table: %w", err)
	}
	ms, ok := spec.Maps[bpf.RelayMapAllocFlows]
	if !ok {
		return t, errors.New("allocation table: the relay object has no alloc_flows")
	}
	if t.m, err = ebpf.NewMap(ms.Copy()); err != nil {
		return t, fmt.Errorf("allocation table: %w", err)
	}
	return t, nil
}

// Map is the table's map, for the relay programs' alloc_flows (nil: none).
func (t *Table) Map() *ebpf.Map { return t.m }

// Add records the allocation of client on the UDP listener socket bound to
// listener. An error leaves the map incomplete until that allocation is
// removed.
func (t *Table) Add(listener, client netip.AddrPort) error {
	k := key(listener, client)
	t.mu.Lock()
	t.set[k] = struct{}{}
	t.mu.Unlock()
	if t.m == nil {
		return nil
	}
	err := t.m.Put(k, uint32(0))
	if err == nil {
		return nil
	}
	t.mu.Lock()
	t.missing[k] = struct{}{}
	flipped := len(t.missing) == 1
	t.mu.Unlock()
	if flipped && t.onChange != nil {
		t.onChange()
	}
	return fmt.Errorf("allocation of %v on %v: %w", client, listener, err)
}

// Remove forgets the allocation.
func (t *Table) Remove(listener, client netip.AddrPort) error {
	k := key(listener, client)
	t.mu.Lock()
	delete(t.set, k)
	_, wasMissing := t.missing[k]
	delete(t.missing, k)
	flipped := wasMissing && len(t.missing) == 0
	t.mu.Unlock()
	if flipped && t.onChange != nil {
		t.onChange()
	}
	if t.m == nil {
		return nil
	}
	if err := t.m.Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		// A stale entry passes more than it should: never a drop.
		return fmt.Errorf("allocation of %v on %v: %w", client, listener, err)
	}
	return nil
}

// Has tells whether client has an allocation on the listener socket.
func (t *Table) Has(listener, client netip.AddrPort) bool {
	k := key(listener, client)
	t.mu.RLock()
	defer t.mu.RUnlock()
	_, ok := t.set[k]
	return ok
}

// Complete tells whether the map holds every live allocation added (the Go
// set always does).
func (t *Table) Complete() bool {
	t.mu.RLock()
	defer t.mu.RUnlock()
	return len(t.missing) == 0
}

// Close frees the map (the programs that use it keep it while they live).
func (t *Table) Close() error {
	if t.m == nil {
		return nil
	}
	return t.m.Close()
}

func key(listener, client netip.AddrPort) bpf.SteerFlow {
	return bpf.FlowKey(bpf.FlowGroup(unix.IPPROTO_UDP, listener), client)
}
