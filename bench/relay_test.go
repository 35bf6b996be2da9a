package bench

import (
	"fmt"
	"math"
	"net"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/l7mp/stunnerd-xdp/test/netns"
)

// serverSpec is one relay under test, run as its own process in the server
// namespace so that its CPU time can be read from /proc/PID/stat.
type serverSpec struct {
	name    string
	xdpMode string // stunnerd-xdp's --xdp-mode; "" for the other servers
	direct  bool   // no server: kernel forwarding between client and peer
	// fromServer sends from the server namespace straight to the peer: what
	// delivering the packets costs without any relay (subtracted as a floor).
	fromServer bool
	argv       func(h *harness, dir string) []string
}

var (
	listenAddr = &net.UDPAddr{IP: listenIP, Port: listenPort}
	turnURI    = fmt.Sprintf("turn://%s:%s@%s:%d", user, password, listenIP, listenPort)
)

// daemonSpec runs stunnerd-xdp. Listener steering is off unless steered (then
// its maps go to the harness's private bpffs), so that every row says which.
func daemonSpec(name, mode string, steered bool) serverSpec {
	return serverSpec{name: name, xdpMode: mode, argv: func(h *harness, _ string) []string {
		handover := "--steering-dir="
		if steered {
			handover += h.pins
		}
		return []string{h.daemonBin, "--log=all:WARN", "--xdp-mode=" + mode, "--relay-address=" + relayIP.String(),
			// The peer is in a private network the defaults refuse: opened
			// for it alone, as coturn's --allowed-peer-ip below.
			handover, "--allow-peer=" + peerIP.String() + "/32", "--metrics-addr=127.0.0.1:8080", "--health-addr=", turnURI}
	}}
}

var (
	specXDPNative     = daemonSpec(ServerXDPNative, "native", false)
	specXDPGeneric    = daemonSpec(ServerXDPGeneric, "generic", false)
	specXDPOff        = daemonSpec(ServerXDPOff, "off", false)
	specXDPOffSteered = daemonSpec(ServerXDPOffSteered, "off", true)
	specStunnerd      = serverSpec{name: ServerStunnerd, argv: func(h *harness, _ string) []string {
		// URI mode: plaintext auth, an allow-any cluster, one UDP read loop (-u 0).
		return []string{h.stunnerdBin, "-l", "all:WARN", turnURI}
	}}
	specCoturn = serverSpec{name: ServerCoturn, argv: func(_ *harness, dir string) []string {
		// As in BASELINES.md: by hand, never as a service.
		return []string{"turnserver", "-n", "--listening-ip=" + listenIP.String(), "--listening-port=" + strconv.Itoa(listenPort),
			"--relay-ip=" + relayIP.String(), "--lt-cred-mech", "--user=" + user + ":" + password, "--realm=bench.local",
			"--no-tls", "--no-dtls", "--no-cli", "--allowed-peer-ip=" + peerIP.String(),
			"--log-file=" + filepath.Join(dir, "turnserver.log"), "--simple-log", "--no-stdout-log",
			"--pidfile=" + filepath.Join(dir, "turnserver.pid")}
	}}
	specKernelFwd = serverSpec{name: ServerKernelFwd, direct: true}
	specFloor     = serverSpec{name: ServerDeliveryFloor, direct: true, fromServer: true}
)

// runningServer is a started server process.
type runningServer struct {
	spec serverSpec
	proc *netns.Proc
}

// stopGrace is how long a server gets after SIGTERM. stunnerd v1.1.0 waits for
// live allocations on SIGTERM and keeps serving meanwhile (BASELINES.md), so
// it gets SIGKILL after this.
const stopGrace = 2 * time.Second

// startServer starts a server, refusing while the listener port is still bound
// (a lingering server would take the traffic through SO_REUSEPORT), and waits
// until it listens; stunnerd-xdp must also have XDP attached in the asked mode.
func (h *harness) startServer(t *testing.T, spec serverSpec) *runningServer {
	t.Helper()
	if bound, err := h.rig.Server.UDPBound(listenPort); err != nil || bound {
		t.Fatalf("UDP port %d is still bound in the server namespace: refusing to start %s", listenPort, spec.name)
	}
	argv := spec.argv(h, t.TempDir())
	h.command("ip netns exec SERVER_NS %s", strings.Join(argv, " "))
	rs := &runningServer{spec: spec, proc: h.rig.Server.Start(t, argv[0], argv[1:]...)}
	if err := h.rig.Server.WaitUDPBound(listenPort, 10*time.Second, rs.proc); err != nil {
		t.Fatalf("%s is not listening on %d: %v\nstdout: %s\nstderr: %s", spec.name, listenPort, err, rs.proc.Stdout(), rs.proc.Stderr())
	}
	if spec.xdpMode != "" && spec.xdpMode != "off" {
		var metrics netns.Metrics
		if err := netns.Eventually(5*time.Second, 50*time.Millisecond, func() (err error) {
			metrics, err = h.scrape()
			return err
		}); err != nil {
			t.Fatalf("%s metrics: %v", spec.name, err)
		}
		for _, iface := range h.rig.ServerIfaces() {
			if v := metric(metrics, "stunnerd_xdp_attached", "iface", iface, "mode", spec.xdpMode); v != 1 {
				t.Fatalf("%s: XDP not attached to %s in %s mode (stunnerd_xdp_attached=%v):\n%s", spec.name, iface, spec.xdpMode, v, rs.proc.Stderr())
			}
		}
	}
	return rs
}

// stopServer sends SIGTERM, then SIGKILL after stopGrace, and waits until the
// listener port is free again.
func (h *harness) stopServer(t *testing.T, rs *runningServer) {
	t.Helper()
	if !rs.proc.Exited() {
		_ = syscall.Kill(-rs.proc.PID(), syscall.SIGTERM)
		_ = rs.proc.Wait(stopGrace)
		if !rs.proc.Exited() {
			t.Logf("%s ignored SIGTERM for %v: SIGKILL", rs.spec.name, stopGrace)
			_ = rs.proc.Kill()
		}
	}
	if err := netns.Eventually(5*time.Second, 50*time.Millisecond, func() error {
		if bound, err := h.rig.Server.UDPBound(listenPort); err != nil || !bound {
			return err
		}
		return fmt.Errorf("UDP port %d is still bound", listenPort)
	}); err != nil {
		t.Fatalf("%s stopped: %v", rs.spec.name, err)
	}
}

// scrape fetches stunnerd-xdp's /metrics from inside the server namespace.
func (h *harness) scrape() (netns.Metrics, error) {
	return h.rig.Server.Scrape("http://127.0.0.1:8080/metrics")
}

// metric sums the samples of name with the labels (name, value pairs); NaN
// when the daemon exports none.
func metric(m netns.Metrics, name string, labels ...string) float64 {
	if v, ok := m.Sum(name, labels...); ok {
		return v
	}
	return math.NaN()
}

// xdpPackets returns the client->peer packets relayed by XDP and by userspace.
func xdpPackets(m netns.Metrics) (xdp, user float64) {
	return metric(m, "stunnerd_xdp_packets_total", "path", "xdp", "direction", "client_to_peer"),
		metric(m, "stunnerd_xdp_packets_total", "path", "userspace", "direction", "client_to_peer")
}

// ---- stage 2: end to end ----

func (h *harness) stageRelay(t *testing.T) {
	defer enableBPFStats(t).Close()
	h.command("sysctl kernel.bpf_stats_enabled=1 while the relay stage runs (BPF_ENABLE_STATS)")
	for _, spec := range []serverSpec{specFloor, specKernelFwd, specXDPNative, specXDPGeneric, specXDPOff, specXDPOffSteered, specStunnerd, specCoturn} {
		t.Run(spec.name, func(t *testing.T) { h.relayOne(t, spec) })
	}
	// Added latency: each percentile minus the direct path's.
	var direct *LatencyRow
	for i := range h.rep.Latency {
		if h.rep.Latency[i].Server == ServerKernelFwd {
			direct = &h.rep.Latency[i]
		}
	}
	for i := range h.rep.Latency {
		l := &h.rep.Latency[i]
		if direct == nil {
			l.AddedP50Us, l.AddedP99Us, l.AddedP999Us = math.NaN(), math.NaN(), math.NaN()
			continue
		}
		l.AddedP50Us, l.AddedP99Us, l.AddedP999Us = l.P50Us-direct.P50Us, l.P99Us-direct.P99Us, l.P999Us-direct.P999Us
	}
}

// directRoutes lets client and peer reach each other through the server's
// kernel forwarding (per-interface forwarding is on in the rig) until cleanup.
func (h *harness) directRoutes(t *testing.T) func() {
	t.Helper()
	h.rig.Client.IP(t, "route", "add", "10.200.0.0/24", "via", listenIP.String(), "dev", h.rig.ClientIf.Name)
	h.rig.Peer.IP(t, "route", "add", "10.100.0.0/24", "via", relayIP.String(), "dev", h.rig.PeerIf.Name)
	h.command("ip -n CLIENT_NS route add 10.200.0.0/24 via %s; ip -n PEER_NS route add 10.100.0.0/24 via %s (kernel forwarding rows)", listenIP, relayIP)
	return func() {
		h.rig.Client.IP(t, "route", "del", "10.200.0.0/24")
		h.rig.Peer.IP(t, "route", "del", "10.100.0.0/24")
	}
}

func (h *harness) relayOne(t *testing.T, spec serverSpec) {
	var pids []int
	var sess *session
	switch {
	case spec.fromServer:
		sess = newSessionIn(t, h, h.rig.Server, relayIP, nil)
	case spec.direct:
		defer h.directRoutes(t)()
		sess = newSession(t, h, nil)
	default:
		rs := h.startServer(t, spec)
		defer h.stopServer(t, rs)
		pids = []int{rs.proc.PID()}
		sess = newSession(t, h, listenAddr)
	}
	defer sess.close()
	for _, rung := range h.ladder() {
		p := h.measure(t, spec, []*stream{sess.stream(rung.size)}, rung.rate, pids)
		p.Payload = rung.size
		h.rep.Relay = append(h.rep.Relay, p)
		t.Logf("%s %d B target %s: offered %.0f delivered %.0f pps, loss %.2f %%, server %.2f µs/pkt (process %.2f + softirq %.2f), xdp share %.3f",
			spec.name, rung.size, rateLabel(rung.rate), p.OfferedPPS, p.DeliveredPPS, p.LossPercent, p.TotalUsPerPkt, p.ProcUsPerPkt, p.SoftUsPerPkt, p.XDPShare)
	}
	if spec.fromServer {
		return // no relay in the path: no latency row
	}
	lat := sess.latency(t, spec.name, h.cfg.latencyRate, h.cfg.latencyDur, 100)
	t.Logf("%s latency: %d/%d echoed, p50 %.1f p99 %.1f p99.9 %.1f µs", spec.name, lat.Received, lat.Sent, lat.P50Us, lat.P99Us, lat.P999Us)
	h.rep.Latency = append(h.rep.Latency, lat)
}

type rung struct {
	size int
	rate float64
}

func (h *harness) ladder() []rung {
	var out []rung
	for _, r := range h.cfg.ladder100 {
		out = append(out, rung{100, r})
	}
	for _, r := range h.cfg.ladder1200 {
		out = append(out, rung{1200, r})
	}
	return out
}

// measure offers one rung of load and reads what arrived and what it cost.
func (h *harness) measure(t *testing.T, spec serverSpec, streams []*stream, rate float64, pids []int) RelayPoint {
	t.Helper()
	workers := 1
	if rate == 0 {
		workers = h.cfg.maxWorkers
	}
	xdp := spec.xdpMode != ""
	time.Sleep(300 * time.Millisecond) // what the previous rung queued drains
	// Delivered is counted where the load goes: the peer, or the client
	// (the userspace stage's peer->client load).
	dest := h.rig.Peer
	if h.userspaceP2C {
		dest = h.rig.Client
	}
	peerBefore, srvBefore := dest.Snmp(t), h.rig.Server.Snmp(t)
	var mBefore netns.Metrics
	if xdp {
		var err error
		if mBefore, err = h.scrape(); err != nil {
			t.Fatal(err)
		}
	}
	var progBefore progStats
	if xdp && spec.xdpMode != "off" {
		progBefore = h.relayProgStats(t)
	}
	cpuBefore, err := takeCPU(pids...)
	if err != nil {
		t.Fatal(err)
	}
	g := generate(streams, rate, h.cfg.point, workers)
	time.Sleep(300 * time.Millisecond) // the relays empty their socket buffers
	cpuAfter, err := takeCPU(pids...)
	if err != nil {
		t.Fatal(err)
	}
	var progNs float64
	if xdp && spec.xdpMode != "off" {
		progNs = h.relayProgStats(t).nsPerRunSince(progBefore)
	}
	peerAfter, srvAfter := dest.Snmp(t), h.rig.Server.Snmp(t)
	p := RelayPoint{Server: spec.name, TargetPPS: rate, Workers: workers, Seconds: g.elapsed.Seconds(), Sent: g.sent,
		SendErrors: g.retries, XDPShare: -1, ProgNsPerRun: progNs}
	got := delivered(peerAfter) - delivered(peerBefore)
	if got < 0 {
		got = 0
	}
	p.Delivered = uint64(got)
	p.OfferedPPS = float64(g.sent) / g.elapsed.Seconds()
	p.DeliveredPPS = float64(got) / g.elapsed.Seconds()
	p.LossPercent = 100 * (1 - float64(got)/float64(g.sent))
	p.ProcUsPerPkt = usPer(cpuAfter.proc-cpuBefore.proc, float64(got))
	if spec.direct {
		p.ProcUsPerPkt = 0
	}
	p.SoftUsPerPkt = usPer(cpuAfter.soft-cpuBefore.soft, float64(got))
	p.TotalUsPerPkt = p.ProcUsPerPkt + p.SoftUsPerPkt
	p.BusyUsPerPkt = usPer(cpuAfter.busy-cpuBefore.busy, float64(got))
	p.ServerRcvbuf = srvAfter["Udp.RcvbufErrors"] - srvBefore["Udp.RcvbufErrors"]
	if xdp {
		mAfter, err := h.scrape()
		if err != nil {
			t.Fatal(err)
		}
		x0, u0 := xdpPackets(mBefore)
		x1, u1 := xdpPackets(mAfter)
		if dx, du := x1-x0, u1-u0; dx+du > 0 {
			p.XDPShare = dx / (dx + du)
		} else {
			p.XDPShare = 0
		}
		// The steered row must really have run the steering: every
		// datagram to the listener is an owner verdict.
		owner := func(m netns.Metrics) float64 { return metric(m, "stunnerd_xdp_steering_total", "verdict", "owner") }
		if spec.name == ServerXDPOffSteered && !(owner(mAfter)-owner(mBefore) >= 0.5*float64(got)) { // NaN: no metric
			t.Errorf("%s: %.0f owner verdicts for %d delivered packets: the steering did not run", spec.name, owner(mAfter)-owner(mBefore), got)
		}
	}
	return p
}

// ---- stage 3: iperf2 through turncat ----

func (h *harness) stageIperf(t *testing.T) {
	// As test/e2e: turncat has no socket-buffer flag (netns.TurncatRmem).
	old, restore, err := netns.RaiseRmemDefault()
	if err != nil {
		t.Fatal(err)
	}
	defer restore()
	h.command("sysctl -w net.core.rmem_default=%s during the iperf stage (restored to %s after)", netns.TurncatRmem, old)
	for _, spec := range []serverSpec{specXDPNative, specXDPOff, specStunnerd, specCoturn} {
		t.Run(spec.name, func(t *testing.T) { h.iperfOne(t, spec) })
	}
}

func (h *harness) iperfOne(t *testing.T, spec serverSpec) {
	rs := h.startServer(t, spec)
	defer h.stopServer(t, rs)
	rate, secs, size := h.cfg.iperfRate, h.cfg.iperfSeconds, 100
	serverArgs := []string{"-e", "-w", "4M"}
	server := h.rig.Peer.StartIperfServer(t, iperfPort, serverArgs...)
	defer func() { _ = server.Stop() }() // its report was read: how it ends does not matter
	peer := fmt.Sprintf("%s:%d", peerIP, iperfPort)
	tc := h.rig.Client.StartTurncat(t, turnURI, peer)
	defer func() { _ = tc.Stop() }()
	clientArgs := []string{"-c", "127.0.0.1", "-p", "5000", "-u", "-l", strconv.Itoa(size), "-b", fmt.Sprintf("%dpps", rate), "-t", strconv.Itoa(secs), "-e"}
	if spec.name == ServerXDPNative {
		h.command("ip netns exec PEER_NS iperf -s -u -p %d %s", iperfPort, strings.Join(serverArgs, " "))
		h.command("ip netns exec CLIENT_NS %s --log=all:WARN udp://127.0.0.1:%d %s udp://%s", h.turncatBin, netns.TurncatPort, turnURI, peer)
		h.command("ip netns exec CLIENT_NS iperf %s", strings.Join(clientArgs, " "))
	}
	before, err := takeCPU(rs.proc.PID(), tc.PID())
	if err != nil {
		t.Fatal(err)
	}
	srvBefore, _ := procTicks(rs.proc.PID())
	tcBefore, _ := procTicks(tc.PID())
	out := h.rig.Client.Run(t, "iperf", clientArgs...)
	res, err := server.IperfReport(5 * time.Second)
	if err != nil {
		t.Fatalf("no iperf server report: %v\nclient: %s", err, out)
	}
	after, err := takeCPU(rs.proc.PID(), tc.PID())
	if err != nil {
		t.Fatal(err)
	}
	srvAfter, _ := procTicks(rs.proc.PID())
	tcAfter, _ := procTicks(tc.PID())
	pk := float64(res.Received)
	row := IperfRow{Server: spec.name, RatePPS: rate, Payload: size, Seconds: secs, Sent: res.Total, Received: res.Received,
		LossPercent: res.LossPercent, ProcUsPerPkt: usPer(srvAfter-srvBefore, pk), TurncatUs: usPer(tcAfter-tcBefore, pk)}
	row.TotalUsPerPkt = row.ProcUsPerPkt + usPer(after.soft-before.soft, pk)
	if math.IsNaN(row.LossPercent) && res.Total > 0 {
		row.LossPercent = 100 * float64(res.Lost) / float64(res.Total)
	}
	t.Logf("%s iperf: %+v", spec.name, row)
	h.rep.Iperf = append(h.rep.Iperf, row)
}
