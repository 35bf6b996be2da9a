package daemon

import (
	"io"
	"log/slog"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/common/expfmt"

	"github.com/l7mp/stunnerd-xdp/internal/mirror"
)

// Every reason is exported, also at zero, so that alerts on a reason work
// before the first binding takes it.
func TestGateMetrics(t *testing.T) {
	m := mirror.New(slog.New(slog.NewTextHandler(io.Discard, nil)))
	defer m.Close()
	reg := prometheus.NewRegistry()
	reg.MustRegister(newGateCollector(&Daemon{mirror: m}))
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var out strings.Builder
	for _, f := range families {
		if _, err := expfmt.MetricFamilyToText(&out, f); err != nil {
			t.Fatal(err)
		}
	}
	for _, line := range []string{
		`stunnerd_xdp_bindings_userspace{reason="nat"} 0`,
		`stunnerd_xdp_bindings_userspace{reason="no_offload_peer"} 0`,
		`stunnerd_xdp_bindings_userspace{reason="pending"} 0`,
		`stunnerd_xdp_bindings_userspace{reason="full"} 0`,
		`stunnerd_xdp_bindings_full_total 0`,
	} {
		if !strings.Contains(out.String(), line+"\n") {
			t.Errorf("missing %s in:\n%s", line, out.String())
		}
	}
}
