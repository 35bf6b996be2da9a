package offload

import (
	"log/slog"

	"github.com/l7mp/stunnerd-xdp/internal/loader"
	"github.com/l7mp/stunnerd-xdp/internal/mirror"
)

// loader.Engines is a Program too: the XDP program with the TC engine beside it.
var _ TCProgram = (*loader.Engines)(nil)

// TCProgram is a Program with the TC engine loaded beside the XDP program
// (LoadEngines); a Program without it (LoadXDP, or a TC engine that did not
// load) has no TC counters to report.
type TCProgram interface {
	Program
	// TCVerdicts are the TC engine's verdict counters, summed over CPUs,
	// indexed as loader.TC.Verdicts.
	TCVerdicts() ([]uint64, error)
}

// LoadEngines is LoadXDP with the TC engine (bpf/relay_tc.c) loaded over the
// same maps: attached wherever XDP is, and, while XDP is attached anywhere,
// to the interfaces matching podPatterns (pods' host-side veths, tunnels) as
// they come and go. A TC engine that does not load leaves XDP alone.
func LoadEngines(log *slog.Logger, podPatterns []string) LoadFunc {
	return func(cfg loader.Config) (Program, mirror.Offload, error) {
		p, err := loader.Load(cfg, log)
		if err != nil {
			return nil, nil, err
		}
		e, err := p.WithTC(podPatterns, log)
		if err != nil {
			log.Warn("TC engine not loaded: the kernel path is XDP alone", "error", err)
			return p, mapsOf(p), nil
		}
		return e, mapsOf(p), nil
	}
}
