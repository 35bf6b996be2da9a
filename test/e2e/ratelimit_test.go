package e2e

import (
	"math"
	"net"
	"net/netip"
	"sync/atomic"
	"testing"
	"time"

	"github.com/l7mp/stunnerd-xdp/bpf"
	"github.com/l7mp/stunnerd-xdp/internal/channelmap"
	"github.com/l7mp/stunnerd-xdp/internal/daemon"
	"github.com/l7mp/stunnerd-xdp/internal/loader"
)

const (
	rateLimitPPS     = 2000                 // the limit, datagrams per second
	rateLimitOffered = 5 * rateLimitPPS     // what iperf offers
	rateLimitSeconds = 5                    // how long
	rateLimitSlack   = 0.05                 // the delivered rate's tolerance
	rateLimitEchoPPS = rateLimitPPS / 4 / 2 // the other flow: a quarter of the limit, both ways
)

// TestRateLimitXDPNative: iperf through turncat at five times the limit is
// held at the limit by the kernel (over-limit drop), and another allocation's
// flow, under its own limit, loses nothing.
func TestRateLimitXDPNative(t *testing.T) {
	inRig(t, false, func(t *testing.T, r rig) { rateLimited(t, r, loader.ModeNative) })
}

// TestRateLimitUserspace: the same with --xdp-mode=off: pion's relay sockets
// hold the same limit.
func TestRateLimitUserspace(t *testing.T) {
	inRig(t, false, func(t *testing.T, r rig) { rateLimited(t, r, loader.ModeOff) })
}

func rateLimited(t *testing.T, r rig, mode loader.Mode) {
	d := startDaemon(t, mode, r.serverIfaces, func(c *daemon.Config) {
		c.RateLimit = channelmap.RateLimit{PacketsPerSecond: rateLimitPPS}
	})
	startEcho(t, r.peer, echoPeer)
	relay, err := allocateFrom(t, r.client)
	if err != nil {
		t.Fatal(err)
	}
	before := snapshot(t, d)
	echoed := make(chan taggedStats, 1)
	go func() { echoed <- taggedEcho(t, relay, rateLimitEchoPPS, rateLimitSeconds*time.Second) }()
	res := iperfThroughTurncatAt(t, r, rateLimitOffered, rateLimitSeconds)
	other := <-echoed
	after := snapshot(t, d)
	t.Logf("relayed: %v; other flow: %v", after, other)

	if res.Total < rateLimitOffered*rateLimitSeconds*9/10 {
		t.Errorf("iperf offered %d datagrams, want about %d: the limit was not tested", res.Total, rateLimitOffered*rateLimitSeconds)
	}
	got := float64(res.Received) / res.Duration.Seconds()
	if math.Abs(got-rateLimitPPS) > rateLimitSlack*rateLimitPPS {
		t.Errorf("delivered %.0f datagrams/s (%d in %v), want %d +- %.0f%%", got, res.Received, res.Duration, rateLimitPPS, 100*rateLimitSlack)
	}
	checkEchoes(t, other, rateLimitEchoPPS*rateLimitSeconds)

	if mode == loader.ModeOff {
		if dropped := d.RateLimitDropped(); dropped < uint64(res.Lost)*9/10 {
			t.Errorf("userspace counted %d datagrams over the limit, the peer missed %d", dropped, res.Lost)
		}
		return
	}
	limited := after.verdicts[bpf.RelayReasonREASON_RATE_LIMITED] - before.verdicts[bpf.RelayReasonREASON_RATE_LIMITED]
	if limited < uint64(res.Lost)*9/10 {
		t.Errorf("the program counted %d datagrams as rate_limited, the peer missed %d", limited, res.Lost)
	}
	if xdp := after.xdp.ClientToPeerPackets - before.xdp.ClientToPeerPackets; xdp < uint64(res.Received)*9/10 {
		t.Errorf("XDP relayed %d client->peer datagrams, the peer received %d: the kernel did not carry the flow", xdp, res.Received)
	}
}

const (
	splitPPS     = 200 // the allocation's limit, datagrams per second, both paths together
	splitPerPeer = 200 // what the client sends each of its two peers, per second
	splitSeconds = 4
)

// TestRateLimitSplitPathsXDP: one bucket per allocation for both paths. A
// client splits its traffic between a channel (ChannelData, relayed by the
// kernel both ways) and a peer it cannot bind (a channel cap of 1: pion/turn's
// client sends Send indications, pion relays them and the peer's replies in
// userspace). Everything the allocation relays, on both paths, stays within
// its one limit (+ a burst), not once per path.
func TestRateLimitSplitPathsXDP(t *testing.T) {
	inRig(t, false, func(t *testing.T, r rig) { splitPaths(t, r, loader.ModeNative, false) })
}

// TestRateLimitSplitPathsXDPPass: the same with --over-limit=pass: what the
// kernel finds over the limit goes to pion/turn, whose relay socket charges
// the same bucket, finds it over too and drops it: the limit holds.
func TestRateLimitSplitPathsXDPPass(t *testing.T) {
	inRig(t, false, func(t *testing.T, r rig) { splitPaths(t, r, loader.ModeNative, true) })
}

// TestRateLimitSplitPathsUserspace: the twin with --xdp-mode=off: pion relays
// both peers, and the allocation's one bucket holds the total at the limit.
func TestRateLimitSplitPathsUserspace(t *testing.T) {
	inRig(t, false, func(t *testing.T, r rig) { splitPaths(t, r, loader.ModeOff, false) })
}

func splitPaths(t *testing.T, r rig, mode loader.Mode, pass bool) {
	d := startDaemon(t, mode, r.serverIfaces, func(c *daemon.Config) {
		c.RateLimit = channelmap.RateLimit{PacketsPerSecond: splitPPS, Pass: pass}
		c.MaxChannels = 1
	})
	peerB := netip.AddrPortFrom(echoPeer.Addr(), echoPeer.Port()+1)
	startEcho(t, r.peer, echoPeer)
	startEcho(t, r.peer, peerB)
	relay, err := allocateFrom(t, r.client)
	if err != nil {
		t.Fatal(err)
	}
	a, b := net.UDPAddrFromAddrPort(echoPeer), net.UDPAddrFromAddrPort(peerB)

	var echoesA, echoesB atomic.Int64
	stop := make(chan struct{})
	readerDone := make(chan struct{})
	go func() {
		defer close(readerDone)
		buf := make([]byte, 1500)
		for {
			select {
			case <-stop:
				return
			default:
			}
			_ = relay.SetReadDeadline(time.Now().Add(100 * time.Millisecond))
			_, from, err := relay.ReadFrom(buf)
			if err != nil {
				continue
			}
			switch from.String() {
			case a.String():
				echoesA.Add(1)
			case b.String():
				echoesB.Add(1)
			}
		}
	}()
	defer func() { close(stop); <-readerDone }()

	// The channel to A first (the client binds it on its first write), then
	// B, whose ChannelBind the cap refuses: the client stays on Send
	// indications to B.
	write := func(to *net.UDPAddr) {
		t.Helper()
		if _, err := relay.WriteTo([]byte("split-paths-probe"), to); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, "an echo from A over its channel", 5*time.Second, func() bool {
		write(a)
		time.Sleep(50 * time.Millisecond)
		return echoesA.Load() > 0 && (mode == loader.ModeOff || d.Maps().Len() == 1)
	})
	time.Sleep(300 * time.Millisecond) // the ChannelBind answered
	waitFor(t, "an echo from B", 5*time.Second, func() bool {
		write(b)
		time.Sleep(50 * time.Millisecond)
		return echoesB.Load() > 0
	})
	// Let the bucket empty before measuring.
	time.Sleep(time.Second)

	before := snapshot(t, d)
	aBefore, bBefore := echoesA.Load(), echoesB.Load()
	start := time.Now()
	var sent int
	total := splitPerPeer * splitSeconds
	for sent < total && time.Since(start) < splitSeconds*time.Second+time.Second {
		due := min(total, int(time.Since(start)*splitPerPeer/time.Second)+1)
		for ; sent < due; sent++ {
			write(a)
			write(b)
		}
		time.Sleep(time.Millisecond)
	}
	elapsed := time.Since(start)
	time.Sleep(500 * time.Millisecond) // the last echoes
	after := snapshot(t, d)

	kernel := (after.xdp.ClientToPeerPackets - before.xdp.ClientToPeerPackets) + (after.xdp.PeerToClientPackets - before.xdp.PeerToClientPackets)
	user := (after.userC2P - before.userC2P) + (after.userP2C - before.userP2C)
	relayed := kernel + user
	limit := float64(splitPPS) * elapsed.Seconds()
	t.Logf("%s (over-limit pass %v): sent %d to each peer in %v; relayed %d (kernel %d, userspace %d), limit %.0f (+ a 50 ms burst); echoes A %d, B %d; %d dropped in userspace; %v",
		mode, pass, sent, elapsed.Round(time.Millisecond), relayed, kernel, user, limit, echoesA.Load()-aBefore, echoesB.Load()-bBefore, d.RateLimitDropped(), after)
	if sent < total*9/10 {
		t.Fatalf("sent %d datagrams to each peer, want %d: the limit was not tested", sent, total)
	}
	// At most the limit over the time it was offered, one burst and the
	// echoes of what went in the last moment; at least most of the limit
	// (four times it was offered).
	if hi := limit*1.1 + splitPPS*0.05 + 10; float64(relayed) > hi {
		t.Errorf("the allocation relayed %d datagrams in %v, over its limit (at most %.0f): one bucket per path?", relayed, elapsed, hi)
	}
	if lo := limit * 0.8; float64(relayed) < lo {
		t.Errorf("the allocation relayed %d datagrams in %v, want about %.0f", relayed, elapsed, limit)
	}
	if echoesB.Load() == bBefore || echoesA.Load() == aBefore {
		t.Errorf("echoes A %d, B %d: want both peers relayed", echoesA.Load()-aBefore, echoesB.Load()-bBefore)
	}
	if mode != loader.ModeOff && (kernel == 0 || user == 0) {
		t.Errorf("kernel relayed %d, userspace %d: want the traffic split between the paths", kernel, user)
	}
}

// TestRateLimitJunkXDP: junk to a rate-limited relay port does not reduce
// the session's delivery. 500 datagrams/s from an address without a
// permission (pion drops them) reach the allocation's relay port while its
// session echoes 20/s (40 datagrams relayed a second) under a 100/s limit:
// the junk is never charged.
func TestRateLimitJunkXDP(t *testing.T) {
	inRig(t, false, func(t *testing.T, r rig) { junkToRelay(t, r, loader.ModeNative) })
}

// TestRateLimitJunkUserspace: the same with --xdp-mode=off.
func TestRateLimitJunkUserspace(t *testing.T) {
	inRig(t, false, func(t *testing.T, r rig) { junkToRelay(t, r, loader.ModeOff) })
}

func junkToRelay(t *testing.T, r rig, mode loader.Mode) {
	const (
		limit, rate, junkRate = 100, 20, 500
		seconds               = 5
	)
	d := startDaemon(t, mode, r.serverIfaces, func(c *daemon.Config) {
		c.RateLimit = channelmap.RateLimit{PacketsPerSecond: limit}
	})
	startEcho(t, r.peer, echoPeer)
	relay, err := allocateFrom(t, r.client)
	if err != nil {
		t.Fatal(err)
	}
	// The junk comes from another address of the peer's network
	// (10.200.0.3): no permission for its IP, so pion drops it.
	r.peer.IP(t, "addr", "add", "10.200.0.3/24", "dev", "peer0")
	t.Cleanup(func() { r.peer.IP(t, "addr", "del", "10.200.0.3/24", "dev", "peer0") })
	junk := listenUDP(t, r.peer, "10.200.0.3:0", 0)
	target := relay.LocalAddr().(*net.UDPAddr)
	stop := make(chan struct{})
	junkSent := make(chan int, 1)
	var junkErr error
	go func() {
		var n int
		start := time.Now()
		defer func() { junkSent <- n }()
		for {
			select {
			case <-stop:
				return
			default:
			}
			for due := int(time.Since(start) * junkRate / time.Second); n < due; n++ {
				if _, err := junk.WriteToUDP([]byte("junk junk junk junk junk junk"), target); err != nil {
					junkErr = err
					return
				}
			}
			time.Sleep(time.Millisecond)
		}
	}()
	time.Sleep(500 * time.Millisecond) // the junk flows before the session starts
	before := snapshot(t, d)
	stats := taggedEcho(t, relay, rate, seconds*time.Second)
	close(stop)
	n := <-junkSent
	after := snapshot(t, d)
	limited := d.RateLimitDropped()
	if mode != loader.ModeOff {
		limited += after.verdicts[bpf.RelayReasonREASON_RATE_LIMITED] - before.verdicts[bpf.RelayReasonREASON_RATE_LIMITED]
	}
	t.Logf("%s: session %v; %d junk datagrams sent to %v; %d datagrams over the limit; %v", mode, stats, n, target, limited, after)
	if n < junkRate*seconds*8/10 {
		t.Errorf("sent %d junk datagrams (%v), want about %d: the junk was not tested", n, junkErr, junkRate*seconds)
	}
	checkEchoes(t, stats, rate*seconds)
	// The session is well under the limit; a stall of this loaded machine
	// may bunch a few of its datagrams over the burst, the junk would be
	// hundreds.
	if limited > uint64(n)/100 {
		t.Errorf("%d datagrams over the limit: the session is well under it, the junk was charged", limited)
	}
}
