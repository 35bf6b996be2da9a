package e2e

import (
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/pion/stun/v3"
	"github.com/pion/turn/v4"

	"github.com/l7mp/stunnerd-xdp/internal/config"
	"github.com/l7mp/stunnerd-xdp/internal/daemon"
	"github.com/l7mp/stunnerd-xdp/internal/loader"
	dstatus "github.com/l7mp/stunnerd-xdp/internal/status"
	"github.com/l7mp/stunnerd-xdp/test/netns"
	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// TestLiveSwitch flips the relay between XDP native, userspace and XDP generic
// while iperf runs through turncat: the session survives every flip and the
// loss stays under 1 %.
func TestLiveSwitch(t *testing.T) {
	inRig(t, false, func(t *testing.T, r rig) {
		// The config's mode, not the command line's, which would pin it.
		d := startDaemon(t, loader.ModeNative, r.serverIfaces, func(c *daemon.Config) { c.XDPMode, c.ConfigXDPMode = "", loader.ModeNative })
		done := make(chan netns.IperfResult, 1)
		go func() { done <- iperfThroughTurncat(t, r) }()
		modes := []loader.Mode{loader.ModeOff, loader.ModeGeneric, loader.ModeOff, loader.ModeNative, loader.ModeOff, loader.ModeNative}
		var seen []string
		for _, m := range modes {
			time.Sleep(1500 * time.Millisecond)
			if err := d.SetConfigMode(m); err != nil {
				t.Errorf("switch to %s: %v", m, err)
			}
			p := snapshot(t, d)
			seen = append(seen, fmt.Sprintf("%s[%v]", m, p))
			if m == loader.ModeOff && (len(d.Attached()) != 0 || p.offloadSize != 0) {
				t.Errorf("after switching off: attached %v, %d bindings in the maps", d.Attached(), p.offloadSize)
			}
			if m != loader.ModeOff && p.offloadSize == 0 {
				t.Errorf("after switching to %s: no binding in the maps", m)
			}
		}
		res := <-done
		after := snapshot(t, d)
		t.Logf("flips: %s", strings.Join(seen, " -> "))
		t.Logf("relayed: %v; iperf %+v", after, res)
		if res.LossPercent >= 1 {
			t.Errorf("loss %.3f%% across %d switches, want under 1%%", res.LossPercent, len(modes))
		}
		if after.xdp.ClientToPeerPackets == 0 || after.userC2P < uint64(iperfRate) {
			t.Errorf("want both paths to have carried the session: %v", after)
		}
	})
}

// allocateFrom makes a pion/turn allocation from the client namespace and
// returns the error of the Allocate.
func allocateFrom(t *testing.T, ns *netns.NS) (net.PacketConn, error) {
	t.Helper()
	return allocateWith(t, ns, listenAddr.String(), user, password, false)
}

// allocateWith allocates through the given server over UDP or TCP with the
// given credentials. The socket is created inside the namespace; pion's
// goroutines only use it.
func allocateWith(t *testing.T, ns *netns.NS, server, username, pass string, tcp bool) (net.PacketConn, error) {
	t.Helper()
	network := "udp4"
	if tcp {
		network = "tcp4"
	}
	return ns.Allocate(t, network, "10.100.0.2:0", &turn.ClientConfig{TURNServerAddr: server, Username: username, Password: pass, Realm: config.DefaultRealm})
}

func status(t *testing.T, ns *netns.NS) dstatus.Status {
	t.Helper()
	return statusOf(t)(ns.HTTPGet("http://10.100.0.1:8086/status"))
}

// statusOf decodes the answer to a GET /status, failing the test unless it is
// a 200 with a status.
func statusOf(t *testing.T) func(int, string, error) dstatus.Status {
	return func(code int, body string, err error) dstatus.Status {
		t.Helper()
		var st dstatus.Status
		if err != nil || code != http.StatusOK || json.Unmarshal([]byte(body), &st) != nil {
			t.Fatalf("/status: %v %d %q", err, code, body)
		}
		return st
	}
}

// startBinary runs the stunnerd-xdp binary in the server namespace and waits
// for its health endpoint. Its steering maps go to a bpffs of the test's own.
func startBinary(t *testing.T, r *netns.Rig, args ...string) *netns.Proc {
	t.Helper()
	args = append([]string{"--steering-dir=" + testenv.BPFFS(t)}, args...)
	return startBinaryUntil(t, r, nil, args...)
}

// startBinaryUntil runs the binary with the test defaults and args (later
// flags win) and waits until up succeeds (runBinary).
func startBinaryUntil(t *testing.T, r *netns.Rig, up func() error, args ...string) *netns.Proc {
	t.Helper()
	return runBinary(t, r, up, binaryArgs(args...)...)
}

// binaryArgs are the test defaults, args (later flags win) and the TURN URI.
func binaryArgs(args ...string) []string {
	// The rig's peer is in a private network the defaults refuse: opened
	// as an operator would, for it alone.
	args = append([]string{"--xdp-mode=native", "--log-format=json", "--relay-address=10.200.0.1", "--allow-peer=" + peerAddr + "/32",
		"--metrics-addr=", "--health-addr=10.100.0.1:8086"}, args...)
	return append(args, fmt.Sprintf("turn://%s:%s@%s", user, password, listenAddr))
}

// runBinary runs the stunnerd-xdp binary in the server namespace with args and
// waits until up succeeds; nil waits for the health endpoint at
// 10.100.0.1:8086 to answer /ready (with a config origin, /live answers before
// the first config is served). The daemon's log is shown when the test fails.
func runBinary(t *testing.T, r *netns.Rig, up func() error, args ...string) *netns.Proc {
	t.Helper()
	return runCommand(t, r, up, append([]string{netns.RequireBinary(t, netns.Daemon)}, args...))
}

// runCommand is runBinary for a command line that runs the binary (under a
// wrapper such as setpriv).
func runCommand(t *testing.T, r *netns.Rig, up func() error, cmd []string) *netns.Proc {
	t.Helper()
	if up == nil {
		up = func() error { return r.Server.GetOK("http://10.100.0.1:8086/ready") }
	}
	return runIn(t, r.Server, up, cmd)
}

// runIn runs a command line that runs the daemon in the namespace ns (a rig's server, a node
// rig's node) and waits until up succeeds. The daemon's log is shown when the test fails.
func runIn(t *testing.T, ns *netns.NS, up func() error, cmd []string) *netns.Proc {
	t.Helper()
	p := ns.Start(t, cmd[0], cmd[1:]...)
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("daemon log:\n%s", p.Stderr())
		}
	})
	if err := netns.Eventually(10*time.Second, 50*time.Millisecond, func() error {
		if p.Exited() {
			return netns.Abort(fmt.Errorf("exited: %w", p.Wait(time.Second)))
		}
		return up()
	}); err != nil {
		t.Fatalf("daemon did not come up: %v", err)
	}
	return p
}

// echoSession runs a taggedSession to the echo peer at rate for d and returns
// what it sent, the echoes and when the last one came.
func echoSession(t *testing.T, relay net.PacketConn, rate int, d time.Duration) (sent, received int, last time.Time) {
	s := &taggedSession{}
	s.run(t, relay, sessionTags.Add(1), rate, d)
	return int(s.sent.Load()), int(s.received.Load()), time.Unix(0, s.last.Load())
}

var sessionTags atomic.Uint64

// TestGracefulDrain: SIGTERM stops new allocations, keeps the live session
// relaying for the whole drain, fails /ready, reports TERMINATING, and the
// daemon exits by itself when the last allocation is gone, leaving no XDP.
func TestGracefulDrain(t *testing.T) {
	r := parentRig(t)
	p := startBinary(t, r, "--grace-period=2m")
	startEcho(t, r.Peer, echoPeer)
	relay, err := allocateFrom(t, r.Client)
	if err != nil {
		t.Fatal(err)
	}
	type result struct {
		sent, received int
		last           time.Time
	}
	done := make(chan result, 1)
	start := time.Now()
	go func() {
		s, n, last := echoSession(t, relay, 1000, 5*time.Second)
		done <- result{s, n, last}
	}()
	// SIGTERM once the session's channel is in the maps, and no earlier
	// than 1.5 s into it.
	if err := netns.Eventually(10*time.Second, 50*time.Millisecond, func() error {
		if st := status(t, r.Server); st.Status != "READY" || st.AllocationCount != 1 || st.XDP.Offloaded != 1 {
			return fmt.Errorf("%+v", st)
		}
		return nil
	}); err != nil {
		t.Fatalf("before SIGTERM: %v", err)
	}
	time.Sleep(time.Until(start.Add(1500 * time.Millisecond)))
	if err := syscall.Kill(p.PID(), syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	sigterm := time.Since(start)
	waitFor(t, "/ready answers 503 while draining", 5*time.Second, func() bool {
		code, _, _ := r.Server.HTTPGet("http://10.100.0.1:8086/ready")
		return code == http.StatusServiceUnavailable
	})
	if st := status(t, r.Server); st.Status != "TERMINATING" || st.AllocationCount != 1 || len(st.XDP.Attached) != 2 {
		t.Errorf("while draining: %+v", st)
	}
	if _, err := allocateFrom(t, r.Client); turnErrorCode(err) != stun.CodeAllocQuotaReached {
		t.Errorf("a new allocation during the drain: %v, want a 486 error response", err)
	}
	res := <-done
	t.Logf("echo session across the drain: %d sent, %d echoed", res.sent, res.received)
	if float64(res.received) < 0.99*float64(res.sent) {
		t.Errorf("%d of %d echoes, want at least 99%%", res.received, res.sent)
	}
	if res.last.Sub(start) < 4900*time.Millisecond {
		t.Errorf("echoes stopped %v into the 5 s session (SIGTERM at %v)", res.last.Sub(start), sigterm.Round(time.Millisecond))
	}
	if p.Exited() {
		t.Fatalf("daemon exited with a live allocation:\n%s", p.Stderr())
	}
	// Closing the allocation sends Refresh(lifetime=0); the daemon follows.
	if err := relay.Close(); err != nil {
		t.Fatal(err)
	}
	if err := p.Wait(10 * time.Second); err != nil {
		t.Fatalf("daemon after the last allocation: %v\n%s", err, p.Stderr())
	}
	if !strings.Contains(p.Stderr(), "last allocation gone") {
		t.Errorf("daemon did not say why it exited:\n%s", p.Stderr())
	}
	for _, i := range r.ServerIfaces() {
		if xdpAttached(t, r.Server, i) {
			t.Errorf("XDP still attached to %s after exit", i)
		}
	}
}

// TestSecondSignalExitsAtOnce: a second SIGTERM or SIGINT ends the drain.
func TestSecondSignalExitsAtOnce(t *testing.T) {
	r := parentRig(t)
	p := startBinary(t, r, "--grace-period=10m")
	if _, err := allocateFrom(t, r.Client); err != nil {
		t.Fatal(err)
	}
	_ = syscall.Kill(p.PID(), syscall.SIGTERM)
	// The drain has begun once /ready fails; a second later the daemon is
	// still there.
	waitFor(t, "/ready answers 503 after SIGTERM", 5*time.Second, func() bool {
		code, _, _ := r.Server.HTTPGet("http://10.100.0.1:8086/ready")
		return code == http.StatusServiceUnavailable
	})
	time.Sleep(time.Second)
	if p.Exited() {
		t.Fatalf("daemon exited on the first SIGTERM with a live allocation:\n%s", p.Stderr())
	}
	_ = syscall.Kill(p.PID(), syscall.SIGINT)
	if err := p.Wait(3 * time.Second); err != nil || !p.Exited() {
		t.Fatalf("daemon after the second signal: exited=%v err=%v\n%s", p.Exited(), err, p.Stderr())
	}
	if !strings.Contains(p.Stderr(), "second signal") {
		t.Errorf("no word of the second signal in the log:\n%s", p.Stderr())
	}
}
