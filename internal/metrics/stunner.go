package metrics

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/l7mp/stunnerd-xdp/internal/channelmap"
)

// stunnerCollector exports STUNner's series (names, labels, help and types as
// stunnerd v1.2.1's internal/telemetry has them), kernel traffic included.
type stunnerCollector struct {
	src                                           Source
	allocs, lPackets, lBytes, lConns, lConnsTotal *prometheus.Desc
	cPackets, cBytes                              *prometheus.Desc
	// target is OpenTelemetry's target_info, as stunnerd exports it: its
	// service_name (dashboards join on it); not the telemetry_sdk_* labels,
	// which would name an SDK this daemon does not run.
	target *prometheus.Desc
}

// otelScope are the constant labels stunnerd v1.2.1 gives every stunner_*
// series: its exporter (OpenTelemetry's Prometheus exporter) adds the
// instrumentation scope, and STUNner's Grafana dashboards filter on
// otel_scope_name.
var otelScope = prometheus.Labels{"otel_scope_name": "stunner", "otel_scope_schema_url": "", "otel_scope_version": ""}

func newStunnerCollector(src Source) *stunnerCollector {
	dirName := []string{"direction", "name"}
	desc := func(name, help string, labels []string) *prometheus.Desc {
		return prometheus.NewDesc(name, help, labels, otelScope)
	}
	return &stunnerCollector{
		src:         src,
		allocs:      desc("stunner_allocations_active", "Number of active allocations", nil),
		lPackets:    desc("stunner_listener_packets_total", "Number of datagrams sent or received at a listener", dirName),
		lBytes:      desc("stunner_listener_bytes_total", "Number of bytes sent or received at a listener", dirName),
		lConns:      desc("stunner_listener_connections", "Number of active downstream connections at a listener", []string{"name"}),
		lConnsTotal: desc("stunner_listener_connections_total", "Number of all downstream connections observed at a listener", []string{"name"}),
		cPackets:    desc("stunner_cluster_packets_total", "Number of datagrams sent to or received from backends", dirName),
		cBytes:      desc("stunner_cluster_bytes_total", "Number of bytes sent to or received from backends", dirName),
		target:      prometheus.NewDesc("target_info", "Target metadata", nil, prometheus.Labels{"service_name": "stunner"}),
	}
}

func (c *stunnerCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.allocs, c.lPackets, c.lBytes, c.lConns, c.lConnsTotal, c.cPackets, c.cBytes, c.target} {
		ch <- d
	}
}

func (c *stunnerCollector) Collect(ch chan<- prometheus.Metric) {
	gauge(ch, c.target, 1)
	gauge(ch, c.allocs, float64(c.src.AllocationCount()))
	t, err := KernelTotals(c.src)
	if err != nil {
		// Without the kernel's share the sums would drop: a reset to a reader.
		for _, d := range []*prometheus.Desc{c.lPackets, c.lBytes, c.cPackets, c.cBytes} {
			ch <- prometheus.NewInvalidMetric(d, err)
		}
	} else {
		emit := func(packets, bytes *prometheus.Desc, m map[string]Stats) {
			for name, s := range m {
				counter(ch, packets, s.Rx.Packets, rx, name)
				counter(ch, packets, s.Tx.Packets, tx, name)
				counter(ch, bytes, s.Rx.Bytes, rx, name)
				counter(ch, bytes, s.Tx.Bytes, tx, name)
			}
		}
		emit(c.lPackets, c.lBytes, t.Listeners)
		emit(c.cPackets, c.cBytes, t.Clusters)
	}
	for name, n := range t.Conns {
		gauge(ch, c.lConns, float64(n), name)
		counter(ch, c.lConnsTotal, uint64(t.ConnsTotal[name]), name)
	}
}

// KernelTotals returns the listeners' and clusters' totals with the kernel's
// share read from the maps (if XDP was ever loaded). On error the totals are
// userspace's only.
func KernelTotals(src Source) (Totals, error) {
	var kernel map[string]channelmap.Stats
	var err error
	if m := src.Maps(); m != nil {
		kernel, err = m.AccountTotals()
	}
	return src.Traffic().Totals(kernel), err
}
