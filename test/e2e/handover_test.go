package e2e

import (
	"fmt"
	"net"
	"net/http"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	dstatus "github.com/l7mp/stunnerd-xdp/internal/status"
	"github.com/l7mp/stunnerd-xdp/test/netns"
	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// socketStatus reads /status from a daemon's --health-socket: the answer of
// that process, whichever holds the health port.
func socketStatus(t *testing.T, sock string) dstatus.Status {
	t.Helper()
	return statusOf(t)(netns.UnixGet(sock, "http://daemon/status"))
}

// xdpIfaces counts the interfaces where the daemon's XDP program runs: not
// those where its TC engine relays alone because another daemon's program
// holds the hook ("tc": the newcomer of a rollout, until the handover).
func xdpIfaces(st dstatus.Status) int {
	n := 0
	for _, m := range st.XDP.Attached {
		if m != "tc" {
			n++
		}
	}
	return n
}

// TestRollingUpdateHandover is a DaemonSet rolling update with maxSurge 1 on
// one node, with real binaries in a network namespace: the old daemon serves a
// session; the new one starts on the same ports while it runs and takes the
// next allocation; the old one is told to stop, hands XDP over to the new one
// (its session continues in the kernel with its TC engine), drains its
// session to the end and exits. Neither session loses more than 1 %.
// In userspace mode every ChannelData of the old session reaches the shared
// listener port, so the steering alone keeps it with its daemon. The last
// case stops the old daemon first and starts the new one during its drain,
// as when a pod is deleted by hand: XDP stays until the successor appears.
func TestRollingUpdateHandover(t *testing.T) {
	if testenv.InNetns() {
		t.Skip("parent-only test")
	}
	for _, mode := range []string{"native", "off"} {
		t.Run("xdp-"+mode, func(t *testing.T) { rollingUpdate(t, mode, false) })
	}
	// A pod deleted by hand: it drains first and its replacement starts
	// during the drain.
	t.Run("xdp-native/successor-during-drain", func(t *testing.T) { rollingUpdate(t, "native", true) })
}

func rollingUpdate(t *testing.T, mode string, late bool) {
	r := parentRig(t)
	pins := testenv.BPFFS(t)
	sockA, sockB := filepath.Join(t.TempDir(), "a.sock"), filepath.Join(t.TempDir(), "b.sock")
	common := []string{"--steering-dir=" + pins, "--xdp-mode=" + mode, "--grace-period=2m"}
	startEcho(t, r.Peer, echoPeer)

	type result struct{ sent, received int }
	session := func(relay net.PacketConn, d time.Duration) chan result {
		done := make(chan result, 1)
		go func() {
			s, n, _ := echoSession(t, relay, 1000, d)
			done <- result{s, n}
		}()
		return done
	}
	check := func(name string, res result) {
		t.Logf("%s: %d sent, %d echoed", name, res.sent, res.received)
		if float64(res.received) < 0.99*float64(res.sent) {
			t.Errorf("%s: %d of %d echoes, want at least 99%%", name, res.received, res.sent)
		}
	}

	// The old pod and its session.
	a := startBinaryUntil(t, r, nil, append(common, "--health-socket="+sockA)...)
	relay1, err := allocateFrom(t, r.Client)
	if err != nil {
		t.Fatal(err)
	}
	done1 := session(relay1, 8*time.Second)
	time.Sleep(1500 * time.Millisecond)
	drain := func() {
		if err := syscall.Kill(a.PID(), syscall.SIGTERM); err != nil {
			t.Fatal(err)
		}
		waitFor(t, "the old daemon drains after SIGTERM", 5*time.Second, func() bool { return socketStatus(t, sockA).Status == "TERMINATING" })
	}
	if late {
		drain()
		if st := socketStatus(t, sockA); mode == "native" && len(st.XDP.Attached) == 0 {
			t.Errorf("the old daemon gave up XDP with no successor: %+v", st)
		}
	}

	// The new pod: same ports, same health port (busy until the old one is gone).
	// Up once its health socket answers, asked in-process: a draining daemon hands over at once.
	b := startBinaryUntil(t, r, func() error {
		_, _, err := netns.UnixGet(sockB, "http://daemon/live")
		return err
	}, append(common, "--health-socket="+sockB)...)
	if !b.WaitOutput(`"msg":"health endpoint busy`, 2*time.Second) {
		t.Errorf("the new daemon did not report the busy health port:\n%s", b.Stderr())
	}
	// A draining old daemon hands XDP over once it sees the successor (it
	// looks every second), so the new one may hold it by now; both never.
	stB := socketStatus(t, sockB)
	if mode == "native" && xdpIfaces(stB) != 0 {
		if stA := socketStatus(t, sockA); !late || xdpIfaces(stA) != 0 {
			t.Errorf("the new daemon attached XDP while the old one holds it: new %+v, old %+v", stB.XDP, stA.XDP)
		}
	}
	relay2, err := allocateFrom(t, r.Client)
	if err != nil {
		t.Fatalf("allocation while both daemons run: %v", err)
	}
	done2 := session(relay2, 9*time.Second)
	var stA dstatus.Status
	if err := netns.Eventually(5*time.Second, 20*time.Millisecond, func() error {
		if stA, stB = socketStatus(t, sockA), socketStatus(t, sockB); stA.AllocationCount != 1 || stB.AllocationCount != 1 {
			return fmt.Errorf("old %d, new %d", stA.AllocationCount, stB.AllocationCount)
		}
		return nil
	}); err != nil {
		t.Fatalf("allocations: %v; want one each (new ones go to the new daemon)", err)
	}

	// The old pod is deleted: it drains.
	if !late {
		drain()
	}
	if st := socketStatus(t, sockA); st.Status != "TERMINATING" {
		t.Errorf("old daemon while draining: %+v", st)
	}
	if st := socketStatus(t, sockB); st.Status != "READY" {
		t.Errorf("new daemon while the old one drains: %+v", st)
	}
	// The DaemonSet's exec probes: each pod answers for itself.
	if err := probe(t, sockA, "ready"); err == nil {
		t.Error("the draining daemon's readiness probe passes")
	}
	if err := probe(t, sockA, "live"); err != nil {
		t.Errorf("the draining daemon's liveness probe: %v", err)
	}
	if err := probe(t, sockB, "ready"); err != nil {
		t.Errorf("the new daemon's readiness probe: %v", err)
	}
	// With a successor on the node the old daemon hands XDP over at once: its
	// own session continues in the kernel with its TC engine, behind the
	// successor's XDP program; the successor's moves to XDP.
	var oldKernelAtHandover uint64
	if mode == "native" {
		waitFor(t, "the new daemon takes over XDP during the old one's drain", 6*time.Second, func() bool {
			return xdpIfaces(socketStatus(t, sockB)) == len(r.ServerIfaces())
		})
		select {
		case <-done1:
			t.Fatal("the old session ended before the handover could be seen: lengthen it")
		default:
		}
		st := socketStatus(t, sockA)
		if xdpIfaces(st) != 0 || len(st.XDP.Attached) != len(r.ServerIfaces()) {
			t.Errorf("old daemon after the handover: %+v, want its TC engine alone on every interface", st.XDP)
		}
		oldKernelAtHandover = st.XDP.XDPPackets
	}
	// A client arriving now goes to the new daemon, not to the draining one
	// (which would refuse it with 486).
	relay3, err := allocateFrom(t, r.Client)
	if err != nil {
		t.Errorf("allocation during the old daemon's drain: %v", err)
	} else {
		relay3.Close()
	}

	check("old daemon's session across the new daemon's start and its own drain", <-done1)
	stA = socketStatus(t, sockA)
	t.Logf("old daemon before its last allocation ends: %+v steering %+v", stA, *stA.XDP.Steering)
	if mode == "native" {
		if grew := stA.XDP.XDPPackets - oldKernelAtHandover; grew < 1000 {
			t.Errorf("the old daemon's kernel path relayed %d packets after the handover: its session did not stay in the kernel", grew)
		}
	} else {
		// In userspace every datagram of the old session reaches the shared
		// listener port: the steering keeps it with its daemon.
		if stA.XDP.Steering.Owner < 1000 {
			t.Errorf("steering sent %d datagrams to allocation owners, want the old session's thousands", stA.XDP.Steering.Owner)
		}
		if stA.XDP.UserspacePackets < 1000 {
			t.Errorf("old daemon relayed %d packets in userspace: its session did not continue there", stA.XDP.UserspacePackets)
		}
	}
	// Refresh(0) reaches the old daemon through the steering; it exits.
	if err := relay1.Close(); err != nil {
		t.Fatal(err)
	}
	if err := a.Wait(10 * time.Second); err != nil {
		t.Fatalf("old daemon after its last allocation: %v\n%s", err, a.Stderr())
	}

	waitFor(t, "the new daemon takes the health port", 4*time.Second, func() bool {
		code, _, err := r.Server.HTTPGet("http://10.100.0.1:8086/ready")
		return err == nil && code == http.StatusOK
	})
	xdpBefore := socketStatus(t, sockB).XDP.XDPPackets
	check("new daemon's session across the old daemon's drain and exit", <-done2)
	stB = socketStatus(t, sockB)
	t.Logf("new daemon at the end: %+v steering %+v", stB, *stB.XDP.Steering)
	if mode == "native" && stB.XDP.XDPPackets <= xdpBefore {
		t.Errorf("the new daemon's session did not move to XDP after the takeover: %d -> %d packets", xdpBefore, stB.XDP.XDPPackets)
	}
	if b.Exited() {
		t.Fatalf("new daemon exited:\n%s", b.Stderr())
	}
}

// TestSuccessorKilled: the rolling update's new daemon is killed with SIGKILL
// after it took over (a crash, an OOM kill) while the old one drains with a
// session. The node must not be left without service: within 10 s the old
// daemon stands in (docs/operations.md): it is ready again, takes new
// allocations and takes XDP back, and its session never stops relaying. The
// userspace twin shows the same without XDP.
func TestSuccessorKilled(t *testing.T) {
	if testenv.InNetns() {
		t.Skip("parent-only test")
	}
	for _, mode := range []string{"native", "off"} {
		t.Run("xdp-"+mode, func(t *testing.T) { successorKilled(t, mode) })
	}
}

func successorKilled(t *testing.T, mode string) {
	r := parentRig(t)
	pins := testenv.BPFFS(t)
	sockA, sockB := filepath.Join(t.TempDir(), "a.sock"), filepath.Join(t.TempDir(), "b.sock")
	common := []string{"--steering-dir=" + pins, "--xdp-mode=" + mode, "--grace-period=2m"}
	xdp := mode != "off"
	ifaces := 0
	if xdp {
		ifaces = len(r.ServerIfaces())
	}
	startEcho(t, r.Peer, echoPeer)

	a := startBinaryUntil(t, r, nil, append(common, "--health-socket="+sockA)...)
	relay1, err := allocateFrom(t, r.Client)
	if err != nil {
		t.Fatal(err)
	}
	type result struct{ sent, received int }
	done1 := make(chan result, 1)
	go func() {
		s, n, _ := echoSession(t, relay1, 500, 16*time.Second)
		done1 <- result{s, n}
	}()
	b := startBinaryUntil(t, r, func() error { return probe(t, sockB, "live") }, append(common, "--health-socket="+sockB)...)
	if err := syscall.Kill(a.PID(), syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the new daemon takes over XDP", 8*time.Second, func() bool {
		return xdpIfaces(socketStatus(t, sockB)) == ifaces
	})
	waitFor(t, "the old daemon drains for the new one", 3*time.Second, func() bool {
		st := socketStatus(t, sockA)
		return st.Status == "TERMINATING" && xdpIfaces(st) == 0
	})
	relay2, err := allocateFrom(t, r.Client)
	if err != nil {
		t.Fatalf("allocation on the new daemon: %v", err)
	}
	relay2.Close()

	if err := b.Kill(); err == nil {
		t.Fatal("the new daemon survived SIGKILL")
	}
	killed := time.Now()
	waitFor(t, "the old daemon takes new allocations again", 10*time.Second, func() bool {
		relay, err := allocateFrom(t, r.Client)
		if err != nil {
			return false
		}
		relay.Close()
		return true
	})
	t.Logf("the old daemon took a new allocation %v after the kill", time.Since(killed).Round(time.Millisecond))
	waitFor(t, "the old daemon takes XDP back", 10*time.Second-time.Since(killed), func() bool {
		return xdpIfaces(socketStatus(t, sockA)) == ifaces
	})
	st := socketStatus(t, sockA)
	if st.Status != "READY" {
		t.Errorf("old daemon standing in: status %s, want READY", st.Status)
	}
	if err := probe(t, sockA, "ready"); err != nil {
		t.Errorf("old daemon standing in: readiness probe: %v", err)
	}
	xdpBefore := st.XDP.XDPPackets
	res := <-done1
	t.Logf("old daemon's session: %d sent, %d echoed", res.sent, res.received)
	if float64(res.received) < 0.99*float64(res.sent) {
		t.Errorf("old daemon's session: %d of %d echoes across the successor's start and death, want 99%%", res.received, res.sent)
	}
	if after := socketStatus(t, sockA).XDP.XDPPackets; xdp && after <= xdpBefore {
		t.Errorf("the old session did not move back to XDP: %d -> %d kernel packets", xdpBefore, after)
	}
	if a.Exited() {
		t.Fatalf("old daemon exited:\n%s", a.Stderr())
	}
}

// probe runs the DaemonSet's exec probe (live or ready) through a pod's own
// health socket.
func probe(t *testing.T, sock, what string) error {
	return exec.Command(netns.RequireBinary(t, netns.Daemon), "probe", "--health-socket="+sock, what).Run()
}
