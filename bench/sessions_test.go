package bench

import (
	"fmt"
	"math"
	"net"
	"os"
	"runtime"
	"sort"
	"strconv"
	"sync"
	"testing"
	"time"
	"unsafe"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/l7mp/stunnerd-xdp/internal/channelmap"
	"github.com/l7mp/stunnerd-xdp/internal/loader"
	"github.com/l7mp/stunnerd-xdp/internal/mirror"
	"github.com/l7mp/stunnerd-xdp/test/netns"
	"github.com/l7mp/stunnerd-xdp/test/packet"
)

// ---- stage: many sessions, each a WebRTC-like mix in both directions ----
//
// A session is an allocation with one channel to the peer: its client sends
// ChannelData from its own socket (its own 5-tuple), the peer sends plain UDP
// to its relay address. Each session sends audio (100 B of application data
// at 50 packets/s) and video (1,100 B at 100 packets/s) each way, 150
// packets/s per direction, interleaved over the sessions in turn (session
// k%N sends packet k), so that between two packets of one session every
// other session sends one.
//
// The kernel rows load and attach the daemon's program in this process and
// make the sessions by calling mirror.Mirror's hooks (as the scaling stage):
// each session is its own allocation (client port, relay port) with one
// channel, never made by pion/turn. Each N is measured with the flow cache,
// without it (the program reloaded with loader.Config.NoFlowCache over the
// same maps), and as one flow carrying the same packets per second, in turns.
// The daemon rows (XDP native, --xdp-mode=off, coturn) run real pion/turn
// allocations, fewer of them: each takes a few hundred ms to set up.

const (
	sessionAudio    = 100 // bytes of application data
	sessionVideo    = 1100
	sessionPPS      = 150 // per direction per session: 50 audio + 100 video
	sessionPortBase = 20000
)

// mixLoad is what the generator sends: session i's client socket
// clientFDs[i] sends ChannelData on channel to the listener, the peer's
// socket peerFD sends to relays[i].
type mixLoad struct {
	clientFDs []int
	listener  unix.RawSockaddrInet4
	peerFD    int
	relays    []unix.RawSockaddrInet4
	// c2p and p2c hold the audio and the video datagram of each direction.
	c2p, p2c [2][]byte
}

func newMixLoad(channel uint16, listener unix.RawSockaddrInet4, peerFD int) *mixLoad {
	audio, video := make([]byte, sessionAudio), make([]byte, sessionVideo)
	for i := range video {
		video[i] = byte(i)
	}
	copy(audio, video)
	return &mixLoad{listener: listener, peerFD: peerFD,
		c2p: [2][]byte{packet.ChannelData(channel, audio, nil), packet.ChannelData(channel, video, nil)},
		p2c: [2][]byte{audio, video}}
}

// first returns the load of the first n sessions.
func (l *mixLoad) first(n int) *mixLoad {
	c := *l
	c.clientFDs, c.relays = l.clientFDs[:n], l.relays[:n]
	return &c
}

// kind is the datagram (0 audio, 1 video) of the k-th packet over n
// sessions: each session sends audio, video, video in its turns.
func kind(k, n int) int {
	if (k/n)%3 == 0 {
		return 0
	}
	return 1
}

// mixSent is what one interval of the generator sent.
type mixSent struct {
	c2p, p2c, retries uint64
	elapsed           time.Duration
}

// send sends for dur at rate packets/s per direction, one thread per
// direction, paced in bursts of about a millisecond's worth. A datagram the
// socket refuses (EAGAIN, ENOBUFS) is not retried: the offered rate is what
// was sent.
func (l *mixLoad) send(rate float64, dur time.Duration) mixSent {
	start := time.Now()
	// run paces step, which sends up to due datagrams from the k-th on.
	run := func(step func(k, due int) (sent, failed int)) (sent, failed uint64) {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		k := 0
		for {
			el := time.Since(start)
			if el >= dur {
				return sent, failed
			}
			due := int(rate*el.Seconds()) - k
			if due < 1 {
				time.Sleep(time.Duration((float64(k+1)/rate - el.Seconds()) * float64(time.Second)))
				continue
			}
			s, f := step(k, min(due, 256))
			k += s + f
			sent, failed = sent+uint64(s), failed+uint64(f)
		}
	}
	var res mixSent
	var c2pFailed, p2cFailed uint64
	var wg sync.WaitGroup
	wg.Add(2)
	go func() {
		defer wg.Done()
		n := len(l.clientFDs)
		res.c2p, c2pFailed = run(func(k, due int) (sent, failed int) {
			for i := range due {
				p := l.c2p[kind(k+i, n)]
				_, _, errno := unix.Syscall6(unix.SYS_SENDTO, uintptr(l.clientFDs[(k+i)%n]), uintptr(unsafe.Pointer(&p[0])), uintptr(len(p)),
					unix.MSG_DONTWAIT, uintptr(unsafe.Pointer(&l.listener)), unix.SizeofSockaddrInet4)
				if errno == 0 {
					sent++
				} else {
					failed++
				}
			}
			return sent, failed
		})
	}()
	go func() {
		defer wg.Done()
		var hdrs [batchSize]mmsghdr
		var iovs [batchSize]unix.Iovec
		n := len(l.relays)
		res.p2c, p2cFailed = run(func(k, due int) (sent, failed int) {
			b := min(due, batchSize)
			for i := range b {
				p := l.p2c[kind(k+i, n)]
				iovs[i].Base = &p[0]
				iovs[i].SetLen(len(p))
				hdrs[i].hdr.Name = (*byte)(unsafe.Pointer(&l.relays[(k+i)%n]))
				hdrs[i].hdr.Namelen = unix.SizeofSockaddrInet4
				hdrs[i].hdr.Iov = &iovs[i]
				hdrs[i].hdr.SetIovlen(1)
			}
			r, _, errno := unix.Syscall6(unix.SYS_SENDMMSG, uintptr(l.peerFD), uintptr(unsafe.Pointer(&hdrs[0])), uintptr(b), unix.MSG_DONTWAIT, 0, 0)
			if errno != 0 {
				r = 0
			}
			return int(r), b - int(r)
		})
	}()
	wg.Wait()
	res.retries, res.elapsed = c2pFailed+p2cFailed, time.Since(start)
	return res
}

// sessionProbe reads what one interval cost: the relay program's statistics
// (nil: none), the kernel's relayed packets per direction (nil: n/a) and the
// server processes' CPU.
type sessionProbe struct {
	relay    func() (progStats, error)
	kernel   func() (c2p, p2c float64, err error)
	verdicts func() ([]uint64, error) // the program's verdict counters (nil: none)
	pids     []int
	// warm is how long the sessions send before an interval is measured
	// (0: 100 ms, enough for every session's first packets).
	warm time.Duration
}

// trivialStats sums the statistics of the trivial XDP programs on the
// client's and the peer's veth, which every relayed frame meets.
func trivialStats(progs []*ebpf.Program) (progStats, error) {
	var sum progStats
	for _, p := range progs {
		s, err := statsOf(p)
		if err != nil {
			return sum, err
		}
		sum.runTime += s.runTime
		sum.runs += s.runs
	}
	return sum, nil
}

// sessionInterval offers rate packets/s per direction for one interval and
// adds what it measured to row.
func (h *harness) sessionInterval(t *testing.T, load *mixLoad, rate float64, probe sessionProbe, trivial []*ebpf.Program, row *SessionRow) mixSent {
	t.Helper()
	r := h.rig
	warm := probe.warm
	if warm == 0 {
		warm = 100 * time.Millisecond
	}
	load.send(rate, warm)              // warm up: every session's first packets, the neighbours
	time.Sleep(200 * time.Millisecond) // what the previous interval queued drains
	peer0, client0 := r.Peer.Snmp(t), r.Client.Snmp(t)
	var k0c, k0p float64
	var err error
	if probe.kernel != nil {
		if k0c, k0p, err = probe.kernel(); err != nil {
			t.Fatal(err)
		}
	}
	var v0 []uint64
	if probe.verdicts != nil {
		if v0, err = probe.verdicts(); err != nil {
			t.Fatal(err)
		}
	}
	var relay0, triv0 progStats
	if probe.relay != nil {
		if relay0, err = probe.relay(); err != nil {
			t.Fatal(err)
		}
	}
	if triv0, err = trivialStats(trivial); err != nil {
		t.Fatal(err)
	}
	cpu0, err := takeCPU(probe.pids...)
	if err != nil {
		t.Fatal(err)
	}
	sent := load.send(rate, h.cfg.sessionsPoint)
	time.Sleep(200 * time.Millisecond) // the relays empty their socket buffers
	cpu1, err := takeCPU(probe.pids...)
	if err != nil {
		t.Fatal(err)
	}
	triv1, err := trivialStats(trivial)
	if err != nil {
		t.Fatal(err)
	}
	if probe.relay != nil {
		relay1, err := probe.relay()
		if err != nil {
			t.Fatal(err)
		}
		row.ProgNs = append(row.ProgNs, relay1.nsPerRunSince(relay0))
		row.ProgRuns += relay1.runs - relay0.runs
		row.TrivialNs = append(row.TrivialNs, triv1.nsPerRunSince(triv0))
	}
	if probe.kernel != nil {
		row.KernelCounted = true
		k1c, k1p, err := probe.kernel()
		if err != nil {
			t.Fatal(err)
		}
		row.KernelC2P += uint64(max(0, k1c-k0c))
		row.KernelP2C += uint64(max(0, k1p-k0p))
	}
	if probe.verdicts != nil {
		v1, err := probe.verdicts()
		if err != nil {
			t.Fatal(err)
		}
		for i := range min(len(v0), len(v1)) {
			name := channelmap.ReasonName(i)
			if d := v1[i] - v0[i]; d > 0 && name != "relay_client_to_peer_redirect" && name != "relay_peer_to_client_redirect" {
				if row.OtherVerdicts == nil {
					row.OtherVerdicts = map[string]uint64{}
				}
				row.OtherVerdicts[name] += d
			}
		}
	}
	peer1, client1 := r.Peer.Snmp(t), r.Client.Snmp(t)
	row.Intervals++
	row.Seconds += sent.elapsed.Seconds()
	row.SentC2P += sent.c2p
	row.SentP2C += sent.p2c
	row.SendFailures += sent.retries
	row.DeliveredC2P += uint64(max(0, inDelivers(peer1)-inDelivers(peer0)))
	row.DeliveredP2C += uint64(max(0, inDelivers(client1)-inDelivers(client0)))
	row.procTicks += cpu1.proc - cpu0.proc
	row.softTicks += cpu1.soft - cpu0.soft
	return sent
}

// inDelivers is what reached a namespace's transport layer. The other
// stages count the UDP layer (delivered), but Udp.InDatagrams grows when a
// socket is read, not when a datagram is queued: with thousands of sockets
// that are never read, the datagrams queued in their buffers (a few each)
// would count nowhere, and the first interval of a large N would look lossy.
func inDelivers(c map[string]int64) int64 { return c["Ip.InDelivers"] }

func (h *harness) stageSessions(t *testing.T) {
	defer enableBPFStats(t).Close()
	h.command("sessions stage: N sessions (%v, and %v through the daemons), each %d B at 50 pps and %d B at 100 pps per direction; %d rounds of %v per row",
		h.cfg.sessionsN, h.cfg.sessionsServerN, sessionAudio, sessionVideo, h.cfg.sessionsRounds, h.cfg.sessionsPoint)
	trivial := h.trivialProgs(t)
	defer func() {
		for _, p := range trivial {
			_ = p.Close()
		}
	}()
	t.Run("kernel", func(t *testing.T) { h.sessionsKernel(t, trivial) })
	for _, spec := range []serverSpec{specXDPNative, specXDPOff, specCoturn} {
		for _, n := range h.cfg.sessionsServerN {
			t.Run(fmt.Sprintf("%s/%d", spec.name, n), func(t *testing.T) { h.sessionsServer(t, spec, n, trivial) })
		}
	}
}

// sessionsKernel measures the kernel rows: the program of this process, the
// sessions made through the mirror's hooks.
func (h *harness) sessionsKernel(t *testing.T, trivial []*ebpf.Program) {
	r := h.rig
	cfg := func(noFlow bool) loader.Config {
		c := scalingConfig()
		c.NoFlowCache = noFlow
		return c
	}
	prog, maps, m := h.attachMirrored(t, cfg(false))
	load := h.sessionLoad(t, h.cfg.sessionsN[len(h.cfg.sessionsN)-1])
	probe := sessionProbe{
		relay: func() (progStats, error) { return statsOf(prog.XDP()) },
		kernel: func() (float64, float64, error) {
			s, err := maps.Totals()
			return float64(s.ClientToPeerPackets), float64(s.PeerToClientPackets), err
		},
		verdicts: maps.Verdicts,
		// The daemon's mirror counts the bindings that send every
		// FlowGateInterval and sets the flow caches aside while many do
		// (channelmap.GateFlows): so does this stage, and each interval
		// starts after two counts over its own traffic.
		warm: 2*mirror.FlowGateInterval + 100*time.Millisecond,
	}
	stopGate := make(chan struct{})
	gateDone := make(chan struct{})
	go func() {
		defer close(gateDone)
		tick := time.NewTicker(mirror.FlowGateInterval)
		defer tick.Stop()
		for {
			select {
			case <-stopGate:
				return
			case <-tick.C:
				if err := maps.GateFlows(); err != nil {
					t.Errorf("flow gate: %v", err)
				}
			}
		}
	}()
	defer func() { close(stopGate); <-gateDone }()
	noFlow := func(off bool) {
		if err := r.Server.Do(func() error { return prog.Reconfigure(cfg(off)) }); err != nil {
			t.Fatal(err)
		}
	}
	installed := 0
	for _, n := range h.cfg.sessionsN {
		start := time.Now()
		installSessions(t, m, maps, load, installed, n)
		installed = n
		t.Logf("%d sessions installed in %.2f s", n, time.Since(start).Seconds())
		target := float64(n * sessionPPS)
		rows := []*SessionRow{{Path: SessionsFlowCache, Sessions: n, Bindings: n, TargetPPS: target},
			{Path: SessionsNoFlow, Sessions: n, Bindings: n, TargetPPS: target},
			{Path: SessionsOneFlow, Sessions: n, Bindings: 1}}
		if n == 1 {
			rows = rows[:2] // the flow-cache row is the one flow
		}
		all := load.first(n)
		if ab := os.Getenv("BENCH_SESSIONS_AB"); ab != "" {
			h.sessionsAB(t, prog, cfg(false), ab, all, target, probe, trivial, n)
			continue
		}
		for range h.cfg.sessionsRounds {
			got := h.sessionInterval(t, all, target, probe, trivial, rows[0])
			rows[0].FlowsAside = maps.FlowsAside() // as the gate left them after the interval
			noFlow(true)
			h.sessionInterval(t, all, target, probe, trivial, rows[1])
			noFlow(false)
			if len(rows) > 2 {
				// One flow at the packets/s the sessions were offered (the
				// generator may fall short of the target at large N).
				rate := math.Min(target, float64(max(got.c2p, got.p2c))/got.elapsed.Seconds())
				rows[2].TargetPPS += rate / float64(h.cfg.sessionsRounds) // the mean over the rounds
				h.sessionInterval(t, load.first(1), rate, probe, trivial, rows[2])
			}
		}
		for _, row := range rows {
			row.finish()
			h.logSession(t, row)
			h.rep.Sessions = append(h.rep.Sessions, *row)
		}
	}
}

// sessionsAB compares the embedded program (B) with the relay object obj (A:
// bpf/relay_bpfel.o built from other sources, with the same maps and
// .rodata) on the flow-cache row of n sessions, paired per round (the order
// alternating), as BENCH_LIVE_AB does for the live-cost rows:
// BENCH_SESSIONS_AB=obj logs B/A, the median of the rounds' ratios of relay
// ns/run, and puts nothing in the report.
func (h *harness) sessionsAB(t *testing.T, prog *loader.Program, base loader.Config, obj string, all *mixLoad, target float64,
	probe sessionProbe, trivial []*ebpf.Program, n int) {
	use := func(object string) {
		c := base
		c.Object = object
		if err := h.rig.Server.Do(func() error { return prog.Reconfigure(c) }); err != nil {
			t.Fatal(err)
		}
	}
	defer use("")
	a := &SessionRow{Path: SessionsFlowCache, Sessions: n, Bindings: n, TargetPPS: target}
	b := &SessionRow{Path: SessionsFlowCache, Sessions: n, Bindings: n, TargetPPS: target}
	rounds := h.cfg.sessionsRounds
	if n, err := strconv.Atoi(os.Getenv("BENCH_SESSIONS_AB_ROUNDS")); err == nil && n > 0 {
		rounds = n
	}
	for round := range rounds {
		order := []string{"", obj}
		if round%2 == 1 {
			order = []string{obj, ""}
		}
		for _, object := range order {
			use(object)
			row := b
			if object != "" {
				row = a
			}
			h.sessionInterval(t, all, target, probe, trivial, row)
		}
	}
	ratios := make([]float64, min(len(a.ProgNs), len(b.ProgNs)))
	for k := range ratios {
		ratios[k] = b.ProgNs[k] / a.ProgNs[k]
	}
	sort.Float64s(ratios)
	a.finish()
	b.finish()
	t.Logf("A/B %d sessions, flow cache: A %.0f ns/run (%.2fx trivial), B %.0f ns/run (%.2fx); B/A median %.3f (rounds %.3f-%.3f)",
		n, a.ProgMedianNs, a.Ratio, b.ProgMedianNs, b.Ratio, quantile(ratios, 0.5), ratios[0], ratios[len(ratios)-1])
}

// trivialProgs returns the trivial XDP programs on the client's and the
// peer's veth, which every relayed frame meets (the caller closes them).
func (h *harness) trivialProgs(t *testing.T) []*ebpf.Program {
	r := h.rig
	var trivial []*ebpf.Program
	for _, at := range []struct {
		ns    *netns.NS
		iface string
	}{{r.Peer, r.PeerIf.Name}, {r.Client, r.ClientIf.Name}} {
		p, err := xdpProgOn(at.ns, at.iface)
		if err != nil {
			t.Fatal(err)
		}
		trivial = append(trivial, p)
	}
	return trivial
}

// sessionLoad opens the client sockets of n sessions and returns their load.
func (h *harness) sessionLoad(t *testing.T, n int) *mixLoad {
	sinkFD, err := fdOf(h.peers.sink)
	if err != nil {
		t.Fatal(err)
	}
	load := newMixLoad(sinkChan, sockaddr(listenIP, listenPort), sinkFD)
	for i := range n {
		fd, _ := rawSocket(t, h.rig.Client, clientIP, sessionPortBase+i, 4096) // never read: what arrives is dropped at the buffer
		load.clientFDs = append(load.clientFDs, fd)
		load.relays = append(load.relays, sockaddr(relayIP, 49152+i))
	}
	return load
}

// installSessions makes sessions [from, n) through the mirror's hooks (each
// an allocation of its own, one channel to the sink), waits until all n are
// in the maps, and lets each new session's client speak first, as a real one
// does: the program learns the listener address it replies from (until then
// the peer's datagrams pass: pass_client_addr_unknown).
func installSessions(t *testing.T, m *mirror.Mirror, maps *channelmap.Maps, load *mixLoad, from, n int) {
	hooks := m.EventHandler()
	sink := &net.UDPAddr{IP: peerIP, Port: sinkPort}
	for i := from; i < n; i++ {
		client := &net.UDPAddr{IP: clientIP, Port: sessionPortBase + i}
		relay := &net.UDPAddr{IP: relayIP, Port: 49152 + i}
		hooks.OnAllocationCreated(client, listenAddr, "UDP", user, "bench", relay, 0)
		hooks.OnPermissionCreated(client, listenAddr, "UDP", user, "bench", relay, peerIP)
		hooks.OnChannelCreated(client, listenAddr, "UDP", user, "bench", relay, sink, sinkChan)
	}
	m.Sync()
	if got := maps.Len(); got != n {
		t.Fatalf("%d bindings in the maps, want %d", got, n)
	}
	for i := from; i < n; i++ {
		if err := unix.Sendto(load.clientFDs[i], load.c2p[0], 0, &unix.SockaddrInet4{Port: listenPort, Addr: [4]byte(listenIP)}); err != nil {
			t.Fatalf("session %d: first datagram: %v", i, err)
		}
		if i%1000 == 999 {
			time.Sleep(10 * time.Millisecond)
		}
	}
}

// sessionsServer measures one server with n real allocations.
func (h *harness) sessionsServer(t *testing.T, spec serverSpec, n int, trivial []*ebpf.Program) {
	rs := h.startServer(t, spec)
	defer h.stopServer(t, rs)
	sinkFD, err := fdOf(h.peers.sink)
	if err != nil {
		t.Fatal(err)
	}
	load := newMixLoad(sinkChan, sockaddr(listenIP, listenPort), sinkFD)
	start := time.Now()
	for range n {
		s := newSession(t, h, listenAddr)
		defer s.close()
		load.clientFDs = append(load.clientFDs, s.fd)
		ra := s.relay.LocalAddr().(*net.UDPAddr)
		load.relays = append(load.relays, sockaddr(ra.IP, ra.Port))
	}
	t.Logf("%s: %d allocations in %.1f s", spec.name, n, time.Since(start).Seconds())
	probe := sessionProbe{pids: []int{rs.proc.PID()}}
	if spec.xdpMode != "" {
		probe.kernel = func() (float64, float64, error) {
			m, err := h.scrape()
			if err != nil {
				return 0, 0, err
			}
			c2p := metric(m, "stunnerd_xdp_packets_total", "path", "xdp", "direction", "client_to_peer")
			p2c := metric(m, "stunnerd_xdp_packets_total", "path", "xdp", "direction", "peer_to_client")
			return zeroNaN(c2p), zeroNaN(p2c), nil
		}
	}
	if spec.xdpMode != "" && spec.xdpMode != "off" {
		probe.relay = func() (progStats, error) { return h.relayProgStats(t), nil }
	}
	row := &SessionRow{Path: spec.name, Sessions: n, Bindings: n, TargetPPS: float64(n * sessionPPS), Daemon: true}
	for range h.cfg.sessionsRounds {
		h.sessionInterval(t, load, row.TargetPPS, probe, trivial, row)
	}
	row.finish()
	h.logSession(t, row)
	h.rep.Sessions = append(h.rep.Sessions, *row)
}

func zeroNaN(v float64) float64 {
	if math.IsNaN(v) {
		return 0
	}
	return v
}

func (h *harness) logSession(t *testing.T, row *SessionRow) {
	t.Logf("%s, %d sessions: offered %.0f of %.0f pps per direction, delivered %.1f %%, program %.0f ns/run = %.2fx trivial (%.0f), server %.2f µs/pkt (process %.2f), kernel c2p %.1f %% p2c %.1f %%",
		row.Path, row.Sessions, row.OfferedPPS/2, row.TargetPPS, 100*row.DeliveredShare, row.ProgMedianNs, row.Ratio, row.TrivialMedianNs,
		row.TotalUsPerPkt, row.ProcUsPerPkt, 100*row.KernelShareC2P, 100*row.KernelShareP2C)
	if len(row.OtherVerdicts) > 0 {
		t.Logf("  other verdicts of the program: %v", row.OtherVerdicts)
	}
}

// finish derives the row's figures from its sums and intervals.
func (s *SessionRow) finish() {
	sent, got := float64(s.SentC2P+s.SentP2C), float64(s.DeliveredC2P+s.DeliveredP2C)
	if s.Seconds > 0 {
		s.OfferedPPS, s.DeliveredPPS = sent/s.Seconds, got/s.Seconds
	}
	if sent > 0 {
		s.DeliveredShare = got / sent
	}
	if got > 0 { // else zero, and Validate refuses the row
		s.ProcUsPerPkt, s.SoftUsPerPkt = usPer(s.procTicks, got), usPer(s.softTicks, got)
	}
	s.TotalUsPerPkt = s.ProcUsPerPkt + s.SoftUsPerPkt
	s.KernelShareC2P, s.KernelShareP2C = -1, -1
	if s.KernelCounted && s.SentC2P > 0 && s.SentP2C > 0 {
		s.KernelShareC2P = float64(s.KernelC2P) / float64(s.SentC2P)
		s.KernelShareP2C = float64(s.KernelP2C) / float64(s.SentP2C)
	}
	med := func(v []float64) float64 {
		c := append([]float64(nil), v...)
		sort.Float64s(c)
		return quantile(c, 0.5)
	}
	if len(s.ProgNs) == 0 {
		return
	}
	s.ProgMedianNs, s.TrivialMedianNs = med(s.ProgNs), med(s.TrivialNs)
	var ratios []float64
	for i := range s.ProgNs {
		if s.TrivialNs[i] > 0 {
			ratios = append(ratios, s.ProgNs[i]/s.TrivialNs[i])
		}
	}
	if len(ratios) > 0 {
		s.Ratio = med(ratios)
	}
}
