package daemon

import (
	"slices"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/l7mp/stunnerd-xdp/bpf"
	"github.com/l7mp/stunnerd-xdp/internal/channelmap"
	"github.com/l7mp/stunnerd-xdp/internal/loader"
	"github.com/l7mp/stunnerd-xdp/internal/nodelabel"
)

// collector reads the counters at scrape time: the per-CPU maps are summed in
// Go, nothing is copied on the packet path.
type collector struct {
	d                                              *Daemon
	packets, bytes, verdicts, allocs, chans, bound *prometheus.Desc
	attached, mirrorEvents, mirrorErrors, drift    *prometheus.Desc
	mode, label, steering                          *prometheus.Desc
}

func newCollector(d *Daemon) *collector {
	return &collector{
		d:            d,
		packets:      prometheus.NewDesc("stunnerd_xdp_packets_total", "Packets relayed, by path (xdp or userspace) and direction.", []string{"path", "direction"}, nil),
		bytes:        prometheus.NewDesc("stunnerd_xdp_bytes_total", "Application-data bytes relayed, by path and direction.", []string{"path", "direction"}, nil),
		verdicts:     prometheus.NewDesc("stunnerd_xdp_verdicts_total", "Packets seen by the XDP program, by the reason for its verdict.", []string{"reason"}, nil),
		allocs:       prometheus.NewDesc("stunnerd_xdp_allocations_active", "TURN allocations pion/turn holds.", nil, nil),
		chans:        prometheus.NewDesc("stunnerd_xdp_channels_active", "TURN channel bindings pion/turn holds.", nil, nil),
		bound:        prometheus.NewDesc("stunnerd_xdp_bindings_offloaded", "Channel bindings installed in the XDP maps.", nil, nil),
		attached:     prometheus.NewDesc("stunnerd_xdp_attached", "1 where the XDP program is attached to the interface in the mode.", []string{"iface", "mode"}, nil),
		mirrorEvents: prometheus.NewDesc("stunnerd_xdp_mirror_events_total", "pion/turn events received by the mirror.", nil, nil),
		mirrorErrors: prometheus.NewDesc("stunnerd_xdp_mirror_errors_total", "Map writes that failed (the flows stayed in userspace).", nil, nil),
		drift:        prometheus.NewDesc("stunnerd_xdp_reconcile_repairs_total", "Differences between pion/turn and the maps repaired by the reconcile.", nil, nil),
		mode:         prometheus.NewDesc("stunnerd_xdp_mode", "1 for the path in use: native or generic (XDP attached somewhere in that mode) or off (userspace only).", []string{"mode"}, nil),
		steering:     prometheus.NewDesc("stunnerd_xdp_steering_total", "Listener packets the node's SO_REUSEPORT steering sent to the allocation's daemon (owner), the newest daemon (active), or left to the kernel's hash.", []string{"verdict"}, nil),
		label:        prometheus.NewDesc("stunnerd_xdp_offload_label", "1 for the state of the node's stunner.l7mp.io/xdp-offload label (absent without --node-name).", []string{"state"}, nil),
	}
}

func (c *collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.packets, c.bytes, c.verdicts, c.allocs, c.chans, c.bound, c.attached, c.mirrorEvents, c.mirrorErrors, c.drift, c.mode, c.label, c.steering} {
		ch <- d
	}
}

func (c *collector) Collect(ch chan<- prometheus.Metric) {
	counter := func(d *prometheus.Desc, v uint64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v), labels...)
	}
	gauge := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
	}
	u := c.d.counters
	counter(c.packets, u.ClientToPeerPackets.Load(), "userspace", "client_to_peer")
	counter(c.packets, u.PeerToClientPackets.Load(), "userspace", "peer_to_client")
	counter(c.bytes, u.ClientToPeerBytes.Load(), "userspace", "client_to_peer")
	counter(c.bytes, u.PeerToClientBytes.Load(), "userspace", "peer_to_client")

	var xdp channelmap.Stats
	if m := c.d.xdp.Maps(); m != nil {
		if s, err := m.Totals(); err == nil {
			xdp = s
		}
		if v, err := m.Verdicts(); err == nil {
			for r, n := range v {
				counter(c.verdicts, n, channelmap.ReasonNames[bpf.RelayReason(r)])
			}
		}
		gauge(c.bound, float64(m.Len()))
	}
	counter(c.packets, xdp.ClientToPeerPackets, "xdp", "client_to_peer")
	counter(c.packets, xdp.PeerToClientPackets, "xdp", "peer_to_client")
	counter(c.bytes, xdp.ClientToPeerBytes, "xdp", "client_to_peer")
	counter(c.bytes, xdp.PeerToClientBytes, "xdp", "peer_to_client")

	gauge(c.allocs, float64(c.d.AllocationCount()))
	_, chans := c.d.mirror.Counts()
	gauge(c.chans, float64(chans))

	attached := c.d.xdp.Attached()
	inUse := map[loader.Mode]bool{}
	for _, m := range attached {
		inUse[m] = true
	}
	for _, m := range []loader.Mode{loader.ModeNative, loader.ModeGeneric, loader.ModeOff} {
		v := 0.0
		if inUse[m] || m == loader.ModeOff && len(attached) == 0 {
			v = 1
		}
		gauge(c.mode, v, string(m))
	}
	state := nodelabel.Absent
	if w := c.d.nodeWatcher.Load(); w != nil {
		state = w.State()
	}
	for _, s := range nodelabel.States {
		v := 0.0
		if s == state {
			v = 1
		}
		gauge(c.label, v, s.String())
	}
	// The managed interfaces, and any renamed since the attach (the program
	// runs there still).
	ifaces := c.d.xdp.Interfaces()
	for iface := range attached {
		if !slices.Contains(ifaces, iface) {
			ifaces = append(ifaces, iface)
		}
	}
	for _, iface := range ifaces {
		for _, mode := range []loader.Mode{loader.ModeNative, loader.ModeGeneric} {
			v := 0.0
			if attached[iface] == mode {
				v = 1
			}
			gauge(c.attached, v, iface, string(mode))
		}
	}
	if c.d.steer != nil {
		if s, err := c.d.steer.Stats(); err == nil {
			counter(c.steering, s.Owner, "owner")
			counter(c.steering, s.Active, "active")
			counter(c.steering, s.Hash, "hash")
		}
	}
	st := c.d.mirror.Stats()
	counter(c.mirrorEvents, st.Events)
	counter(c.mirrorErrors, st.Errors)
	counter(c.drift, st.Drift)
}
