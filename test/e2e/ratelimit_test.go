package e2e

import (
	"math"
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
