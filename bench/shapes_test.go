package bench

import (
	"errors"
	"math"
	"net"
	"net/netip"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pion/turn/v4"

	dpconfig "github.com/l7mp/stunnerd-xdp/internal/config"
	"github.com/l7mp/stunnerd-xdp/test/netns"
)

// The shapes stage's TURN credentials (the daemon's config has them).
const shapeUser, shapePassword = "bench", "bench"

// shapeModes are the shapes stage's runs: the daemon's default XDP mode and --xdp-mode=off.
var shapeModes = []string{"default", "off"}

// stageShapes measures every node shape (test/netns.Shapes) in both modes: the
// kernel's share per direction and the server CPU per relayed packet, beside
// --xdp-mode=off. Each row has a node rig of its own; the stage's main rig is
// not used.
func (h *harness) stageShapes(t *testing.T) {
	h.command("shapes stage: per node shape and mode, %.0f pps of 100-byte datagrams for %v through a pion/turn allocation to an echoing peer", h.cfg.shapeRate, h.cfg.shapePoint)
	// The engines' live cost per shape (engineProbe).
	defer enableBPFStats(t).Close()
	for _, shape := range netns.Shapes() {
		for _, mode := range shapeModes {
			t.Run(string(shape)+"/"+mode, func(t *testing.T) {
				row := h.shapeOne(t, shape, mode, false)
				t.Logf("%+v", row)
				h.rep.Shapes = append(h.rep.Shapes, row)
			})
		}
	}
	// What the node's reverse-path filter costs the engines: the TC engine
	// makes the stack's lookup for every datagram from a filtering device,
	// XDP once per next hop it resolves.
	for _, shape := range rpShapes {
		for _, mode := range shapeModes {
			t.Run(string(shape)+rpSuffix+"/"+mode, func(t *testing.T) {
				row := h.shapeOne(t, shape, mode, true)
				t.Logf("%+v", row)
				h.rep.Shapes = append(h.rep.Shapes, row)
			})
		}
	}
}

// rpShapes are measured again with strict reverse-path filtering on the node
// (net.ipv4.conf.all.rp_filter=1, as hardened nodes and Calico's workload
// interfaces have it), named with rpSuffix.
var rpShapes = []netns.Shape{netns.CalicoPod}

const rpSuffix = "+rp_filter=1"

func (h *harness) shapeOne(t *testing.T, shape netns.Shape, mode string, rpFilter bool) ShapeRow {
	r := netns.NewNode(t, shape)
	if err := r.LooksLikeANode(); err != nil {
		t.Fatal(err)
	}
	name := string(shape)
	if rpFilter {
		name += rpSuffix
		r.Node.Run(t, "sysctl", "-q", "-w", "net.ipv4.conf.all.rp_filter=1")
	}
	d := r.StartDaemon(t, netns.DaemonOptions{Binary: h.daemonBin, SteeringDir: h.pins, Off: mode == "off", User: shapeUser, Password: shapePassword})
	peer := netip.AddrPortFrom(r.PeerIP, 5002)
	r.Peer.ServeUDPEcho(t, peer)
	relay, err := r.Client.Allocate(t, "udp4", netip.AddrPortFrom(r.ClientIP, 0).String(), &turn.ClientConfig{
		TURNServerAddr: r.ListenAddr().String(), Username: shapeUser, Password: shapePassword, Realm: dpconfig.DefaultRealm})
	if err != nil {
		t.Fatal(err)
	}
	var echoed atomic.Int64
	done := make(chan struct{})
	go func() {
		defer close(done)
		buf := make([]byte, 1500)
		for {
			_ = relay.SetReadDeadline(time.Now().Add(time.Second))
			if _, _, err := relay.ReadFrom(buf); err != nil {
				return
			}
			echoed.Add(1)
		}
	}()
	to := net.UDPAddrFromAddrPort(peer)
	msg := make([]byte, 100)
	// The binding first, settled on its path (the NAT gate waits for conntrack's evidence).
	if err := netns.Eventually(10*time.Second, 20*time.Millisecond, func() error {
		if _, err := relay.WriteTo(msg, to); err != nil {
			return netns.Abort(err)
		}
		m, err := r.Node.Scrape(r.MetricsURL())
		if err == nil && !m.Settled(mode == "off") {
			err = errNotSettled
		}
		return err
	}); err != nil {
		t.Fatalf("the channel binding did not settle: %v", err)
	}
	time.Sleep(200 * time.Millisecond)
	var probe *engineProbe
	var engBefore engineStats
	if mode != "off" {
		probe = probeEngines(t, r.Node)
		engBefore = probe.read(t)
	}
	before, err := r.Node.Scrape(r.MetricsURL())
	if err != nil {
		t.Fatal(err)
	}
	echoesBefore := echoed.Load()
	cpuBefore, err := takeCPU(d.PID())
	if err != nil {
		t.Fatal(err)
	}
	// Paced against the clock, as the e2e sessions are.
	var sent int64
	interval := time.Duration(float64(time.Second) / h.cfg.shapeRate)
	start := time.Now()
	for i := 0; time.Since(start) < h.cfg.shapePoint; i++ {
		if wait := time.Until(start.Add(time.Duration(i) * interval)); wait > 0 {
			time.Sleep(wait)
		}
		if _, err := relay.WriteTo(msg, to); err != nil {
			t.Fatal(err)
		}
		sent++
	}
	time.Sleep(300 * time.Millisecond) // the last echoes
	cpuAfter, err := takeCPU(d.PID())
	if err != nil {
		t.Fatal(err)
	}
	after, err := r.Node.Scrape(r.MetricsURL())
	if err != nil {
		t.Fatal(err)
	}
	row := ShapeRow{Shape: name, Mode: mode, RatePPS: h.cfg.shapeRate, Sent: sent, Echoed: echoed.Load() - echoesBefore}
	if probe != nil {
		probe.read(t).fill(engBefore, &row)
	}
	var xdp, all [2]float64
	for i, dir := range []string{"client_to_peer", "peer_to_client"} {
		for _, path := range []string{"xdp", "userspace"} {
			a, _ := after.Sum("stunnerd_xdp_packets_total", "path", path, "direction", dir)
			b, _ := before.Sum("stunnerd_xdp_packets_total", "path", path, "direction", dir)
			all[i] += a - b
			if path == "xdp" {
				xdp[i] += a - b
			}
		}
	}
	row.Relayed = all[0] + all[1]
	row.KernelC2P, row.KernelP2C = shareOf(xdp[0], all[0]), shareOf(xdp[1], all[1])
	row.ProcUsPerPkt = usPer(cpuAfter.proc-cpuBefore.proc, row.Relayed)
	row.TotalUsPerPkt = row.ProcUsPerPkt + usPer(cpuAfter.soft-cpuBefore.soft, row.Relayed)
	_ = relay.Close()
	<-done
	return row
}

// errNotSettled: the channel binding is not bound yet, or still pending in userspace.
var errNotSettled = errors.New("the channel binding has not settled on a path")

// shareOf is part/all, NaN when all is 0.
func shareOf(a, b float64) float64 {
	if b == 0 {
		return math.NaN()
	}
	return a / b
}
