package channelmap

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"

	"github.com/cilium/ebpf"

	"github.com/l7mp/stunnerd-xdp/bpf"
)

// Errors of Charge callers branch on.
var (
	// ErrNoChargeProgram: the maps were made without the charge program
	// (SetCharge): userspace cannot charge the engines' buckets.
	ErrNoChargeProgram = errors.New("no charge program for the rate-limit buckets")
	// ErrNoBucket: the id is outside alloc_rates (not one HoldAlloc gave).
	ErrNoBucket = errors.New("no rate-limit bucket with this allocation id")
)

// One bucket per allocation for both paths: the engines charge a bound packet
// to the bucket its binding names (alloc_id); pion/turn's relay in userspace
// charges what it relays for the allocation to the same bucket, through the
// charge program (bpf/charge.c, run with BPF_PROG_RUN: the check and the
// charge under the bucket's lock, as the engines do them). A relay socket
// holds its allocation's id for as long as it is open (HoldAlloc), whether or
// not a binding of the allocation is installed, so that an allocation never
// changes buckets while it relays; its bindings take the same id.

// SetCharge gives the maps the charge program loaded over their rate-limit
// maps (loader.Program.Charge).
func (m *Maps) SetCharge(p *ebpf.Program) { m.charge.Store(p) }

// HoldAlloc returns the bucket id of the allocation relayed at relay and keeps
// it until ReleaseAlloc, whatever its bindings do. Holding it twice is holding
// it once. ErrFull: every id is taken (by --max-bindings allocations).
func (m *Maps) HoldAlloc(relay netip.AddrPort) (uint32, error) {
	relay = unmap(relay)
	m.mu.Lock()
	defer m.mu.Unlock()
	if r := m.allocs[relay]; r != nil && r.held {
		return r.id, nil
	}
	id, err := m.acquireAlloc(relay)
	if err != nil {
		return 0, fmt.Errorf("rate-limit bucket of allocation %v: %w", relay, err)
	}
	m.allocs[relay].held = true
	return id, nil
}

// ReleaseAlloc drops HoldAlloc's hold: the id goes back once no binding of
// the allocation holds it either.
func (m *Maps) ReleaseAlloc(relay netip.AddrPort) {
	relay = unmap(relay)
	m.mu.Lock()
	defer m.mu.Unlock()
	if r := m.allocs[relay]; r != nil && r.held {
		r.held = false
		m.releaseAlloc(relay)
	}
}

// Charge charges a datagram of dataLen bytes of application data to bucket
// id, as the engines charge a packet they relay, and tells whether it is over
// the limit (then nothing is charged). No limit set: never over.
func (m *Maps) Charge(id uint32, dataLen int) (over bool, err error) {
	p := m.charge.Load()
	if p == nil {
		return false, ErrNoChargeProgram
	}
	// struct charge_args, padded to the 14 bytes BPF_PROG_RUN takes at
	// least; host order, as the program reads it.
	var in [14]byte
	binary.NativeEndian.PutUint32(in[0:4], id)
	binary.NativeEndian.PutUint32(in[4:8], uint32(min(max(dataLen, 0), 0xFFFF)))
	ret, err := p.Run(&ebpf.RunOptions{Data: in[:]})
	if err != nil {
		return false, fmt.Errorf("charge bucket %d: %w", id, err)
	}
	switch bpf.ChargeChargeVerdict(ret) {
	case bpf.ChargeChargeVerdictCHARGE_OK:
		return false, nil
	case bpf.ChargeChargeVerdictCHARGE_OVER:
		return true, nil
	case bpf.ChargeChargeVerdictCHARGE_NO_BUCKET:
		return false, fmt.Errorf("charge bucket %d: %w", id, ErrNoBucket)
	}
	return false, fmt.Errorf("charge bucket %d: verdict %d", id, ret)
}
