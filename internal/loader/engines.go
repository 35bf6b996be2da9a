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
// to), and while the kernel path runs anywhere, the TC engine also follows
// the interfaces matching the patterns (pods' host-side veths, tunnels:
// Discover). Where another program holds the XDP hook (another Gateway's
// daemon on the node: the hook takes one program), the TC engine relays on
// the interface alone (ModeTC): tcx (or the cls_bpf filters, clsact) runs
// every daemon's engine in turn, each passing on what is not its own
// (TCX_NEXT, which cls_bpf reads as TC_ACT_UNSPEC: the next filter). Attach
// again tries XDP there, keeping the TC engine in place; YieldXDP is the way
// back to ModeTC (a draining daemon gives the hook to its successor). With no attachment left
// (the kernel path off) the TC engine is detached everywhere: the kernel path
// is either on, with one or both engines, or off.
type Engines struct {
	*Program
	TC       *TC
	patterns []string
	log      *slog.Logger

	mu sync.Mutex
	// tcOnly are the interfaces where the TC engine relays alone, by name.
	tcOnly map[string]bool
	stop   chan struct{}
	ended  chan struct{}
}

// WithTC loads the TC engine over the program's maps, attached as a
// cls_bpf filter after every other (TCAttachAuto, WithTCAttach).
func (p *Program) WithTC(patterns []string, log *slog.Logger) (*Engines, error) {
	return p.WithTCAttach(patterns, TCAttachAuto, log)
}

// WithTCAttach is WithTC with the way the TC engine attaches (LoadTCWith).
func (p *Program) WithTCAttach(patterns []string, how TCAttach, log *slog.Logger) (*Engines, error) {
	tc, err := p.LoadTCWith(how)
	if err != nil {
		return nil, err
	}
	log.Info("TC engine loaded", "attach", tc.AttachMethod())
	swept, err := tc.Swept()
	if len(swept) > 0 {
		log.Info("TC engine: removed the filters a daemon that ended without detaching left", "ifaces", swept)
	}
	if err != nil {
		log.Warn("TC engine: some filters a daemon that ended without detaching left could not be removed", "error", err)
	}
	return &Engines{Program: p, TC: tc, patterns: slices.Clone(patterns), log: log, tcOnly: map[string]bool{}}, nil
}

// TCAttachMethod is how the TC engine attaches: "clsact" (a cls_bpf
// filter, the default) or "tcx" (where asked, 6.6+).
func (e *Engines) TCAttachMethod() TCAttach { return e.TC.AttachMethod() }

// Attach attaches the XDP program (as Program.Attach), then the TC engine to
// the same interface, and starts following the patterns. Where another
// program holds the XDP hook (ErrXDPBusy) it attaches the TC engine alone
// and returns ModeTC; called again there, it tries XDP again.
func (e *Engines) Attach(iface string, mode Mode) (Mode, error) {
	got, err := e.Program.Attach(iface, mode)
	switch {
	case err == nil:
		if err := e.TC.Attach(iface); err != nil {
			e.log.Warn("TC engine not attached beside XDP", "iface", iface, "error", err)
		}
	case errors.Is(err, ErrXDPBusy):
		if tcErr := e.TC.Attach(iface); tcErr != nil {
			return ModeOff, errors.Join(err, tcErr)
		}
		got = ModeTC
	default:
		return got, err
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if got == ModeTC {
		e.tcOnly[iface] = true
	} else {
		delete(e.tcOnly, iface)
	}
	if e.stop == nil && len(e.patterns) > 0 {
		e.stop, e.ended = make(chan struct{}), make(chan struct{})
		if err := e.TC.discover(e.stop, e.ended, e.patterns, e.log); err != nil {
			e.log.Warn("TC engine: no discovery of pods' interfaces", "error", err)
		}
	}
	return got, nil
}

// Attached returns the XDP program's attachments (Program.Attached) and the
// interfaces where the TC engine relays alone, as ModeTC.
func (e *Engines) Attached() map[string]Mode {
	out := e.Program.Attached()
	e.mu.Lock()
	defer e.mu.Unlock()
	tc := e.TC.Attached()
	for iface := range e.tcOnly {
		if _, ok := out[iface]; ok || !slices.Contains(tc, iface) {
			continue
		}
		out[iface] = ModeTC
	}
	return out
}

// YieldXDP gives the interface's XDP hook up to another daemon (a rolling
// update's successor) and keeps relaying there with the TC engine alone
// (ModeTC): the sessions this daemon still holds stay in the kernel, behind
// the successor's program, which passes what is not its own. Attach takes
// the hook back.
func (e *Engines) YieldXDP(iface string) error {
	if err := e.Program.Detach(iface); err != nil {
		return err
	}
	e.mu.Lock()
	e.tcOnly[iface] = true
	e.mu.Unlock()
	return e.TC.Attach(iface)
}

// Detach detaches both engines from the interface; the last detach ends the
// discovery and detaches the TC engine everywhere.
func (e *Engines) Detach(iface string) error {
	errs := []error{e.TC.Detach(iface), e.Program.Detach(iface)}
	e.mu.Lock()
	delete(e.tcOnly, iface)
	last := len(e.tcOnly) == 0
	e.mu.Unlock()
	if last && len(e.Program.Attached()) == 0 {
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
	clear(e.tcOnly)
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
