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
	"slices"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/l7mp/stunnerd-xdp/test/netns"
)

// sideBySide are STUNner's stunnerd v1.2.1 and stunnerd-xdp (userspace only:
// no privileges needed) on the same config, each on ports of its own.
type sideBySide struct{ stunnerd, xdp endpoints }

// endpoints are a daemon's health and metrics ports.
type endpoints struct{ health, metrics int }

func startSideBySide(t *testing.T) sideBySide {
	theirs := netns.RequireBinary(t, netns.Stunnerd121)
	ours := buildStunnerd(t)
	dir := t.TempDir()
	start := func(name, bin string, args ...string) endpoints {
		turnPort := freePort(t, "udp")
		e := endpoints{health: freePort(t, "tcp"), metrics: freePort(t, "tcp")}
		cfg := filepath.Join(dir, name+".conf")
		if err := os.WriteFile(cfg, []byte(statusConfig(turnPort, e.health, e.metrics)), 0o600); err != nil {
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
		return e
	}
	return sideBySide{
		stunnerd: start("stunnerd", theirs),
		xdp: start("stunnerd-xdp", ours, "--xdp-mode=off", "--relay-address=127.0.0.1", "--steering-dir=",
			"--min-relay-port=20000", "--max-relay-port=20999"),
	}
}

// TestProbeBodiesAsStunnerd compares what /live and /ready answer once
// ready: code, Content-Type and body, byte for byte (kubelets look at the
// code; scripts and dashboards at the body).
func TestProbeBodiesAsStunnerd(t *testing.T) {
	both := startSideBySide(t)
	stunnerd, xdp := both.stunnerd.health, both.xdp.health

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

// TestMetricLabelsAsStunnerd: every stunner_* series stunnerd v1.2.1
// exports before any traffic, stunnerd-xdp exports with the same label names
// (its OpenTelemetry exporter's otel_scope_* included, which STUNner's
// dashboards filter on), and target_info names the same service.
func TestMetricLabelsAsStunnerd(t *testing.T) {
	both := startSideBySide(t)
	scrape := func(port int) map[string]*dto.MetricFamily {
		var err error
		for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
			var resp *http.Response
			if resp, err = http.Get(fmt.Sprintf("http://127.0.0.1:%d/metrics", port)); err != nil {
				continue
			}
			var fams map[string]*dto.MetricFamily
			parser := expfmt.NewTextParser(model.UTF8Validation)
			fams, err = parser.TextToMetricFamilies(resp.Body)
			resp.Body.Close()
			if err == nil && fams["stunner_listener_connections"] != nil {
				return fams
			}
		}
		t.Fatalf("no metrics on port %d: %v", port, err)
		return nil
	}
	labelNames := func(m *dto.Metric) []string {
		var names []string
		for _, l := range m.GetLabel() {
			names = append(names, l.GetName())
		}
		slices.Sort(names)
		return names
	}
	theirs, ours := scrape(both.stunnerd.metrics), scrape(both.xdp.metrics)
	compared := 0
	for name, f := range theirs {
		if !strings.HasPrefix(name, "stunner_") {
			continue
		}
		o := ours[name]
		if o == nil || len(o.GetMetric()) == 0 {
			t.Errorf("%s: stunnerd exports it, stunnerd-xdp does not", name)
			continue
		}
		if a, b := labelNames(f.GetMetric()[0]), labelNames(o.GetMetric()[0]); !slices.Equal(a, b) {
			t.Errorf("%s: labels %v, stunnerd's %v", name, b, a)
		}
		if f.GetType() != o.GetType() {
			t.Errorf("%s: %v, stunnerd's %v", name, o.GetType(), f.GetType())
		}
		compared++
	}
	service := func(fams map[string]*dto.MetricFamily) string {
		for _, m := range fams["target_info"].GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "service_name" {
					return l.GetValue()
				}
			}
		}
		return ""
	}
	if a, b := service(theirs), service(ours); a == "" || a != b {
		t.Errorf("target_info service_name %q, stunnerd's %q", b, a)
	}
	if compared < 3 {
		t.Errorf("compared %d stunner_* families: stunnerd exported fewer than expected", compared)
	}
	t.Logf("%d stunner_* families with stunnerd's label names; target_info service_name %q", compared, service(ours))
}
