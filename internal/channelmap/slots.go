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
		// at[id] is id's place in ids plus one (0: not asked for, or read).
		at := make([]int32, next)
		for i, id := range ids {
			if id < next {
				at[id] = int32(i) + 1
			}
		}
		err := m.batchSlots(next, func(id uint32, st *bpf.RelayBindingState) {
			if id < next && at[id] != 0 {
				out[at[id]-1], at[id] = *st, 0
			}
		})
		if err == nil {
			for i, id := range ids {
				if id >= next || at[id] != 0 {
					errs[i] = fmt.Errorf("read the slot of binding %d: not in the slots below %d read", id, next)
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

// batchSlots hands put the slots [0, n) (and up to a batch beyond), read in
// batch lookups of slotBatch.
func (m *Maps) batchSlots(n uint32, put func(id uint32, st *bpf.RelayBindingState)) error {
	keys := make([]uint32, slotBatch)
	vals := make([]bpf.RelayBindingState, slotBatch)
	var cursor ebpf.MapBatchCursor
	for done := uint32(0); done < n; {
		got, err := m.states.BatchLookup(&cursor, keys, vals, nil)
		for j := range got {
			put(keys[j], &vals[j])
			done = max(done, keys[j]+1)
		}
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			return nil // the array's end
		}
		if err != nil {
			return err
		}
		if got == 0 {
			return errors.New("batch lookup of the state slots returned nothing")
		}
	}
	return nil
}
