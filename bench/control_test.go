package bench

import (
	"bufio"
	"fmt"
	"log/slog"
	"math"
	"net"
	"net/netip"
	"os"
	"runtime"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/pion/turn/v4"

	"github.com/l7mp/stunnerd-xdp/internal/channelmap"
	"github.com/l7mp/stunnerd-xdp/internal/loader"
	"github.com/l7mp/stunnerd-xdp/internal/mirror"
	"github.com/l7mp/stunnerd-xdp/test/packet"
)

// maxBindings sizes the maps of the control and scaling stages: the daemon's default.
const maxBindings = 131072

func quietSlog() *slog.Logger {
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
}

// scalingConfig is the program configuration of the control, scaling and
// sessions stages.
func scalingConfig() loader.Config {
	return loader.Config{ListenerPorts: []uint16{uint16(listenPort)}, MinRelayPort: 49152, MaxRelayPort: 65535, MaxBindings: maxBindings}
}

func loadProgram(t *testing.T) *loader.Program {
	t.Helper()
	prog, err := loader.Load(scalingConfig(), quietSlog())
	if err != nil {
		t.Fatal(err)
	}
	return prog
}

// synthAlloc is an allocation pion/turn never made: the bench calls the
// mirror's hooks with it as pion would. Channel j goes to peer port
// scalingPeerBase+j (a binding's peer side is keyed by relay and peer address).
type synthAlloc struct {
	client, listener, relay *net.UDPAddr
	peers                   []*net.UDPAddr
}

// synthAllocs makes allocations for n channels, chansPerA per allocation, one
// per client port.
func synthAllocs(clientPorts []int, n int) []synthAlloc {
	var out []synthAlloc
	for a := 0; a*chansPerA < n; a++ {
		sa := synthAlloc{client: &net.UDPAddr{IP: clientIP, Port: clientPorts[a]}, listener: listenAddr,
			relay: &net.UDPAddr{IP: relayIP, Port: 49152 + a}}
		for j := 0; j < chansPerA && a*chansPerA+j < n; j++ {
			sa.peers = append(sa.peers, &net.UDPAddr{IP: peerIP, Port: scalingPeerBase + j})
		}
		out = append(out, sa)
	}
	return out
}

// installRange calls the hooks for channels [from, to) (global index); an
// allocation's first channel brings its allocation and permission events.
// It returns the number of hook calls.
func installRange(hooks turn.EventHandler, allocs []synthAlloc, from, to int) int {
	events := 0
	for i := from; i < to; i++ {
		a, j := &allocs[i/chansPerA], i%chansPerA
		if j == 0 {
			hooks.OnAllocationCreated(a.client, a.listener, "UDP", user, "bench", a.relay, 0)
			hooks.OnPermissionCreated(a.client, a.listener, "UDP", user, "bench", a.relay, peerIP)
			events += 2
		}
		hooks.OnChannelCreated(a.client, a.listener, "UDP", user, "bench", a.relay, a.peers[j], uint16(0x4000+j))
		events++
	}
	return events
}

// memlock reads a map's memlock figure from /proc/self/fdinfo.
func memlock(m *ebpf.Map) int64 {
	fh, err := os.Open(fmt.Sprintf("/proc/self/fdinfo/%d", m.FD()))
	if err != nil {
		return -1
	}
	defer fh.Close()
	sc := bufio.NewScanner(fh)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "memlock:"); ok {
			n, _ := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
			return n
		}
	}
	return -1
}

// ---- stage 4: control plane ----

func (h *harness) stageControl(t *testing.T) {
	n := h.cfg.controlBindings
	prog := loadProgram(t)
	defer prog.Close()
	maps := channelmap.New(prog.Maps())
	ports := make([]int, (n+chansPerA-1)/chansPerA)
	for i := range ports {
		ports[i] = 20000 + i
	}
	allocs := synthAllocs(ports, n)

	runtime.GC()
	var m0, m1 runtime.MemStats
	runtime.ReadMemStats(&m0)
	m := mirror.New(quietSlog())
	defer m.Close()
	m.SetOffload(maps)
	hooks := m.EventHandler()

	start := time.Now()
	events := installRange(hooks, allocs, 0, n)
	m.Sync()
	elapsed := time.Since(start)
	if got := maps.Len(); got != n {
		t.Errorf("%d bindings in the maps after Sync, want %d", got, n)
	}
	runtime.GC()
	runtime.ReadMemStats(&m1)
	runtime.KeepAlive(allocs)

	possible, err := ebpf.PossibleCPU()
	if err != nil {
		t.Fatal(err)
	}
	pm := prog.Maps()
	c := &ControlResult{Bindings: n, Allocations: len(allocs), Events: events, Seconds: elapsed.Seconds(),
		BindingsPerSecond: float64(n) / elapsed.Seconds(), Installed: maps.Len(), MaxEntries: maxBindings, PossibleCPUs: possible,
		HeapBytesPerBinding: (float64(m1.HeapAlloc) - float64(m0.HeapAlloc)) / float64(n),
		MapMemlock:          map[string]int64{}}
	for name, m := range relayMaps(pm) {
		c.MapMemlock[name] = memlock(m)
	}
	c.MapBytesPerSlot = float64(c.MapMemlock["c2p_bindings"]+c.MapMemlock["p2c_bindings"]+c.MapMemlock["binding_states"]) / maxBindings
	c.MapBytesPerSlotComputed = float64(pm.C2pBindings.KeySize() + pm.C2pBindings.ValueSize() + pm.P2cBindings.KeySize() + pm.P2cBindings.ValueSize() +
		pm.BindingStates.ValueSize())

	start = time.Now()
	for _, a := range allocs {
		hooks.OnAllocationDeleted(a.client, a.listener, "UDP", user, "bench")
	}
	m.Sync()
	c.RemoveSeconds = time.Since(start).Seconds()
	if got := maps.Len(); got != 0 {
		t.Errorf("%d bindings left after deleting every allocation", got)
	}
	t.Logf("control: %+v", *c)
	h.rep.Control = c
}

// ---- stage 5: scaling with the number of channels ----

// attachMirrored loads the relay program with cfg, attaches it natively to
// the server's veths as the daemon does, fills the destinations table for
// the one specific listener and returns the program, its maps and a mirror
// that offloads to them; all are closed at cleanup (the program's close
// detaches it).
func (h *harness) attachMirrored(t *testing.T, cfg loader.Config) (*loader.Program, *channelmap.Maps, *mirror.Mirror) {
	t.Helper()
	r := h.rig
	prog, err := loader.Load(cfg, quietSlog())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = prog.Close() })
	err = r.Server.Do(func() error {
		for _, iface := range r.ServerIfaces() {
			if m, err := prog.Attach(iface, loader.ModeNative); err != nil || m != loader.ModeNative {
				return fmt.Errorf("attach %s: %w (%s)", iface, err, m)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	maps := channelmap.New(prog.Maps())
	listen := listenAddr.AddrPort()
	if err := maps.SetDestinations(map[netip.AddrPort]netip.AddrPort{listen: listen}); err != nil {
		t.Fatal(err)
	}
	m := mirror.New(quietSlog())
	t.Cleanup(m.Close)
	m.SetOffload(maps)
	return prog, maps, m
}

func (h *harness) stageScaling(t *testing.T) {
	r := h.rig
	_, maps, m := h.attachMirrored(t, scalingConfig())
	hooks := m.EventHandler()
	maxN := h.cfg.scalingChannels[len(h.cfg.scalingChannels)-1]
	nAllocs := (maxN + chansPerA - 1) / chansPerA
	fds := make([]int, nAllocs)
	ports := make([]int, nAllocs)
	for a := range fds {
		fds[a], ports[a] = rawSocket(t, r.Client, clientIP, 0, 0)
	}
	for j := 0; j < min(maxN, chansPerA); j++ {
		rawSocket(t, r.Peer, peerIP, scalingPeerBase+j, 2048) // a sink per peer port, never read
	}
	allocs := synthAllocs(ports, maxN)
	data := make([]byte, 100)

	installed := 0
	for _, n := range h.cfg.scalingChannels {
		start := time.Now()
		installRange(hooks, allocs, installed, n)
		m.Sync()
		installTime := time.Since(start).Seconds()
		installed = n
		if got := maps.Len(); got != n {
			t.Fatalf("%d bindings in the maps, want %d", got, n)
		}
		var streams []*stream
		for a := 0; a*chansPerA < n; a++ {
			s := &stream{fd: fds[a], dst: sockaddr(listenIP, listenPort)}
			for j := 0; j < chansPerA && a*chansPerA+j < n; j++ {
				s.payloads = append(s.payloads, packet.ChannelData(uint16(0x4000+j), data, nil))
			}
			streams = append(streams, s)
		}
		for _, rate := range []float64{h.cfg.scalingRate, 0} {
			before, err := maps.Totals()
			if err != nil {
				t.Fatal(err)
			}
			saved := h.cfg.point
			h.cfg.point = h.cfg.scalingPoint
			p := h.measure(t, serverSpec{name: "scaling", direct: true}, streams, rate, nil)
			h.cfg.point = saved
			after, err := maps.Totals()
			if err != nil {
				t.Fatal(err)
			}
			sp := ScalingPoint{Channels: n, Allocations: len(streams), TargetPPS: rate, Seconds: p.Seconds, Sent: p.Sent,
				Delivered: p.Delivered, OfferedPPS: p.OfferedPPS, DeliveredPPS: p.DeliveredPPS, LossPercent: p.LossPercent,
				SoftUsPerPkt: p.SoftUsPerPkt, BusyUsPerPkt: p.BusyUsPerPkt, XDPRelayed: after.ClientToPeerPackets - before.ClientToPeerPackets,
				InstallSecond: installTime}
			// Every binding installed so far has carried traffic (cumulative counters).
			for _, b := range maps.Installed() {
				if st, err := maps.Stats(b.Key()); err == nil && st.ClientToPeerPackets > 0 {
					sp.ChannelsHit++
				}
			}
			t.Logf("scaling %d channels, target %s: offered %.0f delivered %.0f pps, softirq %.2f µs/pkt, XDP relayed %d, %d channels hit",
				n, rateLabel(rate), sp.OfferedPPS, sp.DeliveredPPS, sp.SoftUsPerPkt, sp.XDPRelayed, sp.ChannelsHit)
			h.rep.Scaling = append(h.rep.Scaling, sp)
		}
	}
	runtime.KeepAlive(allocs)
}

// ---- targets ----

// userspaceTarget is issue 12's userspace target: one stunnerd-xdp
// userspace configuration with server process CPU per packet at or below
// coturn's (at the lowest rung and at the highest rung both carried
// loss-free) and a loss-free rate more than higherBy coturn's with the
// generator on its own CPU (medians of the paired ratios; unpinned, the
// generator falls short of the higher rungs and the rate is partly its own).
func (h *harness) userspaceTarget() TargetResult {
	return userspaceTarget(h.rep.UserspaceSummaries())
}

func userspaceTarget(sums []UserspaceSummary) TargetResult {
	var parts, meet []string
	for _, s := range sums {
		if !slices.Contains([]string{ServerUser1, ServerUserN, ServerUser16}, s.Server) || s.Rounds == 0 {
			continue
		}
		parts = append(parts, fmt.Sprintf("%s: process CPU %s× coturn's at the lowest rung (rounds %s–%s) and %s× at the highest both carried loss-free (%s–%s), "+
			"pinned loss-free rate %s× coturn's (rounds %s–%s; median %s pps; unpinned, partly the generator's: %s×)",
			s.Server, ratio(s.ProcX), ratio(s.ProcXLo), ratio(s.ProcXHi), ratio(s.LoadedX), ratio(s.LoadedXLo), ratio(s.LoadedXHi),
			ratio(s.PinnedLossFreeX), ratio(s.PinnedLossFreeXLo), ratio(s.PinnedLossFreeXHi), f(s.PinnedLossFreePPS, 0), ratio(s.LossFreeX)))
		if s.ProcX <= 1 && s.LoadedX <= 1 && s.PinnedLossFreeX > higherBy {
			meet = append(meet, s.Server)
		}
	}
	res := TargetResult{Target: "userspace path, one configuration: server process CPU per packet ≤ coturn's and a higher loss-free rate with the generator on its own CPU (more than " +
		strconv.Itoa(int(math.Round((higherBy-1)*100))) + " % higher; 100 B, " +
		strconv.Itoa(userspaceFlows) + " allocations; medians of ratios within a round)", Measured: strings.Join(parts, "; "), Met: "no"}
	switch {
	case len(parts) == 0:
		res.Measured, res.Met = "not run", "n/a"
	case len(meet) > 0:
		res.Met = "yes: " + strings.Join(meet, ", ")
	}
	return res
}

// targets compares this run's rows against the targets; nothing is
// asserted. It also returns notes on what limits the figures here.
func (h *harness) targets() ([]TargetResult, []string) {
	var out []TargetResult
	lo, hi := h.cfg.lo, h.cfg.hi
	cpu := func(server string, rate float64) float64 {
		for _, p := range h.rep.Relay {
			if p.Server == server && p.Payload == 100 && p.TargetPPS == rate {
				return p.TotalUsPerPkt
			}
		}
		return math.NaN()
	}
	met := func(ok bool) string {
		if ok {
			return "yes"
		}
		return "no"
	}
	for _, c := range []struct {
		server string
		want   float64
	}{{ServerStunnerd, 20}, {ServerCoturn, 10}} {
		rl, rh := cpu(c.server, lo)/cpu(ServerXDPNative, lo), cpu(c.server, hi)/cpu(ServerXDPNative, hi)
		above := func(server string, rate float64) float64 { return cpu(server, rate) - cpu(ServerDeliveryFloor, rate) }
		al, ah := above(c.server, lo)/above(ServerXDPNative, lo), above(c.server, hi)/above(ServerXDPNative, hi)
		out = append(out, TargetResult{
			Target: fmt.Sprintf("XDP native ≥%.0f× less server CPU per relayed packet than %s (100 B, same offered load)", c.want, c.server),
			Measured: fmt.Sprintf("server CPU (process + all softirq): %s× at %s pps, %s× at %s pps; above the delivery floor: %s× at %s pps (%s vs %s µs), %s× at %s pps",
				f(rl, 1), f(lo, 0), f(rh, 1), f(hi, 0), f(al, 1), f(lo, 0), f(above(c.server, lo), 2), f(above(ServerXDPNative, lo), 2), f(ah, 1), f(hi, 0)),
			Met: "raw: " + met(rl >= c.want && rh >= c.want) + "; above floor: " + met(al >= c.want && ah >= c.want),
		})
	}
	var maxDel, maxTotal float64
	for _, p := range h.rep.Relay {
		if p.Server == ServerXDPNative && p.Payload == 100 && p.DeliveredPPS > maxDel {
			maxDel, maxTotal = p.DeliveredPPS, p.TotalUsPerPkt
		}
	}
	implied := 1 / maxTotal // Mpps per core if a core did nothing but this
	m := "no (not demonstrated: generator-bound on this rig)"
	if maxDel >= 1e6 {
		m = "yes"
	}
	out = append(out, TargetResult{Target: "≥1 Mpps relayed per core at 100 B (XDP native)",
		Measured: fmt.Sprintf("%s pps delivered at most (generator and relay share 2 cores); 1/(server CPU per packet) at that rung = %s Mpps per core", f(maxDel, 0), f(implied, 2)),
		Met:      m})
	var xdp LatencyRow
	for _, l := range h.rep.Latency {
		if l.Server == ServerXDPNative {
			xdp = l
		}
	}
	ok := true
	var parts []string
	for _, l := range h.rep.Latency {
		switch l.Server {
		case ServerXDPOff, ServerStunnerd, ServerCoturn:
			// When XDP adds nothing measurable over the direct path (added ≤ 0),
			// the ratio of added latencies is meaningless: the userspace relay
			// must then add something at all.
			ratio := l.AddedP99Us / xdp.AddedP99Us
			if xdp.AddedP99Us <= 0 {
				ok = ok && l.AddedP99Us > 0
			} else {
				ok = ok && ratio >= 5
			}
			parts = append(parts, fmt.Sprintf("%s added p99 %s µs (RTT p99 %s µs = %s× XDP's)", l.Server, f(l.AddedP99Us, 0), f(l.P99Us, 0), f(l.P99Us/xdp.P99Us, 1)))
		}
	}
	out = append(out, TargetResult{Target: "p99 added latency ≥5× lower than the userspace relays",
		Measured: fmt.Sprintf("XDP native RTT p99 %s µs vs direct path (kernel forwarding) %s µs: added %s µs; %s", f(xdp.P99Us, 0),
			f(xdp.P99Us-xdp.AddedP99Us, 0), f(xdp.AddedP99Us, 0), strings.Join(parts, "; ")),
		Met: met(ok)})
	var floor, c2p, p2c float64
	for _, p := range h.rep.ProgRun {
		switch p.Name {
		case rowFloor:
			floor = p.MedianNs
		case rowC2P:
			c2p = p.MedianNs
		case rowP2C:
			p2c = p.MedianNs
		}
	}
	out = append(out, TargetResult{Target: "program cost within 2× of the XDP_TX floor (BPF_PROG_RUN)",
		Measured: fmt.Sprintf("client→peer %s ns = %s× floor (%s ns); peer→client %s ns = %s×", f(c2p, 0), f(c2p/floor, 2), f(floor, 0), f(p2c, 0), f(p2c/floor, 2)),
		Met:      met(c2p/floor <= 2 && p2c/floor <= 2)})
	out = append(out, h.userspaceTarget())
	if st, ok := h.rep.sessionsTarget(); ok {
		out = append(out, st)
	}
	if jt, ok := h.rep.junkTarget(); ok {
		out = append(out, jt)
	}

	notes := []string{
		"Everything shares 2 vCPUs: the generator, the relay, the peer's receive path and softirq. On veth the XDP program runs in the NAPI poll that the sender's own transmit schedules, so for XDP the relay's work lands as softirq on the generator's CPU; the max rung uses " + strconv.Itoa(h.cfg.maxWorkers) + " generator threads (one per core).",
		"The kernel is built without CONFIG_IRQ_TIME_ACCOUNTING: softirq and process times are sampled at the " + strconv.Itoa(clockTick) + " Hz tick, so a few-second rung resolves about ±1 % of a core; low-rate XDP figures (a fraction of a µs per packet) are the least precise.",
		"Softirq is system-wide: it also holds the client's transmit, the veth hops and the peer's UDP receive, for every server alike; the kernel-forwarding row shows that floor.",
		"Delivered counts the peer namespace's UDP layer (InDatagrams + RcvbufErrors + NoPorts): the sink never reads, so a datagram that reached the peer counts even though its socket buffer was full.",
	}
	if n := h.steeringNote(); n != "" {
		notes = append(notes, n)
	}
	return out, notes
}

// steeringNote compares the userspace path with and without the listener
// steering, rung by rung of this run: the cost of rolling-update support.
func (h *harness) steeringNote() string {
	type rung struct {
		payload int
		target  float64
	}
	plain := map[rung]RelayPoint{}
	for _, p := range h.rep.Relay {
		if p.Server == ServerXDPOff {
			plain[rung{p.Payload, p.TargetPPS}] = p
		}
	}
	var ratios []float64
	for _, p := range h.rep.Relay {
		q, ok := plain[rung{p.Payload, p.TargetPPS}]
		if p.Server != ServerXDPOffSteered || !ok || q.TotalUsPerPkt <= 0 || p.TotalUsPerPkt <= 0 {
			continue
		}
		ratios = append(ratios, p.TotalUsPerPkt/q.TotalUsPerPkt)
	}
	if len(ratios) == 0 {
		return ""
	}
	sort.Float64s(ratios)
	note := fmt.Sprintf("Listener steering (SO_REUSEPORT + SK_REUSEPORT program, for rolling updates) on the userspace path: server CPU per packet steered/plain, median over %d rungs of this run: %s× (range %s–%s).",
		len(ratios), f(ratios[len(ratios)/2], 2), f(ratios[0], 2), f(ratios[len(ratios)-1], 2))
	for _, l := range h.rep.Latency {
		if l.Server == ServerXDPOffSteered {
			for _, m := range h.rep.Latency {
				if m.Server == ServerXDPOff && m.P99Us > 0 {
					note += fmt.Sprintf(" RTT p99 steered/plain: %s×.", f(l.P99Us/m.P99Us, 2))
				}
			}
		}
	}
	return note
}
