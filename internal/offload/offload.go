// Package offload owns the XDP mode: whether the relay program runs, where
// and how. Sessions never notice a change: pion/turn keeps every allocation
// and socket either way; only where the packets of bound channels are relayed
// moves. The program is loaded on the first attach and kept (with its maps)
// until Close, so flipping back and forth costs an attach, not a load.
//
// The Manager is the only caller of the loader's attach and detach and of the
// mirror's SetOffload. It decides the mode from its inputs, highest first:
//
//	| # | input                                            | mode                                         |
//	|---|--------------------------------------------------|----------------------------------------------|
//	| 1 | a newer daemon serves the node (HandOver)        | off while it lives: no input below turns XDP on |
//	| 2 | node label stunner.l7mp.io/xdp-offload=disabled  | off                                          |
//	| 3 | node label stunner.l7mp.io/xdp-offload=enabled   | the configured mode (4-6), auto if that is off |
//	| 4 | --xdp-mode given on the command line (Flag)      | that mode                                    |
//	| 5 | admin.offload_engine, config file or CDS (SetConfig) | that mode                                |
//	| 6 | nothing says                                     | auto                                         |
//
// The label is the operator's live switch for one node, so it beats the pod
// template's flag and the fleet-wide config; a flag written on the command
// line pins the mode against config pushes (as every other flag does). Row 1
// holds from HandOver until TakeBack: a draining daemon gives the hook to its
// successor, and takes it back if the successor dies before it (then rows 2-6
// decide again, and the program, kept loaded, is attached again). While rows
// 2-6 would run XDP, a program with a TC engine (Yielder) keeps it relaying
// the daemon's own sessions where XDP was (mode tc), behind the successor's
// program: a rollout's drain costs no userspace CPU. Attach
// failures do not change the mode: an interface that cannot take the program
// (another daemon holds it during a rolling update, it does not exist yet) is
// served from userspace and tried again by Retry, on a timer and on link
// events, for as long as the mode wants XDP. A program the kernel refuses
// (its verifier, a helper or attach type it lacks: ErrRefused) is not loaded
// again: the answer does not change until the load-time configuration does
// (Reconfigure). Whatever keeps bindings off the kernel path is said by
// Unavailable, as the mirror's reason for them (off, program_refused,
// no_kernel_path).
package offload

import (
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/l7mp/stunnerd-xdp/internal/channelmap"
	"github.com/l7mp/stunnerd-xdp/internal/loader"
	"github.com/l7mp/stunnerd-xdp/internal/mirror"
	"github.com/l7mp/stunnerd-xdp/internal/nodelabel"
)

// Errors callers branch on.
var (
	// ErrHandedOver: an input asks for XDP while the hook is handed over to
	// the newer daemon on the node; the mode stays off until TakeBack.
	ErrHandedOver = errors.New("XDP was handed over to the newer daemon on this node")
	// ErrNoInterfaces: XDP is wanted but no interface carries the listener
	// and relay addresses, and none was named.
	ErrNoInterfaces = errors.New("no interfaces to attach XDP to")
	// ErrNotAttached: XDP is wanted but no interface took the program; the
	// error wraps each interface's reason. Retry tries again.
	ErrNotAttached = errors.New("no interface took the XDP program")
	// ErrClosed: an input came after Close (a late label event); nothing is
	// attached.
	ErrClosed = errors.New("offload manager closed")
)

// Program is the loaded relay program (loader.Program).
type Program interface {
	Attach(iface string, mode loader.Mode) (loader.Mode, error)
	Detach(iface string) error
	// Attached returns the mode per interface the program runs on now.
	Attached() map[string]loader.Mode
	// Reconfigure reloads the program over its maps with a new load-time
	// configuration.
	Reconfigure(loader.Config) error
	Close() error
}

// Yielder is a Program that can give an interface's XDP hook up and go on
// relaying there with its TC engine alone (loader.Engines): what a daemon
// does for its successor, so that its own sessions stay in the kernel.
type Yielder interface {
	YieldXDP(iface string) error
}

var _ Yielder = (*loader.Engines)(nil)

// LoadFunc loads the program and returns it with its binding maps.
type LoadFunc func(loader.Config) (Program, mirror.Offload, error)

// Sink is where the binding maps go: the manager is their one owner and
// hands them to their writers here only. Both calls come with the manager's
// lock held: a Sink must not call the manager back.
type Sink interface {
	// SetOffload receives the maps while the program runs anywhere and nil
	// otherwise: where the bindings go (mirror.Mirror).
	SetOffload(mirror.Offload)
	// SetMaps receives the maps once loaded and nil before they are freed:
	// the tables that must be in place before the program runs anywhere,
	// and stay while it does not (accepted destinations, the rate limit).
	SetMaps(mirror.Offload)
}

// loader.Program is the Program the daemon runs.
var _ Program = (*loader.Program)(nil)

// LoadXDP loads the real program (loader.Load) with channelmap over its maps.
func LoadXDP(log *slog.Logger) LoadFunc {
	return func(cfg loader.Config) (Program, mirror.Offload, error) {
		p, err := loader.Load(cfg, log)
		if err != nil {
			return nil, nil, err
		}
		return p, mapsOf(p), nil
	}
}

// mapsOf is channelmap over p's maps, with p's charge program: userspace
// charges what it relays to the buckets the engines charge.
func mapsOf(p *loader.Program) *channelmap.Maps {
	m := channelmap.New(p.Maps())
	m.SetCharge(p.Charge())
	m.SetFibGen(p.FibGen())
	return m
}

// Options configure a Manager.
type Options struct {
	Log  *slog.Logger
	Load LoadFunc
	Sink Sink
	// Program is the load-time configuration (listener ports, relay range).
	Program loader.Config
	// Interfaces are the interfaces XDP is attached to.
	Interfaces []string
	// Flag is --xdp-mode when given on the command line; empty otherwise.
	Flag loader.Mode
	// Config is admin.offload_engine's mode at start; empty when unsaid.
	Config loader.Mode
}

// inputs are what the mode is decided from.
type inputs struct {
	flag, config loader.Mode
	label        nodelabel.Offload
	handedOver   bool
}

// mode applies the precedence table of the package comment.
func (in inputs) mode() loader.Mode {
	if in.handedOver {
		return loader.ModeOff
	}
	configured := loader.ModeAuto
	if in.config != "" {
		configured = in.config
	}
	if in.flag != "" {
		configured = in.flag
	}
	switch in.label {
	case nodelabel.Detach:
		return loader.ModeOff
	case nodelabel.Attach:
		if configured == loader.ModeOff {
			return loader.ModeAuto
		}
	}
	return configured
}

// Manager decides the XDP mode and applies it.
type Manager struct {
	log    *slog.Logger
	load   LoadFunc
	sink   Sink
	ifaces []string

	mu  sync.Mutex
	cfg loader.Config
	in  inputs
	// applied is the mode last applied; "" before the first Start.
	applied loader.Mode
	prog    Program
	maps    mirror.Offload
	// offloaded says the sink has the maps. It changes only when the
	// program starts or stops running anywhere: moving the bindings costs a
	// write per binding and forgets what the program learned about each.
	offloaded bool
	failed    map[string]string // last attach error per interface, to log each once
	// refused is the kernel's refusal of the program (ErrRefused's cause):
	// set, it is not loaded again until Reconfigure changes the config.
	refused error
	// why is Unavailable's answer, written under mu after every change and
	// read without it (the mirror asks at scrape time, under its own lock,
	// which the manager's calls into the sink wait for).
	why atomic.Value // string
	// attachRefused are the interfaces whose driver refused the mode:
	// Retry's timer skips them, a link event or an input tries again.
	attachRefused map[string]bool
	// closed: Close ran; no input loads or attaches the program again.
	closed bool
}

// New builds a manager that serves from userspace until Start.
func New(o Options) *Manager {
	m := &Manager{
		log: o.Log, load: o.Load, sink: o.Sink, ifaces: append([]string(nil), o.Interfaces...),
		cfg: o.Program, in: inputs{flag: o.Flag, config: o.Config}, failed: map[string]string{},
		attachRefused: map[string]bool{},
	}
	m.why.Store(mirror.ReasonNoKernelPath) // not started: nothing is attached yet
	return m
}

// Start applies the mode the inputs give. An error says why XDP is not
// attached anywhere although the mode wants it; sessions are served from
// userspace meanwhile and Retry keeps trying.
func (m *Manager) Start() error { return m.update(func(*inputs) {}) }

// SetConfig records the config's offload_engine (empty: the config does not
// say) and applies the resulting mode.
func (m *Manager) SetConfig(mode loader.Mode) error {
	return m.set(func(in *inputs) { in.config = mode })
}

// SetLabel records what the node label asks for and applies the resulting
// mode.
func (m *Manager) SetLabel(o nodelabel.Offload) error {
	return m.set(func(in *inputs) { in.label = o })
}

// HandOver turns XDP off until TakeBack: a newer daemon on the node takes
// the hook. It reports whether the program was attached anywhere.
func (m *Manager) HandOver() (wasAttached bool, err error) {
	m.mu.Lock()
	done := m.in.handedOver
	wasAttached = len(m.attachedLocked()) > 0
	m.mu.Unlock()
	if done {
		return false, nil
	}
	return wasAttached, m.update(func(in *inputs) { in.handedOver = true })
}

// TakeBack ends a hand-over (the newer daemon is gone): the other inputs
// decide the mode again. It reports whether a hand-over was in force; the
// error is the attach's (Retry keeps trying).
func (m *Manager) TakeBack() (wasHandedOver bool, err error) {
	m.mu.Lock()
	wasHandedOver = m.in.handedOver
	m.mu.Unlock()
	if !wasHandedOver {
		return false, nil
	}
	return true, m.update(func(in *inputs) { in.handedOver = false })
}

// HandedOver reports whether a hand-over is in force (HandOver without a
// TakeBack since).
func (m *Manager) HandedOver() bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.in.handedOver
}

// update changes the inputs and applies the mode they give.
func (m *Manager) update(change func(*inputs)) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return ErrClosed
	}
	change(&m.in)
	clear(m.attachRefused) // another mode may be taken
	mode := m.in.mode()
	if mode != m.applied {
		m.log.Info("XDP mode", "mode", string(mode), "was", string(m.applied), "flag", string(m.in.flag),
			"config", string(m.in.config), "label", m.in.label.String(), "handed_over", m.in.handedOver)
	}
	return m.applyLocked(mode)
}

// Unavailable says why bindings are not on the kernel path, as the mirror
// counts them (mirror.ReasonOff, ReasonRefused, ReasonNoKernelPath), and ""
// while they are: the program is attached somewhere (XDP or the TC engine).
// It never blocks.
func (m *Manager) Unavailable() string { return m.why.Load().(string) }

// Loaded says whether the program is loaded (attached or not).
func (m *Manager) Loaded() bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.prog != nil
}

// Refused returns the kernel's refusal of the program (wrapped in
// ErrRefused), nil when it loaded or was not tried.
func (m *Manager) Refused() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.refused == nil {
		return nil
	}
	return fmt.Errorf("%w: %w", ErrRefused, m.refused)
}

// setWhyLocked records what Unavailable says now.
func (m *Manager) setWhyLocked() {
	why := ""
	switch {
	case m.offloaded:
	case m.applied == loader.ModeOff || m.closed:
		why = mirror.ReasonOff
	case m.refused != nil && m.prog == nil:
		why = mirror.ReasonRefused
	default:
		why = mirror.ReasonNoKernelPath
	}
	m.why.Store(why)
}

// set is update for the inputs a hand-over overrides: it says so.
func (m *Manager) set(change func(*inputs)) error {
	if err := m.update(change); err != nil {
		return err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.in.handedOver && inputsWantXDP(m.in) {
		return ErrHandedOver
	}
	return nil
}

// inputsWantXDP says whether the inputs would run XDP but for the hand-over.
func inputsWantXDP(in inputs) bool {
	in.handedOver = false
	return in.mode() != loader.ModeOff
}

// Retry attaches where the mode wants XDP and the program is not attached,
// or the TC engine relays alone: another daemon's program still holds the
// interface, or the interface came later, or was deleted and created again.
// Bindings stay where they are. An interface whose driver refused the mode
// (EOPNOTSUPP, EINVAL: no native XDP, an MTU it cannot take) is left alone
// until a link event (LinkChanged) or another input.
func (m *Manager) Retry() {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.retryLocked()
}

// LinkChanged is Retry after a link event: a device came, went, or changed
// (its MTU, its driver), so interfaces whose driver refused the mode are
// tried again too.
func (m *Manager) LinkChanged() {
	m.mu.Lock()
	defer m.mu.Unlock()
	clear(m.attachRefused)
	m.retryLocked()
}

func (m *Manager) retryLocked() {
	if m.prog == nil && m.refused != nil {
		return // the kernel's answer stands (Reconfigure asks again)
	}
	missing := slices.DeleteFunc(m.missingLocked(), func(iface string) bool { return m.attachRefused[iface] })
	if !m.closed && m.applied != loader.ModeOff && m.applied != "" && (len(missing) > 0 || m.tcOnlyLocked()) {
		_ = m.applyLocked(m.applied) // applyLocked logs what changed
	}
}

// tcOnlyLocked says whether the TC engine relays alone somewhere: XDP is
// to be tried there again.
func (m *Manager) tcOnlyLocked() bool {
	for _, mode := range m.attachedLocked() {
		if mode == loader.ModeTC {
			return true
		}
	}
	return false
}

// Mode returns the mode the inputs give (what Start, the setters and Retry
// apply); the interfaces it runs on are Attached.
func (m *Manager) Mode() loader.Mode {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.in.mode()
}

func (m *Manager) applyLocked(mode loader.Mode) error {
	defer m.setWhyLocked()
	m.applied = mode
	if mode == loader.ModeOff {
		if m.in.handedOver && inputsWantXDP(m.in) && m.yieldLocked() {
			return nil
		}
		return m.disableLocked()
	}
	if len(m.ifaces) == 0 {
		return ErrNoInterfaces
	}
	if m.prog == nil {
		if m.refused != nil {
			return fmt.Errorf("%w: %w", ErrRefused, m.refused)
		}
		prog, maps, err := m.load(m.cfg)
		if err != nil {
			if !refusedByKernel(err) {
				return err // retried: a capability, memory
			}
			m.refused = err
			m.log.Warn("the kernel refused the XDP program: every binding is served from userspace; not loaded again until the program's configuration changes",
				"reason", RefusalReason(err))
			m.log.Debug("the kernel's whole answer", "error", err)
			return fmt.Errorf("%w: %w", ErrRefused, err)
		}
		m.prog, m.maps = prog, maps
		m.sink.SetMaps(maps)
	}
	attached := m.prog.Attached()
	var errs []error
	for _, iface := range m.ifaces {
		was, ok := attached[iface]
		if ok && (was == mode || mode == loader.ModeAuto && was != loader.ModeTC) {
			continue
		}
		if !ok && m.attachRefused[iface] {
			continue // until a link event or another input
		}
		if ok && was != loader.ModeTC {
			// A different mode was asked for: reattach. (Where the TC
			// engine relays alone, Attach tries XDP with it in place.)
			if err := m.prog.Detach(iface); err != nil {
				errs = append(errs, err)
				continue
			}
			delete(attached, iface)
		}
		got, err := m.prog.Attach(iface, mode)
		if err == nil && got == loader.ModeTC {
			attached[iface] = got
			if was != loader.ModeTC {
				m.log.Info("XDP hook held by another program: the TC engine relays on the interface; retrying XDP",
					"iface", iface, "mode", string(got))
			}
			continue
		}
		if err != nil {
			errs = append(errs, err)
			if refusedByKernel(err) && !errors.Is(err, loader.ErrXDPBusy) {
				m.attachRefused[iface] = true
			}
			// Retried while another daemon holds the interface: say each
			// new reason once.
			if m.failed[iface] != err.Error() {
				m.failed[iface] = err.Error()
				m.log.Warn("XDP not attached, interface served from userspace", "iface", iface, "error", err)
			} else {
				m.log.Debug("XDP still not attached", "iface", iface, "error", err)
			}
			continue
		}
		delete(m.failed, iface)
		delete(m.attachRefused, iface)
		attached[iface] = got
		m.log.Info("XDP attached", "iface", iface, "mode", string(got))
	}
	// The bindings go into the maps after the first attach: until then the
	// program passes every packet to pion/turn (it knows no binding), which
	// is the userspace path, so nothing is lost; installing first would move
	// every binding in and out again on each failed retry.
	if len(attached) == 0 {
		m.setOffloadLocked(false)
		return fmt.Errorf("%w: %w", ErrNotAttached, errors.Join(errs...))
	}
	m.setOffloadLocked(true)
	return nil
}

// setOffloadLocked points the sink at the maps (on) or at nothing, when that
// is a change.
func (m *Manager) setOffloadLocked(on bool) {
	if on == m.offloaded {
		return
	}
	m.offloaded = on
	if on {
		m.sink.SetOffload(m.maps)
		return
	}
	m.sink.SetOffload(nil)
}

// yieldLocked gives every XDP hook up to the successor and keeps the TC
// engine relaying there (Yielder), the bindings in the maps: this daemon's
// sessions stay in the kernel for the rest of its drain. It reports whether
// the TC engine relays anywhere; false leaves the rest to disableLocked.
func (m *Manager) yieldLocked() bool {
	y, ok := m.prog.(Yielder)
	if !ok {
		return false
	}
	for iface, mode := range m.attachedLocked() {
		if mode == loader.ModeTC {
			continue
		}
		if err := y.YieldXDP(iface); err != nil {
			m.log.Warn("cannot keep the TC engine where XDP was handed over; the interface's sessions go to userspace", "iface", iface, "error", err)
			if err := m.prog.Detach(iface); err != nil {
				m.log.Warn("detaching", "iface", iface, "error", err)
			}
			continue
		}
		m.log.Info("XDP handed over; the TC engine relays this daemon's sessions on the interface", "iface", iface)
	}
	return len(m.attachedLocked()) > 0
}

func (m *Manager) disableLocked() error {
	var errs []error
	// Detach first: until then the kernel relays with complete maps, and
	// after it pion/turn's relay sockets see every packet.
	for iface := range m.attachedLocked() {
		if err := m.prog.Detach(iface); err != nil {
			errs = append(errs, err)
			continue
		}
		m.log.Info("XDP detached", "iface", iface)
	}
	m.setOffloadLocked(false)
	return errors.Join(errs...)
}

// Close detaches and frees the program and its maps.
func (m *Manager) Close() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.closed = true
	defer m.setWhyLocked()
	err := m.disableLocked()
	if m.prog != nil {
		m.sink.SetMaps(nil)
		err = errors.Join(err, m.prog.Close())
		m.prog, m.maps = nil, nil
	}
	return err
}

// Attached returns the mode of each interface the program runs on now, by
// the interfaces' current names: one renamed since the attach is listed under
// its new name, one deleted is not listed.
func (m *Manager) Attached() map[string]loader.Mode {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.attachedLocked()
}

func (m *Manager) attachedLocked() map[string]loader.Mode {
	if m.prog == nil {
		return map[string]loader.Mode{}
	}
	return m.prog.Attached()
}

// Missing returns the managed interfaces the program is not attached to.
func (m *Manager) Missing() []string {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.missingLocked()
}

func (m *Manager) missingLocked() []string {
	attached := m.attachedLocked()
	var out []string
	for _, iface := range m.ifaces {
		if _, ok := attached[iface]; !ok {
			out = append(out, iface)
		}
	}
	return out
}

// Maps returns the binding maps, nil until the program was first loaded (and
// with a LoadFunc that does not return channelmap's).
func (m *Manager) Maps() *channelmap.Maps {
	m.mu.Lock()
	defer m.mu.Unlock()
	cm, _ := m.maps.(*channelmap.Maps)
	return cm
}

// TCVerdicts returns the TC engine's verdict counters (TCProgram), nil while
// no TC engine is loaded: never loaded, loaded without it, or closed.
func (m *Manager) TCVerdicts() ([]uint64, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if p, ok := m.prog.(TCProgram); ok {
		return p.TCVerdicts()
	}
	return nil, nil
}

// Interfaces returns the interfaces the manager attaches to.
func (m *Manager) Interfaces() []string { return append([]string(nil), m.ifaces...) }

// Reconfigure changes the program's load-time configuration (UDP listener
// ports). A loaded program is reloaded over its maps and swapped into its
// links; otherwise the next attach loads with the new configuration.
func (m *Manager) Reconfigure(cfg loader.Config) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.refused != nil && !sameConfig(m.cfg, cfg) {
		// Other constants, another program for the verifier: the next
		// attach or Retry loads it once more.
		m.refused = nil
		m.setWhyLocked()
	}
	m.cfg = cfg
	if m.prog == nil {
		return nil
	}
	return m.prog.Reconfigure(cfg)
}

// sameConfig says whether two load-time configurations give the verifier the
// same program.
func sameConfig(a, b loader.Config) bool {
	return slices.Equal(a.ListenerPorts, b.ListenerPorts) && a.MinRelayPort == b.MinRelayPort &&
		a.MaxRelayPort == b.MaxRelayPort && a.MaxBindings == b.MaxBindings && a.IPv6Clients == b.IPv6Clients &&
		a.NoFlowCache == b.NoFlowCache && a.Object == b.Object
}

// TCAttacher is a program whose TC engine says how it is attached
// (loader.Engines): "clsact" (a cls_bpf filter on the clsact qdisc, the
// default) or "tcx" (a bpf_link, 6.6+, where asked).
type TCAttacher interface {
	TCAttachMethod() loader.TCAttach
}

// TCEngine says whether the TC engine is loaded beside the XDP program and
// how it attaches ("tcx", "clsact"; "" when the program does not say).
func (m *Manager) TCEngine() (loaded bool, attach string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if _, ok := m.prog.(TCProgram); !ok {
		return false, ""
	}
	if a, ok := m.prog.(TCAttacher); ok {
		return true, string(a.TCAttachMethod())
	}
	return true, ""
}
