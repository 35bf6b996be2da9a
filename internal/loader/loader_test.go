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
// kernel series (major.minor of the release: 5.10, 6.1, 6.12, 6.18...) it was
// measured on: a program change shows what it costs each kernel's verifier
// (testdata/verifier.txt; UPDATE_VERIFIER=1 writes this kernel's lines, to
// $VERIFIER_OUT when set: a guest of test/kernels cannot write the tree).
const verifierRecord = "testdata/verifier.txt"

// TestVerifierBudget: the verifier walks each program in well under its limit
// of 1M instructions, so that another kernel's verifier, which may prune
// less, still loads it; and the counts are the ones recorded for this kernel
// series in testdata/verifier.txt (a kernel without lines there is logged,
// not checked). Kernels before 5.16 do not report the count in the program's
// info: it is read from the verifier's statistics (the log's "processed N
// insns").
func TestVerifierBudget(t *testing.T) {
	testenv.RequireRoot(t)
	var uts unix.Utsname
	if err := unix.Uname(&uts); err != nil {
		t.Fatal(err)
	}
	release := unix.ByteSliceToString(uts.Release[:])
	var major, minor int
	if _, err := fmt.Sscanf(release, "%d.%d", &major, &minor); err != nil {
		t.Fatalf("kernel release %q: %v", release, err)
	}
	kernel := fmt.Sprintf("%d.%d", major, minor)
	fromLog := major < 5 || major == 5 && minor < 16
	if fromLog {
		defer loader.SetVerifierStats()()
	}
	counts := map[string]uint32{}
	count := func(name string, p *ebpf.Program) {
		t.Helper()
		if fromLog {
			i := strings.LastIndex(p.VerifierLog, "processed ")
			var n uint32
			if i < 0 {
				t.Fatalf("%s: no statistics in the verifier log %q", name, p.VerifierLog)
			}
			if _, err := fmt.Sscanf(p.VerifierLog[i:], "processed %d insns", &n); err != nil {
				t.Fatalf("%s: verifier statistics %q: %v", name, p.VerifierLog[i:], err)
			}
			counts[name] = n
			return
		}
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
		var tcProg, tcL3 *ebpf.Program
		if fromLog {
			tcProg, tcL3, err = loader.LoadTCStats(prog)
		} else {
			var tc *loader.TC
			if tc, err = prog.LoadTC(); err == nil {
				defer tc.Close()
				tcProg, tcL3 = tc.Prog(), tc.ProgL3()
			}
		}
		if err != nil {
			prog.Close()
			t.Fatal(err)
		}
		count("tc_turn_relay/"+c.name, tcProg)
		count("tc_turn_relay_l3/"+c.name, tcL3)
		if fromLog {
			tcProg.Close()
			tcL3.Close()
		}
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
	t.Logf("this kernel's lines (%s):\n%s", release, strings.Join(lines, "\n"))
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
		all := append(others, lines...)
		slices.SortFunc(all, func(a, b string) int { return compareSeries(a, b) })
		out := "# series program/config instructions the verifier processed (go test ./internal/loader -run TestVerifierBudget,\n" +
			"# UPDATE_VERIFIER=1 as root; in a guest of test/kernels with VERIFIER_OUT=<a file under KERNELS_OUT>)\n" +
			strings.Join(all, "\n") + "\n"
		path := verifierRecord
		if p := os.Getenv("VERIFIER_OUT"); p != "" {
			path = p
		}
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, []byte(out), 0o644); err != nil {
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
		t.Errorf("the verifier's counts on %s (%s) changed: recorded\n%s\nnow\n%s\n(a program change: record it with UPDATE_VERIFIER=1)",
			kernel, release, strings.Join(recorded, "\n"), strings.Join(lines, "\n"))
	}
}

// compareSeries orders record lines by kernel series (5.10 before 6.1
// before 6.12), then by the rest of the line.
func compareSeries(a, b string) int {
	var am, an, bm, bn int
	fmt.Sscanf(a, "%d.%d", &am, &an)
	fmt.Sscanf(b, "%d.%d", &bm, &bn)
	if c := am*1000 + an - (bm*1000 + bn); c != 0 {
		return c
	}
	return strings.Compare(a, b)
}
