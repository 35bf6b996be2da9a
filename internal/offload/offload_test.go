package offload

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"sync"
	"testing"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/l7mp/stunnerd-xdp/internal/loader"
	"github.com/l7mp/stunnerd-xdp/internal/mirror"
	"github.com/l7mp/stunnerd-xdp/internal/nodelabel"
)

var errBusy = errors.New("device busy")

// fakeProgram stands in for loader.Program: interfaces in busy refuse the
// attach, the others take it (auto becomes native).
type fakeProgram struct {
	mu       sync.Mutex
	attached map[string]loader.Mode
	busy     map[string]bool
	// tc are busy interfaces where the TC engine relays alone (Engines).
	tc       map[string]bool
	attaches int
	cfg      loader.Config
	closed   bool
}

func (p *fakeProgram) Attach(iface string, mode loader.Mode) (loader.Mode, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.attaches++
	if p.busy[iface] && p.tc[iface] {
		p.attached[iface] = loader.ModeTC
		return loader.ModeTC, nil
	}
	if p.busy[iface] {
		return "", fmt.Errorf("attach %s: %w", iface, errBusy)
	}
	if mode == loader.ModeAuto {
		mode = loader.ModeNative
	}
	p.attached[iface] = mode
	return mode, nil
}

func (p *fakeProgram) Detach(iface string) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	delete(p.attached, iface)
	return nil
}

func (p *fakeProgram) Attached() map[string]loader.Mode {
	p.mu.Lock()
	defer p.mu.Unlock()
	return maps.Clone(p.attached)
}

func (p *fakeProgram) Reconfigure(cfg loader.Config) error { p.cfg = cfg; return nil }
func (p *fakeProgram) Close() error                        { p.closed = true; return nil }

func (p *fakeProgram) setBusy(iface string, busy bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.busy[iface] = busy
}

// fakeMaps is the binding maps the sink receives.
type fakeMaps struct{ mirror.Offload }

// sink records what the mirror would be given.
type sink struct {
	got   []mirror.Offload
	calls int
	maps  mirror.Offload // what SetMaps gave last
}

func (s *sink) SetOffload(o mirror.Offload) { s.got = append(s.got, o); s.calls++ }
func (s *sink) SetMaps(o mirror.Offload)    { s.maps = o }

func (s *sink) current() mirror.Offload {
	if len(s.got) == 0 {
		return nil
	}
	return s.got[len(s.got)-1]
}

type fixture struct {
	m     *Manager
	prog  *fakeProgram
	maps  *fakeMaps
	sink  *sink
	loads int
}

func newFixture(t *testing.T, flag, config loader.Mode, ifaces ...string) *fixture {
	t.Helper()
	if len(ifaces) == 0 {
		ifaces = []string{"eth0", "eth1"}
	}
	f := &fixture{prog: &fakeProgram{attached: map[string]loader.Mode{}, busy: map[string]bool{}}, maps: &fakeMaps{}, sink: &sink{}}
	f.m = New(Options{
		Log: slog.New(slog.NewTextHandler(io.Discard, nil)),
		Load: func(loader.Config) (Program, mirror.Offload, error) {
			f.loads++
			return f.prog, f.maps, nil
		},
		Sink: f.sink, Interfaces: ifaces, Flag: flag, Config: config,
	})
	t.Cleanup(func() { _ = f.m.Close() })
	return f
}

// want checks the mode, where the program runs and what the mirror writes to.
func (f *fixture) want(t *testing.T, mode loader.Mode) {
	t.Helper()
	if got := f.m.Mode(); got != mode {
		t.Errorf("mode %q, want %q", got, mode)
	}
	attached := f.m.Attached()
	if mode == loader.ModeOff {
		if len(attached) != 0 || f.sink.current() != nil {
			t.Errorf("mode off: attached %v, mirror writes to %v", attached, f.sink.current())
		}
		return
	}
	want := mode
	if mode == loader.ModeAuto {
		want = loader.ModeNative
	}
	for _, iface := range f.m.Interfaces() {
		if attached[iface] != want {
			t.Errorf("%s attached %q, want %q (all: %v)", iface, attached[iface], want, attached)
		}
	}
	if f.sink.current() != f.maps {
		t.Errorf("mode %q: the mirror writes to %v, want the maps", mode, f.sink.current())
	}
}

// TestPrecedence has one case per row of the package comment's table.
func TestPrecedence(t *testing.T) {
	for _, c := range []struct {
		name         string
		flag, config loader.Mode
		label        nodelabel.Offload
		handOver     bool
		takeBack     bool // the successor died after the hand-over
		want         loader.Mode
	}{
		{name: "1 hand-over beats an enabled label", flag: loader.ModeNative, label: nodelabel.Attach, handOver: true, want: loader.ModeOff},
		{name: "1 taken back: the enabled label decides again", flag: loader.ModeOff, label: nodelabel.Attach, handOver: true, takeBack: true, want: loader.ModeAuto},
		{name: "1 taken back: the flag decides again", flag: loader.ModeGeneric, handOver: true, takeBack: true, want: loader.ModeGeneric},
		{name: "1 taken back: a disabled label still wins", flag: loader.ModeNative, label: nodelabel.Detach, handOver: true, takeBack: true, want: loader.ModeOff},
		{name: "2 disabled label beats the flag", flag: loader.ModeGeneric, label: nodelabel.Detach, want: loader.ModeOff},
		{name: "2 disabled label beats the config", config: loader.ModeAuto, label: nodelabel.Detach, want: loader.ModeOff},
		{name: "3 enabled label keeps the configured mode", flag: loader.ModeGeneric, label: nodelabel.Attach, want: loader.ModeGeneric},
		{name: "3 enabled label beats --xdp-mode=off", flag: loader.ModeOff, label: nodelabel.Attach, want: loader.ModeAuto},
		{name: "3 enabled label beats offload_engine None", config: loader.ModeOff, label: nodelabel.Attach, want: loader.ModeAuto},
		{name: "4 flag beats config", flag: loader.ModeNative, config: loader.ModeOff, want: loader.ModeNative},
		{name: "4 flag off beats config", flag: loader.ModeOff, config: loader.ModeAuto, want: loader.ModeOff},
		{name: "5 config without flag", config: loader.ModeGeneric, want: loader.ModeGeneric},
		{name: "5 config off without flag", config: loader.ModeOff, want: loader.ModeOff},
		{name: "6 nothing says: auto", want: loader.ModeAuto},
	} {
		t.Run(c.name, func(t *testing.T) {
			f := newFixture(t, c.flag, c.config)
			if err := f.m.Start(); err != nil {
				t.Fatal(err)
			}
			if c.handOver {
				if _, err := f.m.HandOver(); err != nil {
					t.Fatal(err)
				}
			}
			err := f.m.SetLabel(c.label)
			switch {
			case c.takeBack:
				if err != nil && c.label != nodelabel.Detach && !errors.Is(err, ErrHandedOver) {
					t.Fatal(err)
				}
				if was, err := f.m.TakeBack(); !was || err != nil {
					t.Fatalf("take back: %v, %v; want true, nil", was, err)
				}
			case c.handOver && !errors.Is(err, ErrHandedOver):
				t.Errorf("label after the hand-over: %v, want ErrHandedOver", err)
			case !c.handOver && err != nil:
				t.Fatal(err)
			}
			f.want(t, c.want)
		})
	}
}

// TestConfigReloadKeepsLabel: a config push that changes offload_engine
// changes the configured mode, which the node label overrides, in both
// directions (it used to switch XDP over the label's head).
func TestConfigReloadKeepsLabel(t *testing.T) {
	f := newFixture(t, "", loader.ModeOff)
	if err := f.m.Start(); err != nil {
		t.Fatal(err)
	}
	if err := f.m.SetLabel(nodelabel.Detach); err != nil {
		t.Fatal(err)
	}
	if err := f.m.SetConfig(loader.ModeAuto); err != nil {
		t.Fatal(err)
	}
	f.want(t, loader.ModeOff)

	if err := f.m.SetLabel(nodelabel.Attach); err != nil {
		t.Fatal(err)
	}
	f.want(t, loader.ModeAuto)
	if err := f.m.SetConfig(loader.ModeOff); err != nil {
		t.Fatal(err)
	}
	f.want(t, loader.ModeAuto)

	// Back to the default: the config decides again.
	if err := f.m.SetLabel(nodelabel.Default); err != nil {
		t.Fatal(err)
	}
	f.want(t, loader.ModeOff)
	if err := f.m.SetConfig(loader.ModeGeneric); err != nil {
		t.Fatal(err)
	}
	f.want(t, loader.ModeGeneric)
}

// TestFlagPinsAgainstConfig: a mode written on the command line is not moved
// by config pushes.
func TestFlagPinsAgainstConfig(t *testing.T) {
	f := newFixture(t, loader.ModeGeneric, loader.ModeOff)
	if err := f.m.Start(); err != nil {
		t.Fatal(err)
	}
	for _, c := range []loader.Mode{loader.ModeAuto, loader.ModeOff, ""} {
		if err := f.m.SetConfig(c); err != nil {
			t.Fatal(err)
		}
		f.want(t, loader.ModeGeneric)
	}
}

// TestHandOverUntilTakeBack: while the hand-over holds no input attaches
// again, and Retry leaves the interfaces to the successor; once the successor
// is gone, TakeBack attaches again where the inputs want it, and a second
// hand-over works as the first.
func TestHandOverUntilTakeBack(t *testing.T) {
	f := newFixture(t, "", "")
	if err := f.m.Start(); err != nil {
		t.Fatal(err)
	}
	was, err := f.m.HandOver()
	if err != nil || !was {
		t.Fatalf("hand-over: attached before %v, error %v; want true, nil", was, err)
	}
	f.want(t, loader.ModeOff)
	if was, err := f.m.HandOver(); was || err != nil {
		t.Errorf("second hand-over: %v, %v", was, err)
	}
	if err := f.m.SetConfig(loader.ModeNative); !errors.Is(err, ErrHandedOver) {
		t.Errorf("config after the hand-over: %v, want ErrHandedOver", err)
	}
	if err := f.m.SetLabel(nodelabel.Detach); err != nil {
		t.Errorf("label asking for off after the hand-over: %v", err)
	}
	f.m.Retry()
	f.want(t, loader.ModeOff)
	if !f.m.HandedOver() {
		t.Error("HandedOver false during the hand-over")
	}

	// The successor died: the label asks for off, so nothing attaches yet.
	if was, err := f.m.TakeBack(); !was || err != nil {
		t.Fatalf("take back: %v, %v; want true, nil", was, err)
	}
	f.want(t, loader.ModeOff)
	if err := f.m.SetLabel(nodelabel.Default); err != nil {
		t.Fatal(err)
	}
	f.want(t, loader.ModeNative)
	if was, err := f.m.TakeBack(); was || err != nil {
		t.Errorf("second take back: %v, %v; want false, nil", was, err)
	}
	if f.loads != 1 {
		t.Errorf("%d loads: the program is kept across the hand-over", f.loads)
	}
	// A new successor.
	if was, err := f.m.HandOver(); !was || err != nil {
		t.Fatalf("hand-over after a take back: %v, %v", was, err)
	}
	f.want(t, loader.ModeOff)
}

// TestAttachFailuresRetry: an interface that cannot take the program stays in
// userspace without changing the mode; Retry attaches it once it can, and the
// retries leave the bindings where they are.
func TestAttachFailuresRetry(t *testing.T) {
	f := newFixture(t, "", "")
	f.prog.setBusy("eth0", true)
	f.prog.setBusy("eth1", true)
	err := f.m.Start()
	if !errors.Is(err, ErrNotAttached) || !errors.Is(err, errBusy) {
		t.Fatalf("start with every interface busy: %v, want ErrNotAttached wrapping the reason", err)
	}
	if f.m.Mode() != loader.ModeAuto || f.sink.current() != nil {
		t.Fatalf("mode %q, mirror writes to %v; want auto and nothing while nothing is attached", f.m.Mode(), f.sink.current())
	}

	f.prog.setBusy("eth1", false)
	f.m.Retry()
	if got := f.m.Attached(); len(got) != 1 || got["eth1"] != loader.ModeNative {
		t.Fatalf("after eth1 freed: attached %v", got)
	}
	if f.sink.calls != 1 || f.sink.current() != f.maps {
		t.Fatalf("mirror given %v (%d calls), want the maps once", f.sink.got, f.sink.calls)
	}
	for range 3 {
		f.m.Retry() // eth0 still busy
	}
	if f.sink.calls != 1 {
		t.Errorf("retries moved the bindings: %d SetOffload calls", f.sink.calls)
	}
	if got := f.m.Missing(); len(got) != 1 || got[0] != "eth0" {
		t.Errorf("missing %v, want [eth0]", got)
	}
	f.prog.setBusy("eth0", false)
	f.m.Retry()
	f.want(t, loader.ModeAuto)
	if f.loads != 1 {
		t.Errorf("program loaded %d times, want once", f.loads)
	}

	// Off stops the retries: nothing is attached behind the label's back.
	if err := f.m.SetLabel(nodelabel.Detach); err != nil {
		t.Fatal(err)
	}
	before := f.prog.attaches
	f.m.Retry()
	if f.prog.attaches != before {
		t.Errorf("Retry attached while the mode is off")
	}
	f.want(t, loader.ModeOff)
}

// TestTCWhereXDPIsBusy: where another program holds the XDP hook and the TC
// engine relays alone (Engines), the kernel path counts as on (the mirror
// writes to the maps), and Retry keeps trying XDP there, with the TC engine
// in place, until it gets it.
func TestTCWhereXDPIsBusy(t *testing.T) {
	f := newFixture(t, "", "", "eth0")
	f.prog.tc = map[string]bool{"eth0": true}
	f.prog.setBusy("eth0", true)
	if err := f.m.Start(); err != nil {
		t.Fatal(err)
	}
	if got := f.m.Attached(); got["eth0"] != loader.ModeTC || f.sink.current() != f.maps {
		t.Fatalf("attached %v, mirror writes to %v; want eth0 tc and the maps", got, f.sink.current())
	}
	before := f.prog.attaches
	f.m.Retry()
	if f.prog.attaches != before+1 || f.sink.calls != 1 {
		t.Fatalf("Retry made %d attaches, %d SetOffload calls; want one attach and the bindings left in place",
			f.prog.attaches-before, f.sink.calls)
	}
	f.prog.setBusy("eth0", false)
	f.m.Retry()
	f.want(t, loader.ModeAuto)
	before = f.prog.attaches
	f.m.Retry()
	if f.prog.attaches != before || f.sink.calls != 1 {
		t.Errorf("Retry with XDP everywhere: %d attaches, %d SetOffload calls", f.prog.attaches-before, f.sink.calls)
	}
}

// TestNoInterfaces: XDP wanted without an interface to run on.
func TestNoInterfaces(t *testing.T) {
	f := newFixture(t, "", "", []string{}...)
	f.m.ifaces = nil
	if err := f.m.Start(); !errors.Is(err, ErrNoInterfaces) {
		t.Fatalf("start: %v, want ErrNoInterfaces", err)
	}
}

// TestLoadFailureRetried: a program that cannot load (no BPF permission yet)
// is loaded again by Retry.
func TestLoadFailureRetried(t *testing.T) {
	f := newFixture(t, "", "")
	errLoad := errors.New("operation not permitted")
	fail := true
	load := f.m.load
	f.m.load = func(c loader.Config) (Program, mirror.Offload, error) {
		if fail {
			return nil, nil, errLoad
		}
		return load(c)
	}
	if err := f.m.Start(); !errors.Is(err, errLoad) {
		t.Fatalf("start: %v, want the load error", err)
	}
	fail = false
	f.m.Retry()
	f.want(t, loader.ModeAuto)
}

// TestReconfigure: the load-time configuration reaches a loaded program, and
// the first load when none is loaded yet.
func TestReconfigure(t *testing.T) {
	f := newFixture(t, loader.ModeOff, "")
	var loaded loader.Config
	load := f.m.load
	f.m.load = func(c loader.Config) (Program, mirror.Offload, error) { loaded = c; return load(c) }
	if err := f.m.Start(); err != nil {
		t.Fatal(err)
	}
	cfg := loader.Config{ListenerPorts: []uint16{3478, 3479}}
	if err := f.m.Reconfigure(cfg); err != nil {
		t.Fatal(err)
	}
	if err := f.m.SetLabel(nodelabel.Attach); err != nil {
		t.Fatal(err)
	}
	if len(loaded.ListenerPorts) != 2 {
		t.Errorf("loaded with %+v, want the reconfigured ports", loaded)
	}
	cfg.ListenerPorts = []uint16{3478}
	if err := f.m.Reconfigure(cfg); err != nil {
		t.Fatal(err)
	}
	if len(f.prog.cfg.ListenerPorts) != 1 {
		t.Errorf("the loaded program was not reconfigured: %+v", f.prog.cfg)
	}
	if f.m.Maps() != nil {
		t.Errorf("Maps() of a fake is %v, want nil", f.m.Maps())
	}
}

// TestNoInputAfterClose: a label event that arrives after Close (the watcher
// stops after the daemon) must not load or attach the program again.
func TestNoInputAfterClose(t *testing.T) {
	f := newFixture(t, "", "")
	if err := f.m.Start(); err != nil {
		t.Fatal(err)
	}
	if err := f.m.Close(); err != nil {
		t.Fatal(err)
	}
	if err := f.m.SetLabel(nodelabel.Attach); !errors.Is(err, ErrClosed) {
		t.Errorf("label after Close: %v, want ErrClosed", err)
	}
	if _, err := f.m.TakeBack(); err != nil {
		t.Errorf("take back after Close: %v", err)
	}
	f.m.Retry()
	if f.loads != 1 || len(f.m.Attached()) != 0 {
		t.Errorf("after Close: %d loads, attached %v; want 1 load and nothing attached", f.loads, f.m.Attached())
	}
}

// fakeEngines stands in for loader.Engines: the program with the TC engine's
// counters.
type fakeEngines struct {
	*fakeProgram
	verdicts []uint64
}

func (p *fakeEngines) TCVerdicts() ([]uint64, error) { return p.verdicts, nil }

// TestTCVerdicts: the manager reports the TC engine's counters only while a
// program with the engine is loaded: none before the load, none from a
// program without it (LoadXDP, or the engine failed to load), none after
// Close.
func TestTCVerdicts(t *testing.T) {
	f := newFixture(t, loader.ModeOff, "")
	if v, err := f.m.TCVerdicts(); v != nil || err != nil {
		t.Errorf("before the load: %v, %v; want nothing", v, err)
	}
	if err := f.m.SetLabel(nodelabel.Attach); err != nil {
		t.Fatal(err)
	}
	if v, err := f.m.TCVerdicts(); v != nil || err != nil {
		t.Errorf("XDP alone: %v, %v; want nothing", v, err)
	}

	e := &fakeEngines{fakeProgram: &fakeProgram{attached: map[string]loader.Mode{}, busy: map[string]bool{}}, verdicts: []uint64{4, 2}}
	m := New(Options{
		Log:  slog.New(slog.NewTextHandler(io.Discard, nil)),
		Load: func(loader.Config) (Program, mirror.Offload, error) { return e, &fakeMaps{}, nil },
		Sink: &sink{}, Interfaces: []string{"eth0"}, Flag: loader.ModeAuto,
	})
	if err := m.Start(); err != nil {
		t.Fatal(err)
	}
	if v, err := m.TCVerdicts(); err != nil || len(v) != 2 || v[0] != 4 || v[1] != 2 {
		t.Errorf("with the TC engine: %v, %v; want [4 2]", v, err)
	}
	if err := m.Close(); err != nil {
		t.Fatal(err)
	}
	if v, err := m.TCVerdicts(); v != nil || err != nil {
		t.Errorf("after Close: %v, %v; want nothing", v, err)
	}
}

// The tables' writers get the maps from the load on, whether the program is
// attached or not (a label detaches it; the maps stay), and nil before they
// are freed.
func TestSinkMaps(t *testing.T) {
	f := newFixture(t, "", "")
	if f.sink.maps != nil {
		t.Fatal("maps handed out before the load")
	}
	if err := f.m.Start(); err != nil {
		t.Fatal(err)
	}
	if f.sink.maps != f.maps {
		t.Fatalf("after the load the writers have %v, want the maps", f.sink.maps)
	}
	if err := f.m.SetLabel(nodelabel.Detach); err != nil {
		t.Fatal(err)
	}
	if f.sink.maps != f.maps || f.sink.current() != nil {
		t.Fatalf("detached by the label: writers have %v, mirror %v; want the maps, nil", f.sink.maps, f.sink.current())
	}
	if err := f.m.Close(); err != nil {
		t.Fatal(err)
	}
	if f.sink.maps != nil {
		t.Fatal("the maps were freed with writers still holding them")
	}
}

// yieldingProgram is a fakeProgram with a TC engine that can stay where XDP
// is handed over (Yielder, as loader.Engines).
type yieldingProgram struct{ *fakeProgram }

func (p yieldingProgram) YieldXDP(iface string) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.attached[iface] = loader.ModeTC
	return nil
}

// TestHandOverKeepsTC: with a TC engine, the hand-over gives the XDP hooks up
// and keeps the engine relaying the daemon's sessions (mode tc, the bindings
// left in the maps); Retry does not take XDP back while the successor lives;
// TakeBack does. The node label asking for off still takes everything off.
func TestHandOverKeepsTC(t *testing.T) {
	f := newFixture(t, "", "")
	f.m = New(Options{
		Log: slog.New(slog.NewTextHandler(io.Discard, nil)),
		Load: func(loader.Config) (Program, mirror.Offload, error) {
			f.loads++
			return yieldingProgram{f.prog}, f.maps, nil
		},
		Sink: f.sink, Interfaces: []string{"eth0", "eth1"},
	})
	t.Cleanup(func() { _ = f.m.Close() })
	if err := f.m.Start(); err != nil {
		t.Fatal(err)
	}
	if was, err := f.m.HandOver(); !was || err != nil {
		t.Fatalf("hand-over: %v, %v", was, err)
	}
	tcEverywhere := func(when string) {
		t.Helper()
		got := f.m.Attached()
		if len(got) != 2 || got["eth0"] != loader.ModeTC || got["eth1"] != loader.ModeTC {
			t.Errorf("%s: attached %v, want tc on eth0 and eth1", when, got)
		}
		if f.sink.current() != f.maps || f.sink.calls != 1 {
			t.Errorf("%s: the mirror writes to %v (%d calls), want the maps, never moved", when, f.sink.current(), f.sink.calls)
		}
	}
	tcEverywhere("handed over")
	before := f.prog.attaches
	f.m.Retry()
	if f.prog.attaches != before {
		t.Errorf("Retry attached XDP while the successor holds it")
	}
	tcEverywhere("after a retry")
	if was, err := f.m.TakeBack(); !was || err != nil {
		t.Fatalf("take back: %v, %v", was, err)
	}
	f.want(t, loader.ModeAuto)
	if _, err := f.m.HandOver(); err != nil {
		t.Fatal(err)
	}
	if err := f.m.SetLabel(nodelabel.Detach); err != nil {
		t.Fatal(err)
	}
	f.want(t, loader.ModeOff)
}

// TestRefusedNotRetried: a program the kernel refuses (a verifier log, a
// kfunc it lacks, ENOTSUPP) is loaded once: Retry, on a timer or a link
// event, does not ask again, and the bindings count as program_refused. A
// new load-time configuration asks once more. A load error that can pass
// (EPERM) is retried, and counts as no_kernel_path.
func TestRefusedNotRetried(t *testing.T) {
	for _, tc := range []struct {
		name    string
		err     error
		refused bool
	}{
		{"verifier", fmt.Errorf("load XDP program: %w", &ebpf.VerifierError{Cause: unix.EACCES,
			Log: []string{"0: (61) r2 = *(u32 *)(r1 +4)", "math between pkt pointer and register with unbounded min value is not allowed"}}), true},
		{"kfunc", fmt.Errorf("load TC program: kfunc %q: %w", "bpf_cast_to_kern_ctx", ebpf.ErrNotSupported), true},
		{"enotsupp", fmt.Errorf("attach: %w", unix.Errno(524)), true},
		{"eperm", fmt.Errorf("load XDP program: %w", unix.EPERM), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t, "", "")
			loads := 0
			fail := true
			load := f.m.load
			f.m.load = func(c loader.Config) (Program, mirror.Offload, error) {
				loads++
				if fail {
					return nil, nil, tc.err
				}
				return load(c)
			}
			if got := f.m.Unavailable(); got != mirror.ReasonNoKernelPath {
				t.Errorf("before Start: unavailable %q", got)
			}
			err := f.m.Start()
			if errors.Is(err, ErrRefused) != tc.refused || (f.m.Refused() != nil) != tc.refused {
				t.Fatalf("start: %v (Refused %v); want refused %v", err, f.m.Refused(), tc.refused)
			}
			wantWhy := mirror.ReasonNoKernelPath
			if tc.refused {
				wantWhy = mirror.ReasonRefused
			}
			if got := f.m.Unavailable(); got != wantWhy {
				t.Errorf("unavailable %q, want %q", got, wantWhy)
			}
			for range 3 {
				f.m.Retry()
			}
			wantLoads := 4
			if tc.refused {
				wantLoads = 1
			}
			if loads != wantLoads {
				t.Errorf("%d loads after 3 retries, want %d", loads, wantLoads)
			}
			fail = false
			f.m.Retry()
			if tc.refused {
				if len(f.m.Attached()) != 0 {
					t.Fatalf("a refused program was loaded again by Retry")
				}
				// The same configuration: still the same answer.
				if err := f.m.Reconfigure(loader.Config{}); err != nil {
					t.Fatal(err)
				}
				f.m.Retry()
				if loads != 1 {
					t.Fatalf("the same configuration loaded again: %d loads", loads)
				}
				if err := f.m.Reconfigure(loader.Config{ListenerPorts: []uint16{3478}}); err != nil {
					t.Fatal(err)
				}
				if got := f.m.Unavailable(); got != mirror.ReasonNoKernelPath {
					t.Errorf("after a new configuration: unavailable %q", got)
				}
				f.m.Retry()
			}
			f.want(t, loader.ModeAuto)
			if got := f.m.Unavailable(); got != "" {
				t.Errorf("attached: unavailable %q, want \"\"", got)
			}
			if err := f.m.SetLabel(nodelabel.Detach); err != nil {
				t.Fatal(err)
			}
			if got := f.m.Unavailable(); got != mirror.ReasonOff {
				t.Errorf("label off: unavailable %q, want off", got)
			}
		})
	}
}

// TestAttachRefusedWaitsForLinks: an interface whose driver refuses the mode
// (EOPNOTSUPP: no native XDP) is not tried again at every Retry tick, only
// after a link event (LinkChanged) or another input; an interface another
// program holds (busy) is tried at every tick.
func TestAttachRefusedWaitsForLinks(t *testing.T) {
	f := newFixture(t, loader.ModeNative, "", "eth0", "eth1")
	refusing := map[string]bool{"eth0": true}
	attaches := map[string]int{}
	f.m.load = func(loader.Config) (Program, mirror.Offload, error) {
		return refusingProgram{f.prog, refusing, attaches}, f.maps, nil
	}
	f.prog.setBusy("eth1", true)
	if err := f.m.Start(); !errors.Is(err, ErrNotAttached) {
		t.Fatalf("start: %v", err)
	}
	for range 3 {
		f.m.Retry()
	}
	if attaches["eth0"] != 1 || attaches["eth1"] != 4 {
		t.Fatalf("attaches %v after start and 3 ticks; want eth0 once (refused), eth1 4 times (busy)", attaches)
	}
	refusing["eth0"] = false // a driver that takes it now (a link event says something changed)
	f.m.Retry()
	if attaches["eth0"] != 1 {
		t.Fatalf("a tick tried eth0 again: %v", attaches)
	}
	f.m.LinkChanged()
	if attaches["eth0"] != 2 || f.m.Attached()["eth0"] != loader.ModeNative {
		t.Fatalf("after a link event: attaches %v, attached %v; want eth0 tried and attached", attaches, f.m.Attached())
	}
}

// refusingProgram is a fakeProgram whose interfaces in refusing refuse the
// attach as a driver without native XDP does; it counts attaches.
type refusingProgram struct {
	*fakeProgram
	refusing map[string]bool
	attaches map[string]int
}

func (p refusingProgram) Attach(iface string, mode loader.Mode) (loader.Mode, error) {
	p.attaches[iface]++
	if p.refusing[iface] {
		return loader.ModeOff, fmt.Errorf("attach XDP to %s: %s: %w", iface, mode, unix.EOPNOTSUPP)
	}
	return p.fakeProgram.Attach(iface, mode)
}
