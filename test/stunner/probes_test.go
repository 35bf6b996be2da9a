package stunner

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/l7mp/stunnerd-xdp/test/netns"
)

// TestProbeBodiesAsStunnerd runs STUNner's stunnerd v1.2.1 and stunnerd-xdp
// (userspace only: no privileges needed) on the same config, each on ports of
// its own, and compares what their /live and /ready answer once ready: code,
// Content-Type and body, byte for byte (kubelets look at the code; scripts
// and dashboards at the body).
func TestProbeBodiesAsStunnerd(t *testing.T) {
	theirs := netns.RequireBinary(t, netns.Stunnerd121)
	ours := buildStunnerd(t)
	dir := t.TempDir()
	start := func(name, bin string, args ...string) (health int) {
		turnPort, metricsPort := freePort(t, "udp"), freePort(t, "tcp")
		health = freePort(t, "tcp")
		cfg := filepath.Join(dir, name+".conf")
		if err := os.WriteFile(cfg, []byte(statusConfig(turnPort, health, metricsPort)), 0o600); err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		var logs bytes.Buffer
		cmd := exec.CommandContext(ctx, bin, append(args, "-c", "file://"+cfg)...)
		cmd.Stdout, cmd.Stderr = &logs, &logs
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			cancel()
			_ = cmd.Wait()
			if t.Failed() {
				t.Logf("%s log:\n%s", name, logs.String())
			}
		})
		return health
	}
	stunnerd := start("stunnerd", theirs)
	xdp := start("stunnerd-xdp", ours, "--xdp-mode=off", "--relay-address=127.0.0.1", "--steering-dir=",
		"--min-relay-port=20000", "--max-relay-port=20999")

	type answer struct{ code, contentType, body string }
	get := func(port int, path string) (answer, error) {
		resp, err := http.Get(fmt.Sprintf("http://127.0.0.1:%d%s", port, path))
		if err != nil {
			return answer{}, err
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		return answer{fmt.Sprint(resp.StatusCode), resp.Header.Get("Content-Type"), string(b)}, err
	}
	ready := func(port int) answer {
		var a answer
		var err error
		for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
			if a, err = get(port, "/ready"); err == nil && a.code == "200" {
				return a
			}
		}
		t.Fatalf("port %d never ready: %+v %v", port, a, err)
		return a
	}
	if a, b := ready(stunnerd), ready(xdp); a != b {
		t.Errorf("/ready: stunnerd %+v, stunnerd-xdp %+v", a, b)
	}
	a, err := get(stunnerd, "/live")
	if err != nil {
		t.Fatal(err)
	}
	b, err := get(xdp, "/live")
	if err != nil {
		t.Fatal(err)
	}
	if a != b {
		t.Errorf("/live: stunnerd %+v, stunnerd-xdp %+v", a, b)
	}
	t.Logf("/live %+v; /ready as stunnerd's", a)
}
