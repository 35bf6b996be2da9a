package loader_test

import (
	"io"
	"log/slog"
	"strings"
	"testing"

	"github.com/l7mp/stunnerd-xdp/internal/loader"
	"github.com/l7mp/stunnerd-xdp/internal/testenv"
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
