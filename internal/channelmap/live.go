package channelmap

import (
	"errors"
	"fmt"
)

// Live is an installed binding with what the program keeps in its slot.
type Live struct {
	// Binding's ReplySource and ReplyPort are what the program learned
	// (invalid: nothing yet), as Dump reports them.
	Binding Binding
	// Stats are what the program relayed for the binding since its slot was
	// given to it; they only grow while the binding stays installed.
	Stats Stats
}

// Live returns the installed bindings with their counters and learned reply
// sources, for those who follow the kernel path's activity per binding
// (internal/ctrefresh). It reads the slots outside the lock, as eachLive
// (readSlots: a few batch lookups for thousands of bindings). A binding
// removed meanwhile is left out: its slot no longer holds the generation it
// was installed with.
func (m *Maps) Live() ([]Live, error) {
	snap, slots, readErrs := m.snapshotSlots()
	out := make([]Live, 0, len(snap))
	var errs []error
	for i, e := range snap {
		if readErrs[i] != nil {
			errs = append(errs, fmt.Errorf("binding %v: %w", e.binding, readErrs[i]))
			continue
		}
		st := &slots[i]
		if st.Gen != e.slotGen {
			continue
		}
		b := e.binding
		b.ReplySource, b.ReplyPort = learned(st)
		out = append(out, Live{Binding: b, Stats: statsOf(st.Stats)})
	}
	return out, errors.Join(errs...)
}
