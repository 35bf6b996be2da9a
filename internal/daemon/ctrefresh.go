package daemon

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/l7mp/stunnerd-xdp/internal/channelmap"
	"github.com/l7mp/stunnerd-xdp/internal/ctrefresh"
)

// startConntrackRefresh keeps the conntrack entries of the flows the XDP
// program relays alive while it is attached (internal/ctrefresh): without
// it, a client behind a DNAT to this node (kube-proxy with two or more
// endpoints) loses its entry while its media flows in the kernel, and its
// next STUN request may be DNATed to another node.
func (d *Daemon) startConntrackRefresh() {
	d.ctRefresh = ctrefresh.New(ctrefresh.Config{Log: d.config().Logger.Slog("conntrack")})
	d.wg.Add(1)
	go func() {
		defer d.wg.Done()
		d.ctRefresh.Run(d.stop, func() ([]channelmap.Live, bool, error) {
			m := d.xdp.Maps()
			if m == nil || len(d.xdp.Attached()) == 0 {
				return nil, false, nil // the kernel relays nothing
			}
			live, err := m.Live()
			return live, true, err
		})
	}()
}

// conntrackRefreshMetrics exports the refresher's counts.
func (d *Daemon) conntrackRefreshMetrics() []prometheus.Collector {
	counter := func(name, help string, v func(ctrefresh.Stats) uint64) prometheus.Collector {
		return prometheus.NewCounterFunc(prometheus.CounterOpts{Name: name, Help: help},
			func() float64 { return float64(v(d.ctRefresh.Stats())) })
	}
	return []prometheus.Collector{
		counter("stunnerd_xdp_conntrack_refreshed_total",
			"Conntrack entries of kernel-relayed flows whose timeout was refreshed from the binding counters.",
			func(s ctrefresh.Stats) uint64 { return s.Refreshed }),
		counter("stunnerd_xdp_conntrack_client_missing_total",
			"Looks that found no conntrack entry for a kernel-relayed client flow (expired or deleted; never re-created).",
			func(s ctrefresh.Stats) uint64 { return s.ClientMissing }),
		counter("stunnerd_xdp_conntrack_elsewhere_total",
			"Looks that found a kernel-relayed flow's conntrack entry leading elsewhere (DNATed to another node, NATed): not refreshed.",
			func(s ctrefresh.Stats) uint64 { return s.Elsewhere }),
		counter("stunnerd_xdp_conntrack_refresh_errors_total",
			"Conntrack requests of the refresher that failed.",
			func(s ctrefresh.Stats) uint64 { return s.Errors }),
	}
}
