package main

import (
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// originRun is runOrigin running in this process on a command line.
type originRun struct {
	t    *testing.T
	sigs chan os.Signal
	exit chan int
	log  *testenv.LockedBuffer
}

// startOrigin runs runOrigin in the background; the test ends it with stop.
func startOrigin(t *testing.T, args ...string) *originRun {
	t.Helper()
	return startRun(t, args, func(o options, log io.Writer, sigs chan os.Signal) int { return runOrigin(o, log, sigs) })
}

// startRun runs run with the options of args in the background; the test
// ends it with stop.
func startRun(t *testing.T, args []string, run func(options, io.Writer, chan os.Signal) int) *originRun {
	t.Helper()
	t.Setenv("POD_IP", "") // the health port on loopback only
	t.Setenv("STUNNER_ADDR", "")
	r := &originRun{t: t, sigs: make(chan os.Signal, 2), exit: make(chan int, 1), log: &testenv.LockedBuffer{}}
	o, _, err := parseFlags(args, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	go func() { r.exit <- run(o, r.log, r.sigs) }()
	t.Cleanup(func() {
		signal.Stop(r.sigs)
		select {
		case <-r.exit:
		default:
			r.sigs <- syscall.SIGTERM
			r.sigs <- syscall.SIGTERM // a second one exits at once
			<-r.exit
		}
	})
	return r
}

// waitFor waits until cond holds, failing the test when runOrigin exits
// first or within timeout.
func (r *originRun) waitFor(what string, timeout time.Duration, cond func() bool) {
	r.t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		select {
		case code := <-r.exit:
			r.exit <- code
			r.t.Fatalf("%s: exited %d first\n%s", what, code, r.log)
		case <-time.After(100 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			r.t.Fatalf("%s: not within %v\n%s", what, timeout, r.log)
		}
	}
}

// stop sends SIGTERM and wants exit 0.
func (r *originRun) stop() {
	r.t.Helper()
	r.sigs <- syscall.SIGTERM
	select {
	case code := <-r.exit:
		r.exit <- code
		if code != 0 {
			r.t.Fatalf("exit %d after SIGTERM\n%s", code, r.log)
		}
	case <-time.After(10 * time.Second):
		r.t.Fatalf("no exit 10 s after SIGTERM\n%s", r.log)
	}
}

// probeSocket is `stunnerd-xdp probe --health-socket sock what` succeeding.
func probeSocket(sock, what string) bool {
	return probe([]string{"--health-socket=" + sock, what}, io.Discard, io.Discard) == 0
}

// A new pod waiting for its config while the pod it replaces still holds the
// health port (hostNetwork, maxSurge 1) answers on its socket, and takes the
// port when the old pod lets go, as the daemon does; it used to exit 1.
func TestBootHealthPortBusy(t *testing.T) {
	held, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer held.Close()
	port := strconv.Itoa(held.Addr().(*net.TCPAddr).Port)
	dir := t.TempDir()
	sock := filepath.Join(dir, "health.sock")
	r := startOrigin(t, "-c", filepath.Join(dir, "stunnerd.conf"), "-w", "--log=all:INFO",
		"--health-addr=:"+port, "--health-socket="+sock, "--metrics-addr=")
	r.waitFor("live on the health socket", 5*time.Second, func() bool { return probeSocket(sock, "live") })
	if probeSocket(sock, "ready") {
		t.Error("ready without a config")
	}
	held.Close()
	r.waitFor("/live on the freed health port", 5*time.Second, func() bool {
		resp, err := http.Get("http://127.0.0.1:" + port + "/live")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})
	if n := strings.Count(r.log.String(), "health endpoint busy"); n != 1 {
		t.Errorf("the busy port logged %d times, want once\n%s", n, r.log)
	}
	r.stop()
}

// A first start that fails (the pod this one replaces still holds the TURN
// port; no handover dir, so the listener binds it exclusively) is tried again with the same config: a file origin sends no other
// when the port comes free. It used to stay unready until the file changed.
func TestBootRetriesFailedStart(t *testing.T) {
	held, port := holdTURNPort(t)
	dir := t.TempDir()
	sock := filepath.Join(dir, "health.sock")
	file := writeConfig(t, dir, port)
	r := startOrigin(t, "-c", file, "-w", "--log=all:INFO", "--xdp-mode=off", "--steering-dir=", "--grace-period=1s",
		"--health-addr=", "--metrics-addr=", "--health-socket="+sock)
	r.waitFor("the failed start", 10*time.Second, func() bool {
		return strings.Contains(r.log.String(), "address already in use")
	})
	r.waitFor("live on the health socket", 5*time.Second, func() bool { return probeSocket(sock, "live") })
	if probeSocket(sock, "ready") {
		t.Fatalf("ready while the TURN port is held\n%s", r.log)
	}
	held.Close()
	r.waitFor("ready once the TURN port is free", 10*time.Second, func() bool { return probeSocket(sock, "ready") })
	waitAllocates(t, fmt.Sprintf("127.0.0.1:%d", port), "p")
	r.stop()
}

// holdTURNPort binds a free UDP port on loopback below the relay range (and
// the kernel's ephemeral ports), as the pod being replaced holds its TURN port.
func holdTURNPort(t *testing.T) (net.PacketConn, int) {
	t.Helper()
	port := 20000 + rand.IntN(10000)
	held, err := net.ListenPacket("udp4", fmt.Sprintf("127.0.0.1:%d", port))
	for ; err != nil && port < 32000; port++ {
		held, err = net.ListenPacket("udp4", fmt.Sprintf("127.0.0.1:%d", port+1))
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = held.Close() })
	return held, port
}

// writeConfig writes a config of one TURN-UDP listener on 127.0.0.1:port.
func writeConfig(t *testing.T, dir string, port int) string {
	t.Helper()
	file := filepath.Join(dir, "stunnerd.conf")
	doc := fmt.Sprintf(`{"version":"v1","admin":{},"auth":{"type":"static","credentials":{"username":"u","password":"p"}},
"listeners":[{"name":"udp","protocol":"TURN-UDP","address":"127.0.0.1","port":%d}]}`, port)
	if err := os.WriteFile(file, []byte(doc), 0o600); err != nil {
		t.Fatal(err)
	}
	return file
}

// Without -w, a node label client that cannot be built exits 1, as with a
// TURN URI, and closes the daemon it had started: its ports are free.
func TestOriginLabelClientFailureCloses(t *testing.T) {
	held, port := holdTURNPort(t)
	held.Close()
	dir := t.TempDir()
	r := startOrigin(t, "-c", writeConfig(t, dir, port), "--log=all:INFO", "--xdp-mode=off", "--steering-dir=",
		"--health-addr=", "--metrics-addr=", "--node-name=node-1", "--kubeconfig="+filepath.Join(dir, "no-kubeconfig"))
	select {
	case code := <-r.exit:
		r.exit <- code
		if code != 1 {
			t.Fatalf("exit %d, want 1\n%s", code, r.log)
		}
	case <-time.After(10 * time.Second):
		t.Fatalf("still running with a node label client that cannot be built\n%s", r.log)
	}
	c, err := net.ListenPacket("udp4", fmt.Sprintf("127.0.0.1:%d", port))
	if err != nil {
		t.Fatalf("the TURN port is still held after the exit: %v\n%s", err, r.log)
	}
	c.Close()
}

// A start that keeps failing is tried 1 s, 2 s, 4 s ... later, never more
// than 30 s; a new config starts the count over.
func TestStartRetryBackoff(t *testing.T) {
	a := &applier{}
	var got []time.Duration
	for range 7 {
		a.scheduleRetry()
		got = append(got, a.retryWait)
	}
	want := []time.Duration{time.Second, 2 * time.Second, 4 * time.Second, 8 * time.Second, 16 * time.Second, 30 * time.Second, 30 * time.Second}
	if !slices.Equal(got, want) {
		t.Errorf("waits %v, want %v", got, want)
	}
	a.cancelRetry()
	if a.retryC() != nil {
		t.Error("a cancelled retry still fires")
	}
	if a.scheduleRetry(); a.retryWait != time.Second {
		t.Errorf("after a new config the first wait is %v, want 1s", a.retryWait)
	}
	a.cancelRetry()
}
