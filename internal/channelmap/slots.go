package channelmap

import (
	"errors"
	"fmt"

	"github.com/cilium/ebpf"

	"github.com/l7mp/stunnerd-xdp/bpf"
)

// slotBatch is how many state slots one batch lookup reads (128 KiB).
const slotBatch = 1024

// slotsDense: ids are read in batches from slot 0 while the slots up to the
// highest id given out are at most this many times the ids asked for. Ids
// are handed out from 0 up and reused after their quarantine, so an installed
// set is dense unless most bindings of a past peak are gone.
const slotsDense = 4

// readSlots reads the state slots of ids into out (the same length, the same
// order): what the program learned and counted for each. Thousands of
// bindings are read by a few batch lookups of the slot array rather than a
// system call each (metrics, the connection-tracking refresh and GateFlows
// read them all every few seconds); a sparse set, or a kernel without batch
// lookups of arrays, is read one by one. Called without mu: the program owns
// the slots, and callers check what they read against their snapshot.
// errs[i] is id i's error (nil if read).
func (m *Maps) readSlots(ids []uint32, next uint32, out []bpf.RelayBindingState) []error {
	errs := make([]error, len(ids))
	if batchable(len(ids), next) {
		slots, err := m.batchSlots(next)
		if err == nil {
			for i, id := range ids {
				if id < uint32(len(slots)) {
					out[i] = slots[id]
				} else {
					errs[i] = fmt.Errorf("read the slot of binding %d: beyond the %d read", id, len(slots))
				}
			}
			return errs
		}
		// Batch lookups of arrays are from Linux 5.6: take the slow way.
	}
	for i, id := range ids {
		if err := m.states.Lookup(id, &out[i]); err != nil {
			errs[i] = fmt.Errorf("read the slot of binding %d: %w", id, err)
		}
	}
	return errs
}

// batchable tells whether n ids below next are read in batches: enough of
// them to fill a quarter batch, and dense enough.
func batchable(n int, next uint32) bool {
	return n >= slotBatch/slotsDense && int(next) <= slotsDense*n
}

// batchSlots reads slots [0, n) in batches of slotBatch.
func (m *Maps) batchSlots(n uint32) ([]bpf.RelayBindingState, error) {
	slots := make([]bpf.RelayBindingState, n)
	keys := make([]uint32, slotBatch)
	vals := make([]bpf.RelayBindingState, slotBatch)
	var cursor ebpf.MapBatchCursor
	for done := uint32(0); done < n; {
		got, err := m.states.BatchLookup(&cursor, keys, vals, nil)
		for j := range got {
			if keys[j] < n {
				slots[keys[j]] = vals[j]
			}
			done = max(done, keys[j]+1)
		}
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			break // the array's end
		}
		if err != nil {
			return nil, err
		}
		if got == 0 {
			return nil, errors.New("batch lookup of the state slots returned nothing")
		}
	}
	return slots, nil
}
