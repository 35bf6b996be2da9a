package metrics

import (
	"slices"
	"strconv"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/l7mp/stunnerd-xdp/internal/channelmap"
	"github.com/l7mp/stunnerd-xdp/internal/connlimit"
	"github.com/l7mp/stunnerd-xdp/internal/loader"
	"github.com/l7mp/stunnerd-xdp/internal/mirror"
	"github.com/l7mp/stunnerd-xdp/internal/nodelabel"
	"github.com/l7mp/stunnerd-xdp/internal/quota"
	"github.com/l7mp/stunnerd-xdp/internal/shield"
	"github.com/l7mp/stunnerd-xdp/internal/steering"
	"github.com/l7mp/stunnerd-xdp/internal/userspace"
)

// Source is what the collector reads from the daemon, at scrape time.
type Source interface {
	// AllocationCount is pion/turn's live allocations.
	AllocationCount() int
	// Maps are the binding maps, nil until XDP was first loaded.
	Maps() *channelmap.Maps
	// TCVerdicts are the TC engine's verdict counters, indexed as
	// channelmap.TCReasonName names them; nil while the engine is not loaded.
	TCVerdicts() ([]uint64, error)
	// Attached is the XDP mode of every interface the program runs on.
	Attached() map[string]loader.Mode
	// Interfaces are the interfaces the daemon manages.
	Interfaces() []string
	// UserspaceCounters are what pion/turn relayed.
	UserspaceCounters() *userspace.Counters
	// MirrorStats are the mirror's counters and the channel bindings pion holds.
	MirrorStats() (st mirror.Stats, channels int)
	// UserspaceBindings are pion's bindings that stay in userspace, by reason.
	UserspaceBindings() map[string]int
	// NodeLabel is the state of the node's offload label.
	NodeLabel() nodelabel.State
	// Steering is the node's listener steering (nil without it).
	Steering() (*steering.Stats, error)
	// Traffic is the listeners' and clusters' accounting.
	Traffic() *Traffic
	// Quota is the allocation quotas' counts.
	Quota() quota.Stats
	// Guards are the counts of the checks in front of pion: the TCP and TLS
	// connection limits and the per-allocation request checks.
	Guards() Guards
	// Kernel is what the node's kernel gives the kernel path.
	Kernel() Kernel
}

// Guards are what the connection limits and the request checks refused.
type Guards struct {
	Conns connlimit.Stats
	// WrongCredentials got 441, StaleNonces 438, ChannelsRefused 508.
	WrongCredentials, StaleNonces, ChannelsRefused uint64
}

// NewRegistry returns a registry with STUNner's series, the fast path's, and
// Go's and the process's.
func NewRegistry(src Source) *prometheus.Registry {
	r := prometheus.NewRegistry()
	r.MustRegister(newStunnerCollector(src), newCollector(src),
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return r
}

// counter and gauge emit one constant metric.
func counter(ch chan<- prometheus.Metric, d *prometheus.Desc, v uint64, labels ...string) {
	ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v), labels...)
}

func gauge(ch chan<- prometheus.Metric, d *prometheus.Desc, v float64, labels ...string) {
	ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
}

// collector exports the fast path's own series. The per-CPU maps are summed
// in Go at scrape time, nothing is copied on the packet path.
type collector struct {
	src                                            Source
	packets, bytes, verdicts, allocs, chans, bound *prometheus.Desc
	attached, mirrorEvents, mirrorErrors, drift    *prometheus.Desc
	mode, label, steering, userspace, full         *prometheus.Desc
	refused, permRefused, userRateLimited          *prometheus.Desc
	shortcut, ttlExpired, tcpConns, tcpRefused     *prometheus.Desc
	userShield                                     *prometheus.Desc
	peerShortcut                                   *prometheus.Desc
	tcpClosed, oversized, requestsRefused          *prometheus.Desc
	tcVerdicts, kernel, evicted                    *prometheus.Desc
}

func newCollector(src Source) *collector {
	return &collector{
		src:          src,
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
		mode:         prometheus.NewDesc("stunnerd_xdp_mode", "1 for the path in use: native or generic (XDP attached somewhere in that mode), tc (the TC engine alone where another daemon's XDP program holds the interface) or off (userspace only).", []string{"mode"}, nil),
		steering:     prometheus.NewDesc("stunnerd_xdp_steering_total", "Listener packets the node's SO_REUSEPORT steering sent to the allocation's daemon (owner), the newest daemon (active), or left to the kernel's hash.", []string{"verdict"}, nil),
		label:        prometheus.NewDesc("stunnerd_xdp_offload_label", "1 for the state of the node's stunner.l7mp.io/xdp-offload label (absent without --node-name).", []string{"state"}, nil),
		userspace: prometheus.NewDesc("stunnerd_xdp_bindings_userspace",
			"Channel bindings pion/turn holds that stay on the userspace path, by reason: nat (the kernel NATs the flow), "+
				"no_offload_peer (--no-offload-peer or a Service CIDR), pending (no conntrack evidence yet), full (the maps are full), "+
				"xfrm (an xfrm policy blocks or encrypts the flow), client_conntrack (the client's conntrack entry was removed and no new one leads here yet); "+
				"while no program carries bindings, every binding under why: off (the XDP mode is off), program_refused (the kernel refused the program), "+
				"no_kernel_path (XDP is wanted but attached nowhere).",
			[]string{"reason"}, nil),
		refused: prometheus.NewDesc("stunnerd_xdp_allocations_refused_total",
			"Allocate requests answered 486 (Allocation Quota Reached), by reason: user_quota, total_quota, draining.", []string{"reason"}, nil),
		permRefused: prometheus.NewDesc("stunnerd_xdp_permissions_refused_total",
			"Permissions (CreatePermission, ChannelBind) refused because the allocation holds --max-permissions peers.", nil, nil),
		userRateLimited: prometheus.NewDesc("stunnerd_xdp_userspace_rate_limited_total",
			"Datagrams pion's relay sockets dropped over the allocation rate limit (--max-alloc-pps/-bps; the XDP program counts its own as verdict rate_limited).", nil, nil),
		full: prometheus.NewDesc("stunnerd_xdp_bindings_full_total", "Channel bindings the full XDP maps refused (--max-bindings).", nil, nil),
		evicted: prometheus.NewDesc("stunnerd_xdp_bindings_evicted_total",
			"Offloaded channel bindings that left the kernel's maps while pion/turn kept them, by reason: conntrack_deleted (the conntrack entry of "+
				"their relay<->peer or client<->listener flow was deleted through netlink: conntrack -D or -F, kube-proxy, a CNI), conntrack_expired "+
				"(the kernel removed it itself: timeout, early drop, NAT clean-up), conntrack_missing (found missing after conntrack notifications "+
				"were lost), xfrm (an xfrm policy blocks or encrypts the flow).",
			[]string{"reason"}, nil),
		tcpConns: prometheus.NewDesc("stunnerd_xdp_tcp_connections", "Open TURN-TCP and TURN-TLS connections.", nil, nil),
		tcpRefused: prometheus.NewDesc("stunnerd_xdp_tcp_connections_refused_total",
			"TURN-TCP and TURN-TLS connections reset at accept, by the cap reached: total (--max-tcp-conns) or source (--max-tcp-conns-per-source).", []string{"cap"}, nil),
		tcpClosed: prometheus.NewDesc("stunnerd_xdp_tcp_connections_timed_out_total",
			"TURN-TCP and TURN-TLS connections closed at a timeout: handshake (--tls-handshake-timeout), frame (--tcp-frame-timeout), idle (--tcp-idle-timeout).", []string{"timeout"}, nil),
		oversized: prometheus.NewDesc("stunnerd_xdp_tcp_oversized_frames_total",
			"Frames over 1,599 bytes on TURN-TCP and TURN-TLS connections, discarded as they arrived (pion discards them too).", nil, nil),
		requestsRefused: prometheus.NewDesc("stunnerd_xdp_requests_refused_total",
			"TURN requests refused before pion/turn saw them, by reason: wrong_credentials (441: another user's credentials on an allocation), "+
				"stale_nonce (438: a nonce over 600 s old), channel_limit (508: --max-channels).", []string{"reason"}, nil),
		shortcut: prometheus.NewDesc("stunnerd_xdp_userspace_shortcut_packets_total",
			"Client-to-peer ChannelData datagrams the read loops relayed on pion/turn's channels without its per-datagram handling (--channeldata-shortcut); a part of the userspace path's packets.", nil, nil),
		peerShortcut: prometheus.NewDesc("stunnerd_xdp_userspace_peer_shortcut_packets_total",
			"Peer-to-client datagrams the relay sockets relayed to clients (ChannelData or Data indications) without pion/turn's per-datagram handling (--channeldata-shortcut); a part of the userspace path's packets.", nil, nil),
		ttlExpired: prometheus.NewDesc("stunnerd_xdp_userspace_ttl_expired_total",
			"Datagrams the userspace path dropped, in either direction, because they arrived with a TTL (hop limit) of 1 or 0 (RFC 8656 section 14; the XDP program passes them to userspace as verdict pass_ttl_expired).", nil, nil),
		userShield: prometheus.NewDesc("stunnerd_xdp_userspace_shield_dropped_total",
			"Datagrams the read loops' listener shield (--listener-shield) dropped before pion/turn parsed them, by reason as the kernel path names them: "+
				"drop_shield_no_allocation, drop_shield_not_turn, drop_shield_stun_unhandled, drop_shield_admission (what the kernel dropped is in stunnerd_xdp_verdicts_total).",
			[]string{"reason"}, nil),
		tcVerdicts: prometheus.NewDesc("stunnerd_xdp_tc_verdicts_total",
			"Packets seen by the TC engine, by the reason for its verdict (the XDP program's reasons, and its own: pass_gso, pass_checksum_partial_elsewhere, drop_rewrite_failed); absent while the engine is not loaded.",
			[]string{"reason"}, nil),
		kernel: prometheus.NewDesc("stunnerd_xdp_kernel_info",
			"1, labelled with what the node's kernel gives the kernel path: release, xdp_features (true: the kernel says which devices transmit XDP frames, 6.3+; "+
				"false: decided per device), program (loaded, refused: the kernel refused the XDP program, not_loaded), tc_engine (tcx, clsact, loaded, none), "+
				"handover (on, off, unavailable).",
			[]string{"release", "xdp_features", "program", "tc_engine", "handover"}, nil),
	}
}

func (c *collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.packets, c.bytes, c.verdicts, c.tcVerdicts, c.allocs, c.chans, c.bound, c.attached, c.mirrorEvents, c.mirrorErrors, c.drift, c.mode, c.label, c.steering, c.userspace, c.full, c.evicted, c.refused, c.permRefused, c.userRateLimited, c.shortcut, c.peerShortcut, c.ttlExpired,
		c.userShield, c.tcpConns, c.tcpRefused, c.tcpClosed, c.oversized, c.requestsRefused, c.kernel} {
		ch <- d
	}
}

func (c *collector) Collect(ch chan<- prometheus.Metric) {
	u := c.src.UserspaceCounters()
	counter(ch, c.packets, u.ClientToPeerPackets.Load(), "userspace", "client_to_peer")
	counter(ch, c.userRateLimited, u.RateLimited.Load())
	counter(ch, c.shortcut, u.ShortcutPackets.Load())
	counter(ch, c.peerShortcut, u.PeerShortcutPackets.Load())
	counter(ch, c.ttlExpired, u.TTLExpired.Load())
	for i, name := range shield.Names {
		counter(ch, c.userShield, u.Shield[i].Load(), name)
	}
	counter(ch, c.packets, u.PeerToClientPackets.Load(), "userspace", "peer_to_client")
	counter(ch, c.bytes, u.ClientToPeerBytes.Load(), "userspace", "client_to_peer")
	counter(ch, c.bytes, u.PeerToClientBytes.Load(), "userspace", "peer_to_client")

	if m := c.src.Maps(); m != nil {
		if xdp, err := m.Totals(); err == nil {
			counter(ch, c.packets, xdp.ClientToPeerPackets, "xdp", "client_to_peer")
			counter(ch, c.packets, xdp.PeerToClientPackets, "xdp", "peer_to_client")
			counter(ch, c.bytes, xdp.ClientToPeerBytes, "xdp", "client_to_peer")
			counter(ch, c.bytes, xdp.PeerToClientBytes, "xdp", "peer_to_client")
		} else {
			// A zero would read as a counter reset.
			ch <- prometheus.NewInvalidMetric(c.packets, err)
		}
		if v, err := m.Verdicts(); err == nil {
			for r, n := range v {
				counter(ch, c.verdicts, n, channelmap.ReasonName(r))
			}
		} else {
			ch <- prometheus.NewInvalidMetric(c.verdicts, err)
		}
		gauge(ch, c.bound, float64(m.Len()))
	} else {
		// Never loaded: nothing was relayed in the kernel.
		for _, dir := range []string{"client_to_peer", "peer_to_client"} {
			counter(ch, c.packets, 0, "xdp", dir)
			counter(ch, c.bytes, 0, "xdp", dir)
		}
	}

	if v, err := c.src.TCVerdicts(); err == nil {
		for r, n := range v {
			// The indices between the shared reasons and the engine's own
			// have no name: the engine never counts there.
			if name := channelmap.TCReasonName(r); name != "" {
				counter(ch, c.tcVerdicts, n, name)
			}
		}
	} else {
		ch <- prometheus.NewInvalidMetric(c.tcVerdicts, err)
	}

	gauge(ch, c.allocs, float64(c.src.AllocationCount()))
	st, chans := c.src.MirrorStats()
	gauge(ch, c.chans, float64(chans))

	attached := c.src.Attached()
	inUse := map[loader.Mode]bool{}
	for _, m := range attached {
		inUse[m] = true
	}
	for _, m := range []loader.Mode{loader.ModeNative, loader.ModeGeneric, loader.ModeTC, loader.ModeOff} {
		v := 0.0
		if inUse[m] || m == loader.ModeOff && len(attached) == 0 {
			v = 1
		}
		gauge(ch, c.mode, v, string(m))
	}
	state := c.src.NodeLabel()
	for _, s := range nodelabel.States {
		v := 0.0
		if s == state {
			v = 1
		}
		gauge(ch, c.label, v, s.String())
	}
	// The managed interfaces, and any renamed since the attach (the program
	// runs there still).
	ifaces := c.src.Interfaces()
	for iface := range attached {
		if !slices.Contains(ifaces, iface) {
			ifaces = append(ifaces, iface)
		}
	}
	for _, iface := range ifaces {
		for _, mode := range []loader.Mode{loader.ModeNative, loader.ModeGeneric, loader.ModeTC} {
			v := 0.0
			if attached[iface] == mode {
				v = 1
			}
			gauge(ch, c.attached, v, iface, string(mode))
		}
	}
	switch s, err := c.src.Steering(); {
	case err != nil:
		ch <- prometheus.NewInvalidMetric(c.steering, err)
	case s != nil:
		counter(ch, c.steering, s.Owner, "owner")
		counter(ch, c.steering, s.Active, "active")
		counter(ch, c.steering, s.Hash, "hash")
	}
	counter(ch, c.mirrorEvents, st.Events)
	counter(ch, c.mirrorErrors, st.Errors)
	counter(ch, c.drift, st.Drift)
	counter(ch, c.full, st.Full)
	for _, r := range mirror.EvictReasons {
		counter(ch, c.evicted, st.Evicted[r], r)
	}
	q := c.src.Quota()
	for _, r := range quota.Reasons {
		counter(ch, c.refused, q.Refused[r], r.String())
	}
	counter(ch, c.permRefused, q.PermissionsRefused)
	g := c.src.Guards()
	gauge(ch, c.tcpConns, float64(g.Conns.Open))
	counter(ch, c.tcpRefused, g.Conns.RefusedTotal, "total")
	counter(ch, c.tcpRefused, g.Conns.RefusedSource, "source")
	counter(ch, c.tcpClosed, g.Conns.HandshakeTimeouts, "handshake")
	counter(ch, c.tcpClosed, g.Conns.FrameTimeouts, "frame")
	counter(ch, c.tcpClosed, g.Conns.IdleTimeouts, "idle")
	counter(ch, c.oversized, g.Conns.OversizedFrames)
	counter(ch, c.requestsRefused, g.WrongCredentials, "wrong_credentials")
	counter(ch, c.requestsRefused, g.StaleNonces, "stale_nonce")
	counter(ch, c.requestsRefused, g.ChannelsRefused, "channel_limit")
	for reason, n := range c.src.UserspaceBindings() {
		gauge(ch, c.userspace, float64(n), reason)
	}
	k := c.src.Kernel()
	gauge(ch, c.kernel, 1, k.Release, strconv.FormatBool(k.XDPFeatures), k.Program, k.TCEngine, k.Handover)
}
