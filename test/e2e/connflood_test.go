package e2e

import (
	"crypto/tls"
	"encoding/base64"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/l7mp/stunnerd-xdp/test/netns"
	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// memoryCgroup is a memory cgroup of the test's own with limit bytes: under
// /sys/fs/cgroup on a cgroup v2 host with the memory controller, else under
// the v1 memory hierarchy (this machine's layout); removed at cleanup, after
// the processes started in it have gone.
type memoryCgroup struct {
	dir string
	v2  bool
}

func newMemoryCgroup(t *testing.T, limit int64) *memoryCgroup {
	t.Helper()
	name := fmt.Sprintf("stunnerd-xdp-test-%d", os.Getpid())
	var cg memoryCgroup
	if b, err := os.ReadFile("/sys/fs/cgroup/cgroup.controllers"); err == nil && strings.Contains(string(b), "memory") {
		cg = memoryCgroup{dir: filepath.Join("/sys/fs/cgroup", name), v2: true}
	} else {
		base := "/sys/fs/cgroup/memory"
		if self, err := os.ReadFile("/proc/self/cgroup"); err == nil {
			for _, l := range strings.Split(string(self), "\n") {
				if parts := strings.SplitN(l, ":", 3); len(parts) == 3 && parts[1] == "memory" {
					base = filepath.Join(base, parts[2])
				}
			}
		}
		cg = memoryCgroup{dir: filepath.Join(base, name)}
	}
	if err := os.Mkdir(cg.dir, 0o755); err != nil {
		t.Fatalf("memory cgroup: %v", err)
	}
	t.Cleanup(func() {
		// The daemon is stopped by an earlier cleanup; its exit may lag.
		_ = netns.Eventually(10*time.Second, 50*time.Millisecond, func() error { return os.Remove(cg.dir) })
	})
	file, value := "memory.limit_in_bytes", strconv.FormatInt(limit, 10)
	if cg.v2 {
		file = "memory.max"
		if err := os.WriteFile(filepath.Join(cg.dir, "memory.swap.max"), []byte("0"), 0); err != nil && !errors.Is(err, os.ErrNotExist) {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(cg.dir, file), []byte(value), 0); err != nil {
		t.Fatal(err)
	}
	return &cg
}

// start runs cmd in ns inside the cgroup. `ip netns exec` remounts /sys, so
// the command cannot join the cgroup itself: a shell waits for the test to
// move it in (before the daemon allocates anything), then execs cmd.
func (cg *memoryCgroup) start(t *testing.T, ns *netns.NS, cmd ...string) *netns.Proc {
	t.Helper()
	gate := filepath.Join(t.TempDir(), "gate")
	p := ns.Start(t, "sh", append([]string{"-c", `while [ ! -e "$0" ]; do sleep 0.01; done; exec "$@"`, gate}, cmd...)...)
	if err := os.WriteFile(filepath.Join(cg.dir, "cgroup.procs"), []byte(strconv.Itoa(p.PID())), 0); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(gate, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("daemon log:\n%s", p.Stderr())
		}
	})
	if err := netns.Eventually(10*time.Second, 50*time.Millisecond, func() error {
		if p.Exited() {
			return netns.Abort(fmt.Errorf("exited: %w", p.Wait(time.Second)))
		}
		return ns.GetOK("http://10.100.0.1:8086/ready")
	}); err != nil {
		t.Fatalf("daemon did not come up: %v", err)
	}
	return p
}

func (cg *memoryCgroup) read(file string) int64 {
	b, err := os.ReadFile(filepath.Join(cg.dir, file))
	if err != nil {
		return -1
	}
	v, _ := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
	return v
}

// peak is the highest memory use of the cgroup so far.
func (cg *memoryCgroup) peak() int64 {
	if cg.v2 {
		return cg.read("memory.peak")
	}
	return cg.read("memory.max_usage_in_bytes")
}

// ooms is how many times the cgroup hit its limit and killed.
func (cg *memoryCgroup) ooms() int64 {
	file, key := "memory.oom_control", "oom_kill "
	if cg.v2 {
		file, key = "memory.events", "oom_kill "
	}
	b, _ := os.ReadFile(filepath.Join(cg.dir, file))
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, key); ok {
			n, _ := strconv.ParseInt(v, 10, 64)
			return n
		}
	}
	return 0
}

// TestTCPSlowBodyFlood is issue 24's slow-body attack on the TURN-TCP and
// TURN-TLS listeners, the daemon in a 256 MiB memory cgroup: 500 TCP and 500
// TLS connections each send a STUN header announcing 0xFFE8 bytes of body,
// then one byte per connection every 20 ms (bounded load: 50,000 writes a
// second in all, not the one byte a millisecond). pion/turn reads
// each byte with one more level of recursion in its STUNConn, so the
// goroutines' stacks grow with every byte and the daemon went past the
// limit. Now each connection is bounded (connlimit): the daemon stays under
// slowBodyBound, the frames are cut at --tcp-frame-timeout, a UDP session
// relayed by pion (--xdp-mode=off: userspace must survive, not the kernel
// path) keeps its echoes, and idle connections and stalled TLS handshakes are
// closed at their timeouts. The client has one address, so the per-source
// cap is lifted (the cap itself is tested in internal/connlimit).
func TestTCPSlowBodyFlood(t *testing.T) {
	const (
		perProto      = 500
		slowBodyBound = 72 << 20 // 5 MiB at rest, ~46 KiB a connection measured
		interval      = 20 * time.Millisecond
	)
	r := parentRig(t)
	cg := newMemoryCgroup(t, 256<<20)
	_, certPEM, keyPEM := testenv.SelfSigned(t)
	cert, key := base64.StdEncoding.EncodeToString(certPEM), base64.StdEncoding.EncodeToString(keyPEM)
	cfgPath := filepath.Join(t.TempDir(), "stunnerd.conf")
	writeConfig(t, cfgPath, stunnerConfig("secret", fmt.Sprintf(`  - name: tls-listener
    protocol: TURN-TLS
    address: 10.100.0.1
    port: 5349
    cert: %s
    key: %s
    routes: [media-plane]
`, cert, key)))
	bin := netns.RequireBinary(t, netns.Daemon)
	p := cg.start(t, r.Server, bin, "--log-format=json", "--relay-address=10.200.0.1",
		"--xdp-mode=off", "--steering-dir=", "-c", cfgPath, "--max-tcp-conns-per-source=0",
		"--tcp-idle-timeout=4s", "--tls-handshake-timeout=3s", "--tcp-frame-timeout=10s")
	startEcho(t, r.Peer, echoPeer)
	u, pw := restCredentials(t, "secret")
	relay, err := allocateWith(t, r.Client, "10.100.0.1:3478", u, pw, false)
	if err != nil {
		t.Fatal(err)
	}
	type result struct{ sent, received int }
	done := make(chan result, 1)
	go func() {
		s, n, _ := echoSession(t, relay, 100, 16*time.Second)
		done <- result{s, n}
	}()
	base := cg.peak()

	// The connections, dialled in the client namespace: the slow bodies,
	// then idle ones (TCP, nothing sent) and stalled TLS handshakes.
	var slow, idle, stalled []net.Conn
	if err := r.Client.Do(func() error {
		for i := range 2*perProto + 100 {
			port := "3479"
			if i%2 == 1 {
				port = "5349"
			}
			c, err := net.Dial("tcp4", "10.100.0.1:"+port)
			if err != nil {
				return fmt.Errorf("connection %d: %w", i, err)
			}
			switch {
			case i < 2*perProto:
				slow = append(slow, c)
			case port == "3479":
				idle = append(idle, c)
			default:
				stalled = append(stalled, c)
			}
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	defer func() {
		for _, c := range append(append(slow, idle...), stalled...) {
			c.Close()
		}
	}()
	var wg sync.WaitGroup
	for i, c := range slow {
		if i%2 == 1 {
			tc := tls.Client(c, &tls.Config{InsecureSkipVerify: true})
			_ = tc.SetDeadline(time.Now().Add(10 * time.Second))
			if err := tc.Handshake(); err != nil {
				t.Fatalf("TLS handshake %d: %v", i, err)
			}
			slow[i] = tc
		}
	}
	header := make([]byte, 20)
	binary.BigEndian.PutUint16(header[0:], 0x0003) // Allocate request
	binary.BigEndian.PutUint16(header[2:], 0xffe8)
	binary.BigEndian.PutUint32(header[4:], 0x2112a442)
	start := time.Now()
	cut := make([]time.Duration, len(slow)) // when a write failed: the daemon closed it
	for i, c := range slow {
		if _, err := c.Write(header); err != nil {
			t.Fatalf("header %d: %v", i, err)
		}
	}
	// One goroutine per 100 connections writes their bytes in turn.
	for g := 0; g < len(slow); g += 100 {
		wg.Add(1)
		go func(conns []net.Conn, cut []time.Duration) {
			defer wg.Done()
			for time.Since(start) < 15*time.Second {
				for i, c := range conns {
					if cut[i] != 0 {
						continue
					}
					_ = c.SetWriteDeadline(time.Now().Add(time.Second))
					if _, err := c.Write([]byte{'x'}); err != nil {
						cut[i] = time.Since(start)
					}
				}
				time.Sleep(interval)
			}
		}(slow[g:min(g+100, len(slow))], cut[g:min(g+100, len(slow))])
	}
	// The idle and stalled connections: closed by the daemon at their timeouts.
	closedBy := func(conns []net.Conn, limit time.Duration) (closed int) {
		for _, c := range conns {
			_ = c.SetReadDeadline(start.Add(limit))
			if _, err := c.Read(make([]byte, 1)); err != nil && !errors.Is(err, os.ErrDeadlineExceeded) {
				closed++
			}
		}
		return closed
	}
	idleClosed := closedBy(idle, 8*time.Second)
	stalledClosed := closedBy(stalled, 8*time.Second)
	wg.Wait()
	peak := cg.peak()
	res := <-done
	slowCut := 0
	for _, d := range cut {
		if d != 0 && d < 14*time.Second {
			slowCut++
		}
	}
	t.Logf("memory peak %.1f MiB (%.1f MiB before the flood), %d OOM kills; %d of %d slow bodies cut, %d of %d idle and %d of %d stalled TLS closed; session %d of %d echoes",
		float64(peak)/(1<<20), float64(base)/(1<<20), cg.ooms(), slowCut, len(slow), idleClosed, len(idle), stalledClosed, len(stalled), res.received, res.sent)
	if p.Exited() || cg.ooms() > 0 {
		t.Fatalf("the daemon died (OOM kills %d)", cg.ooms())
	}
	if peak > slowBodyBound {
		t.Errorf("memory peak %d MiB, want at most %d MiB", peak>>20, slowBodyBound>>20)
	}
	if slowCut != len(slow) {
		t.Errorf("%d of %d slow-body connections cut by the frame timeout", slowCut, len(slow))
	}
	if idleClosed != len(idle) || stalledClosed != len(stalled) {
		t.Errorf("idle connections closed: %d of %d; stalled TLS handshakes closed: %d of %d", idleClosed, len(idle), stalledClosed, len(stalled))
	}
	if res.received < res.sent*99/100 {
		t.Errorf("the UDP session lost echoes during the flood: %d of %d", res.received, res.sent)
	}
	// The daemon says what it closed, and why.
	m, err := r.Server.Scrape("http://10.100.0.1:8080/metrics")
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		timeout string
		want    int
	}{{"frame", len(slow)}, {"idle", len(idle)}, {"handshake", len(stalled)}} {
		if got, _ := m.Sum("stunnerd_xdp_tcp_connections_timed_out_total", "timeout", c.timeout); int(got) < c.want {
			t.Errorf("stunnerd_xdp_tcp_connections_timed_out_total{timeout=%q} %v, want at least %d", c.timeout, got, c.want)
		}
	}
}
