package loader_test

import (
	"io"
	"log/slog"
	"strings"
	"testing"

	"github.com/l7mp/stunnerd-xdp/internal/loader"
	"github.com/l7mp/stunnerd-xdp/test/testenv"
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

// TestVerifierBudget: the verifier walks the relay program in well under its
// limit of 1M instructions, so that another kernel's verifier, which may prune
// less, still loads it. The figure is logged: a program change shows what it
// costs the verifier.
func TestVerifierBudget(t *testing.T) {
	testenv.RequireRoot(t)
	cfg := loader.Config{ListenerPorts: []uint16{3478}, MinRelayPort: 49152, MaxRelayPort: 65535, MaxBindings: 1024}
	prog, err := loader.Load(cfg, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	defer prog.Close()
	info, err := prog.XDP().Info()
	if err != nil {
		t.Fatal(err)
	}
	n, ok := info.VerifiedInstructions()
	if !ok {
		t.Fatal("the kernel does not report verified instructions (5.16+)")
	}
	t.Logf("the verifier processed %d instructions", n)
	const budget = 500_000
	if n > budget {
		t.Errorf("the verifier processed %d instructions, over the budget of %d (its limit is 1,000,000)", n, budget)
	}
}
