package channelmap

import (
	"errors"
	"fmt"

	"github.com/l7mp/stunnerd-xdp/bpf"
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
// (internal/ctrefresh). It costs one map lookup per binding, outside the
// lock, as eachLive. A binding removed meanwhile is left out: its slot no
// longer holds the generation it was installed with.
func (m *Maps) Live() ([]Live, error) {
	m.mu.Lock()
	snap := make([]entry, 0, len(m.bindings))
	for _, e := range m.bindings {
		snap = append(snap, e)
	}
	m.mu.Unlock()

	out := make([]Live, 0, len(snap))
	var (
		errs []error
		st   bpf.RelayBindingState
	)
	for _, e := range snap {
		if err := m.states.Lookup(e.id, &st); err != nil {
			errs = append(errs, fmt.Errorf("read the slot of binding %v: %w", e.binding, err))
			continue
		}
		if st.Gen != e.slotGen {
			continue
		}
		b := e.binding
		b.ReplySource, b.ReplyPort = learned(&st)
		out = append(out, Live{Binding: b, Stats: statsOf(st.Stats)})
	}
	return out, errors.Join(errs...)
}
