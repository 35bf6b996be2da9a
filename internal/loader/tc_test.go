package loader_test

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"slices"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"

	"github.com/l7mp/stunnerd-xdp/internal/loader"
	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// TestTCAttachMatching: the TC engine attaches (tcx ingress, or a cls_bpf
// filter) to the interfaces whose names match the patterns and to no other,
// shares the XDP program's maps, and detaches when closed.
func TestTCAttachMatching(t *testing.T) { forEachTCAttach(t, testTCAttachMatching) }

func testTCAttachMatching(t *testing.T, how loader.TCAttach) {
	ns, cfg, log := tcTestNS(t)
	var closeTC func() error
	err := ns.Do(func() error {
		for _, name := range []string{"lxc1", "cali2", "eth9"} {
			if err := addVeth(name); err != nil {
				return err
			}
		}
		tc, err := loadTC(t, ns, cfg, log, how)
		if err != nil {
			return err
		}
		if tc.AttachMethod() != how {
			t.Errorf("attaches with %q, want %q", tc.AttachMethod(), how)
		}
		got, err := tc.AttachMatching("lxc*", "cali*", "nomatch*")
		if err != nil {
			return err
		}
		slices.Sort(got)
		if !slices.Equal(got, []string{"cali2", "lxc1"}) {
			t.Errorf("attached to %v, want cali2 and lxc1", got)
		}
		if _, err := tc.AttachMatching("["); err == nil {
			t.Error("a malformed pattern was taken")
		}
		closeTC = tc.Close
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	for name, want := range map[string]int{"lxc1": 1, "cali2": 1, "eth9": 0, "plxc1": 0} {
		if n := tcEngines(t, ns, name); n != want {
			t.Errorf("%s: %d TC engines at ingress, want %d", name, n, want)
		}
	}
	if err := ns.Do(closeTC); err != nil {
		t.Fatal(err)
	}
	if tcEngines(t, ns, "lxc1") != 0 {
		t.Errorf("still attached after Close")
	}
	if how == loader.TCAttachClsact && ingressQdisc(t, ns, "lxc1") != "" {
		t.Errorf("the clsact qdisc the engine made is still on lxc1 after Close")
	}
}

// TestTCDiscover: pods' veths that appear after Discover started are
// attached, others not; a deleted one is forgotten, so that a new device that
// reuses its name is attached again.
func TestTCDiscover(t *testing.T) { forEachTCAttach(t, testTCDiscover) }

func testTCDiscover(t *testing.T, how loader.TCAttach) {
	ns, cfg, log := tcTestNS(t)
	var tc *loader.TC
	stop := make(chan struct{})
	err := ns.Do(func() error {
		var err error
		if tc, err = loadTC(t, ns, cfg, log, how); err != nil {
			return err
		}
		t.Cleanup(func() { close(stop) })
		return tc.Discover(stop, []string{"lxc*"}, log)
	})
	if err != nil {
		t.Fatal(err)
	}
	add := func(name string) {
		t.Helper()
		if err := ns.Do(func() error { return addVeth(name) }); err != nil {
			t.Fatal(err)
		}
	}
	attached := func(name string) bool { return tcEventually(t, ns, name, 1) }
	add("lxc7")
	add("eth7")
	if !attached("lxc7") {
		t.Error("lxc7 (new, matching) not attached")
	}
	if attached("eth7") {
		t.Error("eth7 (not matching) attached")
	}
	if err := ns.Do(func() error {
		l, err := netlink.LinkByName("lxc7")
		if err != nil {
			return err
		}
		return netlink.LinkDel(l)
	}); err != nil {
		t.Fatal(err)
	}
	time.Sleep(100 * time.Millisecond)
	add("lxc7")
	if !attached("lxc7") {
		t.Error("lxc7 (deleted and made again) not attached")
	}
	if got := tc.Attached(); len(got) != 1 || got[0] != "lxc7" {
		t.Errorf("attached to %v, want lxc7 only", got)
	}
}

// TestEngines: the TC engine runs beside the XDP program and follows pods'
// veths only while the XDP program is attached somewhere: the kernel path is
// on with both engines, or off with neither.
func TestEngines(t *testing.T) { forEachTCAttach(t, testEngines) }

func testEngines(t *testing.T, how loader.TCAttach) {
	ns, cfg, log := tcTestNS(t)
	tcx, eventually, do := tcChecks(t, ns)
	var e *loader.Engines
	do(func() error {
		for _, n := range []string{"n0", "lxc3"} {
			if err := addVeth(n); err != nil {
				return err
			}
		}
		prog, err := loader.Load(cfg, log)
		if err != nil {
			return err
		}
		e, err = loadEngines(prog, []string{"lxc*"}, how, log)
		return err
	})
	if e.TCAttachMethod() != how {
		t.Errorf("the TC engine attaches with %q, want %q", e.TCAttachMethod(), how)
	}
	t.Cleanup(func() { _ = ns.Do(e.Close) })
	if tcx("n0") != 0 || tcx("lxc3") != 0 {
		t.Fatal("attached before the XDP program was")
	}
	do(func() error { _, err := e.Attach("n0", loader.ModeAuto); return err })
	eventually("n0", 1)
	eventually("lxc3", 1)
	do(func() error { return addVeth("lxc4") })
	eventually("lxc4", 1)
	do(func() error { return e.Detach("n0") })
	for _, n := range []string{"n0", "lxc3", "lxc4"} {
		if tcx(n) != 0 {
			t.Errorf("%s: TC still attached with the XDP program detached everywhere", n)
		}
	}
	do(func() error { return addVeth("lxc5") })
	time.Sleep(200 * time.Millisecond)
	if tcx("lxc5") != 0 {
		t.Error("lxc5 attached while the kernel path is off")
	}
	do(func() error { _, err := e.Attach("n0", loader.ModeAuto); return err })
	for _, n := range []string{"n0", "lxc3", "lxc4", "lxc5"} {
		eventually(n, 1)
	}
	do(e.Close)
	for _, n := range []string{"n0", "lxc3", "lxc4", "lxc5"} {
		if tcx(n) != 0 {
			t.Errorf("%s: TC attached after Close", n)
		}
	}
}

// TestEnginesBesideAnotherXDP: two daemons' engines on one node (two
// Gateways). The interface's XDP hook takes the first program; the second's
// attach finds it busy (ErrXDPBusy) and its TC engine relays there alone
// (ModeTC), in the same tcx chain as the first's, and follows the pods'
// interfaces; once the first detaches, attaching again gets XDP.
func TestEnginesBesideAnotherXDP(t *testing.T) { forEachTCAttach(t, testEnginesBesideAnotherXDP) }

func testEnginesBesideAnotherXDP(t *testing.T, how loader.TCAttach) {
	ns, cfg, log := tcTestNS(t)
	_, eventually, do := tcChecks(t, ns)
	var first, second *loader.Engines
	do(func() error {
		for _, n := range []string{"n0", "lxc3"} {
			if err := addVeth(n); err != nil {
				return err
			}
		}
		var err error
		for _, e := range []**loader.Engines{&first, &second} {
			prog, lerr := loader.Load(cfg, log)
			if lerr != nil {
				return lerr
			}
			if *e, err = loadEngines(prog, []string{"lxc*"}, how, log); err != nil {
				return err
			}
		}
		return nil
	})
	t.Cleanup(func() { _ = ns.Do(func() error { return errors.Join(second.Close(), first.Close()) }) })
	attach := func(e *loader.Engines, want loader.Mode) {
		t.Helper()
		do(func() error {
			got, err := e.Attach("n0", loader.ModeNative)
			if err != nil || got != want {
				return fmt.Errorf("attach: %q, %v; want %q", got, err, want)
			}
			if m := e.Attached(); len(m) != 1 || m["n0"] != want {
				return fmt.Errorf("attached %v, want n0 %q", m, want)
			}
			return nil
		})
	}
	attach(first, loader.ModeNative)
	do(func() error {
		_, err := second.Program.Attach("n0", loader.ModeNative)
		if !errors.Is(err, loader.ErrXDPBusy) {
			return fmt.Errorf("the XDP program's attach beside another: %v, want ErrXDPBusy", err)
		}
		return nil
	})
	attach(second, loader.ModeTC)
	eventually("n0", 2)
	eventually("lxc3", 2)
	attach(second, loader.ModeTC) // again: still busy, nothing added
	eventually("n0", 2)

	do(func() error { return first.Detach("n0") })
	eventually("n0", 1)
	eventually("lxc3", 1) // the second's, still following the pods
	attach(second, loader.ModeNative)
	eventually("n0", 1)

	// The second yields the hook (a draining daemon to its successor): its
	// TC engine stays, and the first takes XDP.
	do(func() error {
		if err := second.YieldXDP("n0"); err != nil {
			return err
		}
		if m := second.Attached(); len(m) != 1 || m["n0"] != loader.ModeTC {
			return fmt.Errorf("after yielding: attached %v, want n0 tc", m)
		}
		return nil
	})
	eventually("n0", 1)
	eventually("lxc3", 1)
	attach(first, loader.ModeNative)
	eventually("n0", 2)
	do(func() error { return errors.Join(second.Detach("n0"), first.Detach("n0")) })
	for _, n := range []string{"n0", "lxc3"} {
		eventually(n, 0)
	}
}

// tcChecks are the engine tests' helpers in the namespace: the count of TC
// engines on a device, a wait for a count, and a call that must not fail.
func tcChecks(t *testing.T, ns *testenv.NSWorker) (tcx func(string) int, eventually func(string, int), do func(func() error)) {
	tcx = func(name string) int { return tcEngines(t, ns, name) }
	eventually = func(name string, want int) {
		t.Helper()
		if !tcEventually(t, ns, name, want) {
			t.Fatalf("%s: %d TC engines, want %d", name, tcx(name), want)
		}
	}
	do = func(f func() error) {
		t.Helper()
		if err := ns.Do(f); err != nil {
			t.Fatal(err)
		}
	}
	return tcx, eventually, do
}

// testSettle is how long discovery waits before it attaches a new device in
// these tests (clsact), instead of seconds.
const testSettle = 100 * time.Millisecond

// forEachTCAttach runs the test with the TC engine attached with tcx (where
// the kernel has it) and with clsact.
func forEachTCAttach(t *testing.T, test func(*testing.T, loader.TCAttach)) {
	for _, how := range []loader.TCAttach{loader.TCAttachTCX, loader.TCAttachClsact} {
		t.Run(string(how), func(t *testing.T) {
			if how == loader.TCAttachTCX && !kernelHasTCX(t) {
				t.Skip("the kernel has no tcx (6.6+)")
			}
			test(t, how)
		})
	}
}

// loadTC loads the XDP program and the TC engine over it, attached as how,
// with discovery's wait shortened, in the worker's namespace (call it from
// ns.Do); both are closed at cleanup.
func loadTC(t *testing.T, ns *testenv.NSWorker, cfg loader.Config, log *slog.Logger, how loader.TCAttach) (*loader.TC, error) {
	prog, err := loader.Load(cfg, log)
	if err != nil {
		return nil, err
	}
	t.Cleanup(func() { _ = ns.Do(prog.Close) })
	tc, err := prog.LoadTCWith(how)
	if err != nil {
		return nil, err
	}
	loader.SetSettle(tc, testSettle)
	t.Cleanup(func() { _ = ns.Do(tc.Close) })
	return tc, nil
}

// loadEngines is Program.WithTCAttach with discovery's wait shortened.
func loadEngines(prog *loader.Program, patterns []string, how loader.TCAttach, log *slog.Logger) (*loader.Engines, error) {
	e, err := prog.WithTCAttach(patterns, how, log)
	if err == nil {
		loader.SetSettle(e.TC, testSettle)
	}
	return e, err
}

// kernelHasTCX asks the kernel to attach a program with tcx to an interface
// that does not exist: ENODEV with tcx, else ErrNotSupported.
func kernelHasTCX(t *testing.T) bool {
	t.Helper()
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{Type: ebpf.SchedCLS, License: "MIT",
		Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, 0), asm.Return()}})
	if err != nil {
		t.Fatal(err)
	}
	defer prog.Close()
	_, err = link.AttachTCX(link.TCXOptions{Program: prog, Attach: ebpf.AttachTCXIngress, Interface: math.MaxUint32})
	return !errors.Is(err, ebpf.ErrNotSupported)
}

// tcEngines counts the TC engines at the named device's ingress, as the
// kernel lists them (in the NSWorker's namespace): programs at tcx ingress
// and the engines' cls_bpf filters.
func tcEngines(t *testing.T, ns *testenv.NSWorker, name string) int {
	t.Helper()
	var n int
	if err := ns.Do(func() error {
		l, err := netlink.LinkByName(name)
		if err != nil {
			return err
		}
		n = len(engineFilters(t, l))
		r, err := link.QueryPrograms(link.QueryOptions{Target: l.Attrs().Index, Attach: ebpf.AttachTCXIngress})
		if err != nil {
			if kernelHasTCX(t) {
				return err
			}
			return nil
		}
		n += len(r.Programs)
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	return n
}

// engineFilters returns the engines' cls_bpf filters at the device's ingress.
func engineFilters(t *testing.T, l netlink.Link) []*netlink.BpfFilter {
	t.Helper()
	fs, err := netlink.FilterList(l, netlink.HANDLE_MIN_INGRESS)
	if err != nil {
		return nil // no ingress qdisc
	}
	var out []*netlink.BpfFilter
	for _, f := range fs {
		if b, ok := f.(*netlink.BpfFilter); ok && b.Name == "stunnerd-xdp" {
			out = append(out, b)
		}
	}
	return out
}

// ingressQdisc returns the kind of the device's ingress qdisc ("clsact",
// "ingress"), "" without one.
func ingressQdisc(t *testing.T, ns *testenv.NSWorker, name string) string {
	t.Helper()
	var kind string
	if err := ns.Do(func() error {
		l, err := netlink.LinkByName(name)
		if err != nil {
			return err
		}
		qs, err := netlink.QdiscList(l)
		for _, q := range qs {
			if q.Attrs().Parent == netlink.HANDLE_INGRESS {
				kind = q.Type()
			}
		}
		return err
	}); err != nil {
		t.Fatal(err)
	}
	return kind
}

// tcEventually waits (2 s at most) for want TC engines at the device's
// ingress, which a netlink event brings, and tells whether they came.
func tcEventually(t *testing.T, ns *testenv.NSWorker, name string, want int) bool {
	t.Helper()
	deadline := time.Now().Add(2 * time.Second)
	for tcEngines(t, ns, name) != want {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(20 * time.Millisecond)
	}
	return true
}

// addVeth adds a veth pair, name and "p"+name, both up (in the caller's
// namespace).
func addVeth(name string) error {
	la := netlink.NewLinkAttrs()
	la.Name = name
	if err := netlink.LinkAdd(&netlink.Veth{LinkAttrs: la, PeerName: "p" + name}); err != nil {
		return err
	}
	l, err := netlink.LinkByName(name)
	if err != nil {
		return err
	}
	return netlink.LinkSetUp(l)
}

// tcTestNS is a TC test's namespace, program configuration and logger.
func tcTestNS(t *testing.T) (*testenv.NSWorker, loader.Config, *slog.Logger) {
	t.Helper()
	if testing.Short() {
		t.Skip("network namespace: not in -short mode")
	}
	testenv.RequireRoot(t)
	cfg := loader.Config{ListenerPorts: []uint16{3478}, MinRelayPort: 49152, MaxRelayPort: 65535, MaxBindings: 1024}
	return testenv.NewNSWorker(t), cfg, slog.New(slog.NewTextHandler(io.Discard, nil))
}
