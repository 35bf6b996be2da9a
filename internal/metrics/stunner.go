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
}

func newStunnerCollector(src Source) *stunnerCollector {
	dirName := []string{"direction", "name"}
	return &stunnerCollector{
		src:         src,
		allocs:      prometheus.NewDesc("stunner_allocations_active", "Number of active allocations", nil, nil),
		lPackets:    prometheus.NewDesc("stunner_listener_packets_total", "Number of datagrams sent or received at a listener", dirName, nil),
		lBytes:      prometheus.NewDesc("stunner_listener_bytes_total", "Number of bytes sent or received at a listener", dirName, nil),
		lConns:      prometheus.NewDesc("stunner_listener_connections", "Number of active downstream connections at a listener", []string{"name"}, nil),
		lConnsTotal: prometheus.NewDesc("stunner_listener_connections_total", "Number of all downstream connections observed at a listener", []string{"name"}, nil),
		cPackets:    prometheus.NewDesc("stunner_cluster_packets_total", "Number of datagrams sent to or received from backends", dirName, nil),
		cBytes:      prometheus.NewDesc("stunner_cluster_bytes_total", "Number of bytes sent to or received from backends", dirName, nil),
	}
}

func (c *stunnerCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.allocs, c.lPackets, c.lBytes, c.lConns, c.lConnsTotal, c.cPackets, c.cBytes} {
		ch <- d
	}
}

func (c *stunnerCollector) Collect(ch chan<- prometheus.Metric) {
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
