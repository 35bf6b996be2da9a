package loader_test

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/l7mp/stunnerd-xdp/internal/loader"
	"github.com/l7mp/stunnerd-xdp/test/testenv"
	"golang.org/x/sys/unix"
)

// TestObject: a relay object file is loaded instead of the embedded one, also
// over a running program's maps; an object whose maps differ is refused.
func TestObject(t *testing.T) {
	testenv.RequireRoot(t)
	cfg := loader.Config{ListenerPorts: []uint16{3478}, MinRelayPort: 49152, MaxRelayPort: 65535, MaxBindings: 1024}
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	prog, err := loader.Load(cfg, log)
	if err != nil {
		t.Fatal(err)
	}
	defer prog.Close()
	embedded := prog.XDP()
	// The committed object is the one embedded: same maps.
	cfg.Object = "../../bpf/relay_bpfel.o"
	if err := prog.Reconfigure(cfg); err != nil {
		t.Fatalf("reconfigure with %s: %v", cfg.Object, err)
	}
	if prog.XDP() == embedded {
		t.Error("the program was not swapped")
	}
	other, err := loader.Load(cfg, log)
	if err != nil {
		t.Fatalf("load %s: %v", cfg.Object, err)
	}
	_ = other.Close()

	for obj, want := range map[string]string{
		"../../bpf/steer_bpfel.o": "no map",
		"testdata/missing.o":      "read relay object",
	} {
		cfg.Object = obj
		if err := prog.Reconfigure(cfg); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("reconfigure with %s: %v, want an error saying %q", obj, err, want)
		}
	}
}

// verifierRecord holds the verifier's instruction count of each program, per
// kernel release it was measured on: a program change shows what it costs
// the verifier, kernel by kernel (testdata/verifier.txt; UPDATE_VERIFIER=1
// writes this kernel's lines).
const verifierRecord = "testdata/verifier.txt"

// TestVerifierBudget: the verifier walks each program in well under its limit
// of 1M instructions, so that another kernel's verifier, which may prune
// less, still loads it; and the counts are the ones recorded for this kernel
// in testdata/verifier.txt (a kernel without lines there is logged, not
// checked).
func TestVerifierBudget(t *testing.T) {
	testenv.RequireRoot(t)
	var uts unix.Utsname
	if err := unix.Uname(&uts); err != nil {
		t.Fatal(err)
	}
	kernel := unix.ByteSliceToString(uts.Release[:])
	counts := map[string]uint32{}
	count := func(name string, p *ebpf.Program) {
		t.Helper()
		info, err := p.Info()
		if err != nil {
			t.Fatal(err)
		}
		n, ok := info.VerifiedInstructions()
		if !ok {
			t.Fatal("the kernel does not report verified instructions (5.16+)")
		}
		counts[name] = n
	}
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	for _, c := range []struct {
		name string
		cfg  loader.Config
	}{
		{"ipv4-clients", loader.Config{ListenerPorts: []uint16{3478}, MinRelayPort: 49152, MaxRelayPort: 65535, MaxBindings: 1024}},
		{"ipv6-clients", loader.Config{ListenerPorts: []uint16{3478, 3479}, IPv6Clients: true, MinRelayPort: 49152, MaxRelayPort: 65535, MaxBindings: 1024}},
	} {
		prog, err := loader.Load(c.cfg, log)
		if err != nil {
			t.Fatal(err)
		}
		count("xdp_turn_relay/"+c.name, prog.XDP())
		count("charge/"+c.name, prog.Charge())
		tc, err := prog.LoadTC()
		if err != nil {
			prog.Close()
			t.Fatal(err)
		}
		count("tc_turn_relay/"+c.name, tc.Prog())
		tc.Close()
		prog.Close()
	}
	const budget = 500_000
	var lines []string
	for name, n := range counts {
		t.Logf("%s: the verifier processed %d instructions", name, n)
		if n > budget {
			t.Errorf("%s: the verifier processed %d instructions, over the budget of %d (its limit is 1,000,000)", name, n, budget)
		}
		lines = append(lines, fmt.Sprintf("%s %s %d", kernel, name, n))
	}
	slices.Sort(lines)
	b, err := os.ReadFile(verifierRecord)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		t.Fatal(err)
	}
	var others, recorded []string
	for _, l := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		switch {
		case l == "" || strings.HasPrefix(l, "#"):
		case strings.HasPrefix(l, kernel+" "):
			recorded = append(recorded, l)
		default:
			others = append(others, l)
		}
	}
	if os.Getenv("UPDATE_VERIFIER") != "" {
		out := "# kernel program/config instructions the verifier processed (go test ./internal/loader -run TestVerifierBudget, UPDATE_VERIFIER=1 as root)\n" +
			strings.Join(append(others, lines...), "\n") + "\n"
		if err := os.MkdirAll(filepath.Dir(verifierRecord), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(verifierRecord, []byte(out), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	if len(recorded) == 0 {
		t.Logf("no counts recorded for kernel %s in %s: record them with UPDATE_VERIFIER=1", kernel, verifierRecord)
		return
	}
	slices.Sort(recorded)
	if !slices.Equal(recorded, lines) {
		t.Errorf("the verifier's counts on %s changed: recorded\n%s\nnow\n%s\n(a program change: record it with UPDATE_VERIFIER=1)",
			kernel, strings.Join(recorded, "\n"), strings.Join(lines, "\n"))
	}
}
