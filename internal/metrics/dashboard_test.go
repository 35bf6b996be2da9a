package metrics

import (
	"encoding/json"
	"os"
	"regexp"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
)

// exported are the metric names the daemon's collectors describe.
func exported(t *testing.T) map[string]bool {
	t.Helper()
	ch := make(chan *prometheus.Desc, 1024)
	for _, c := range []prometheus.Collector{newStunnerCollector(nil), newCollector(nil),
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{})} {
		c.Describe(ch)
	}
	close(ch)
	fq := regexp.MustCompile(`fqName: "([^"]+)"`)
	names := map[string]bool{}
	for d := range ch {
		if m := fq.FindStringSubmatch(d.String()); m != nil {
			names[m[1]] = true
		}
	}
	return names
}

// TestDashboardQueriesExportedSeries: every series the Grafana dashboard in
// deploy/monitoring queries is one the daemon exports, and the dashboard
// shows each of STUNner's series.
func TestDashboardQueriesExportedSeries(t *testing.T) {
	b, err := os.ReadFile("../../deploy/monitoring/stunnerd-xdp-dashboard.json")
	if err != nil {
		t.Fatal(err)
	}
	var d struct {
		Panels []struct {
			Title   string `json:"title"`
			Targets []struct {
				Expr string `json:"expr"`
			} `json:"targets"`
		} `json:"panels"`
	}
	if err := json.Unmarshal(b, &d); err != nil {
		t.Fatal(err)
	}
	names := exported(t)
	series := regexp.MustCompile(`\b(stunner_|stunnerd_xdp_|go_|process_)[a-z_]+\b`)
	used := map[string]bool{}
	for _, p := range d.Panels {
		for _, tg := range p.Targets {
			for _, n := range series.FindAllString(tg.Expr, -1) {
				used[n] = true
				if !names[n] {
					t.Errorf("panel %q queries %s, which the daemon does not export", p.Title, n)
				}
			}
		}
	}
	for _, n := range []string{"stunner_allocations_active", "stunner_listener_packets_total", "stunner_listener_bytes_total",
		"stunner_listener_connections", "stunner_listener_connections_total", "stunner_cluster_packets_total", "stunner_cluster_bytes_total"} {
		if !names[n] {
			t.Errorf("STUNner's %s is not exported", n)
		}
		if !used[n] {
			t.Errorf("the dashboard does not show STUNner's %s", n)
		}
	}
}
