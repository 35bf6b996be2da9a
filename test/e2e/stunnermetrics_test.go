package e2e

import (
	"fmt"
	"net/netip"
	"testing"
	"time"

	"github.com/l7mp/stunnerd-xdp/test/netns"
	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// TestSTUNnerMetrics runs an echo session through a STUNner-configured
// listener and checks that STUNner's series (stunner_*) count it as stunnerd
// would, whichever path relayed it: every echo the client got back was
// received at the listener (rx), sent to the cluster (tx), received from it
// (rx) and sent to the client (tx). With XDP the kernel's packets must be in
// them, and /status reports them as the listener's and cluster's offload
// stats; with --xdp-mode=off the userspace path's count alone is the expectation, and
// stunnerd_xdp_userspace_shortcut_packets_total shows that the shortcut relayed it (or not).
// Both name sets, and Go's and the process's, are exported.
// otelScope are the constant labels of stunnerd's stunner_* series (its
// OpenTelemetry exporter's instrumentation scope).
const otelScope = `otel_scope_name="stunner",otel_scope_schema_url="",otel_scope_version=""`

func TestSTUNnerMetrics(t *testing.T) {
	if testenv.InNetns() {
		t.Skip("parent-only test")
	}
	eachMode(t, func(t *testing.T, mode string) {
		r := netns.NewRouted(t)
		// Two read loops: STUNner counts a UDP listener's sockets as its connections.
		startNode(t, r, mode, []nodeListener{{addr: "10.100.0.1", peers: []string{"10.200.0.0/24"}}}, "--udp-thread-num=2")
		startEcho(t, r.Peer, netip.MustParseAddrPort(peerAddr+":5002"))
		relay, err := allocateWith(t, r.Client, "10.100.0.1:3478", user, password, false)
		if err != nil {
			t.Fatal(err)
		}
		// The first echoes set up the channel and the kernel's reply source.
		if _, got, _ := echoSession(t, relay, 100, time.Second); got == 0 {
			t.Fatal("no echoes before the measurement")
		}
		before := scrape(t, r.Server)
		_, got, _ := echoSession(t, relay, 1000, 2*time.Second)
		if got < 1000 {
			t.Fatalf("only %d echoes", got)
		}
		after := scrape(t, r.Server)

		series := func(metric, dir, name string) string {
			return fmt.Sprintf(`%s{direction=%q,name=%q,%s}`, metric, dir, name, otelScope)
		}
		grew := func(metric, dir, name string) float64 {
			return after.grew(t, before, series(metric, dir, name))
		}
		xdpC2P := after.grew(t, before, `stunnerd_xdp_packets_total{direction="client_to_peer",path="xdp"}`)
		xdpP2C := after.grew(t, before, `stunnerd_xdp_packets_total{direction="peer_to_client",path="xdp"}`)
		xdpC2PBytes := after.grew(t, before, `stunnerd_xdp_bytes_total{direction="client_to_peer",path="xdp"}`)
		for _, c := range []struct {
			metric, dir, name string
			kernel            float64
		}{
			{"stunner_listener_packets_total", "rx", "udp-0", xdpC2P},
			{"stunner_listener_packets_total", "tx", "udp-0", xdpP2C},
			{"stunner_cluster_packets_total", "tx", "peers-0", xdpC2P},
			{"stunner_cluster_packets_total", "rx", "peers-0", xdpP2C},
		} {
			n := grew(c.metric, c.dir, c.name)
			if n < float64(got) {
				t.Errorf("%s grew by %v, fewer than the %d echoes", series(c.metric, c.dir, c.name), n, got)
			}
			if n < c.kernel {
				t.Errorf("%s grew by %v, fewer than the %v packets the kernel relayed that way", series(c.metric, c.dir, c.name), n, c.kernel)
			}
		}
		// A listener's bytes are whole datagrams: the data and the ChannelData header.
		if n := grew("stunner_listener_bytes_total", "rx", "udp-0"); n < xdpC2PBytes+4*xdpC2P {
			t.Errorf("listener rx bytes grew by %v, fewer than the kernel's %v", n, xdpC2PBytes+4*xdpC2P)
		}
		if n := grew("stunner_cluster_bytes_total", "tx", "peers-0"); n < float64(got*taggedSize) {
			t.Errorf("cluster tx bytes grew by %v, fewer than %d echoes' payload", n, got)
		}
		switch mode {
		case "native":
			if xdpC2P < float64(got)*9/10 || xdpP2C < float64(got)*9/10 {
				t.Errorf("the kernel relayed %v/%v packets of %d echoes: the session was not on XDP", xdpC2P, xdpP2C, got)
			}
		case "off", "shortcut":
			if xdpC2P != 0 || xdpP2C != 0 {
				t.Errorf("the kernel relayed %v/%v packets with XDP off", xdpC2P, xdpP2C)
			}
		}
		// The shortcut relays the client's ChannelData in userspace, pion/turn
		// alone none of it.
		shortcut := after.grew(t, before, "stunnerd_xdp_userspace_shortcut_packets_total")
		switch {
		case mode == "shortcut" && shortcut < float64(got):
			t.Errorf("the shortcut relayed %v packets of %d echoes", shortcut, got)
		case mode == "off" && shortcut != 0:
			t.Errorf("the shortcut relayed %v packets with --channeldata-shortcut=false", shortcut)
		}
		for name, want := range map[string]float64{"stunner_allocations_active{" + otelScope + "}": 1, "stunnerd_xdp_allocations_active": 1,
			`stunner_listener_connections{name="udp-0",` + otelScope + `}`: 2, `stunner_listener_connections_total{name="udp-0",` + otelScope + `}`: 2,
			`target_info{service_name="stunner"}`: 1} {
			if v := after.get(t, name); v != want {
				t.Errorf("%s = %v, want %v", name, v, want)
			}
		}
		after.get(t, "go_goroutines")
		after.get(t, "process_cpu_seconds_total")

		// /status: the listener's and cluster's offload stats are what the kernel relayed.
		st := status(t, r.Server)
		if len(st.Listeners) != 1 || len(st.Clusters) != 1 || st.AllocationCount != 1 || st.Status != "READY" {
			t.Fatalf("/status: %+v", st)
		}
		l, c := st.Listeners[0], st.Clusters[0]
		kernelRx := after.get(t, `stunnerd_xdp_packets_total{direction="client_to_peer",path="xdp"}`)
		if l.Name != "udp-0" || c.Name != "peers-0" || float64(l.Stats.Rx.Pkts) < kernelRx || float64(c.Stats.Tx.Pkts) < kernelRx {
			t.Errorf("/status listener %s rx %d, cluster %s tx %d packets; the kernel relayed %v", l.Name, l.Stats.Rx.Pkts, c.Name, c.Stats.Tx.Pkts, kernelRx)
		}
		if mode != "native" && (l.Stats.Rx.Pkts != 0 || c.Stats.Tx.Pkts != 0) {
			t.Errorf("/status reports offloaded packets with XDP off: %+v %+v", l.Stats, c.Stats)
		}
	})
}
