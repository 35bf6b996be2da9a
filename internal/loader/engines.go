package loader

import (
	"errors"
	"log/slog"
	"slices"
	"sync"
)

// Engines is the XDP program with the TC engine beside it, as one program to
// attach: on every interface the XDP program is attached to, the TC engine is
// attached too (it relays what XDP passed for an egress XDP cannot transmit
// to), and while the XDP program is attached anywhere, the TC engine also
// follows the interfaces matching the patterns (pods' host-side veths,
// tunnels: Discover). With no XDP attachment left (the kernel path off, or
// handed over) the TC engine is detached everywhere: the kernel path is
// either on, with both engines, or off.
type Engines struct {
	*Program
	TC       *TC
	patterns []string
	log      *slog.Logger

	mu    sync.Mutex
	stop  chan struct{}
	ended chan struct{}
}

// WithTC loads the TC engine over the program's maps.
func (p *Program) WithTC(patterns []string, log *slog.Logger) (*Engines, error) {
	tc, err := p.LoadTC()
	if err != nil {
		return nil, err
	}
	return &Engines{Program: p, TC: tc, patterns: slices.Clone(patterns), log: log}, nil
}

// Attach attaches the XDP program (as Program.Attach), then the TC engine to
// the same interface, and starts following the patterns.
func (e *Engines) Attach(iface string, mode Mode) (Mode, error) {
	got, err := e.Program.Attach(iface, mode)
	if err != nil {
		return got, err
	}
	if err := e.TC.Attach(iface); err != nil {
		e.log.Warn("TC engine not attached beside XDP", "iface", iface, "error", err)
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.stop == nil && len(e.patterns) > 0 {
		e.stop, e.ended = make(chan struct{}), make(chan struct{})
		if err := e.TC.discover(e.stop, e.ended, e.patterns, e.log); err != nil {
			e.log.Warn("TC engine: no discovery of pods' interfaces", "error", err)
		}
	}
	return got, nil
}

// Detach detaches both engines from the interface; the last XDP detach ends
// the discovery and detaches the TC engine everywhere.
func (e *Engines) Detach(iface string) error {
	errs := []error{e.TC.Detach(iface), e.Program.Detach(iface)}
	if len(e.Program.Attached()) == 0 {
		errs = append(errs, e.stopTC())
	}
	return errors.Join(errs...)
}

// stopTC ends the discovery (waiting until it attaches nothing more) and
// detaches the TC engine from every interface.
func (e *Engines) stopTC() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.stop != nil {
		close(e.stop)
		<-e.ended
		e.stop, e.ended = nil, nil
	}
	var errs []error
	for _, name := range e.TC.Attached() {
		errs = append(errs, e.TC.Detach(name))
	}
	return errors.Join(errs...)
}

// Reconfigure reloads both engines with the new configuration.
func (e *Engines) Reconfigure(cfg Config) error {
	if err := e.Program.Reconfigure(cfg); err != nil {
		return err
	}
	return e.TC.Reconfigure(e.Program)
}

// TCVerdicts returns the TC engine's verdict counters (TC.Verdicts): the
// second engine's relays and passes, which the XDP program's counters do not
// see.
func (e *Engines) TCVerdicts() ([]uint64, error) { return e.TC.Verdicts() }

// Close detaches both engines everywhere and frees them.
func (e *Engines) Close() error {
	err := e.stopTC()
	return errors.Join(err, e.TC.Close(), e.Program.Close())
}
