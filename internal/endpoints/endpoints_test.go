package endpoints

import (
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/l7mp/stunnerd-xdp/internal/logging"
)

func TestEndpointAddrs(t *testing.T) {
	pod := netip.MustParseAddr("10.0.0.5")
	for _, c := range []struct {
		addr string
		pod  netip.Addr
		want []string
	}{
		{":8086", pod, []string{"10.0.0.5:8086", "127.0.0.1:8086"}},
		{":8086", netip.Addr{}, []string{"127.0.0.1:8086"}},
		{":8086", netip.MustParseAddr("fd00::5"), []string{"[fd00::5]:8086", "127.0.0.1:8086"}},
		{":8086", netip.MustParseAddr("127.0.0.1"), []string{"127.0.0.1:8086"}},
		{"0.0.0.0:8086", pod, []string{"0.0.0.0:8086"}}, // a wildcard given is taken as written
		{"10.1.1.1:8080", pod, []string{"10.1.1.1:8080"}},
		{"", pod, nil},
	} {
		got, err := EndpointAddrs(c.addr, c.pod)
		if err != nil || !slices.Equal(got, c.want) {
			t.Errorf("EndpointAddrs(%q, %v) = %q, %v; want %q", c.addr, c.pod, got, err, c.want)
		}
	}
	if _, err := EndpointAddrs("8086", pod); err == nil {
		t.Error("an address without a port was accepted")
	}
}

// Issue 24: 300 idle connections to the health port made GET /live time out,
// and the kubelet restarted the pod. Now 1,000 idle connections from 8
// addresses, each reconnecting as soon as it is closed, sit on the
// endpoint while a probe from another address asks 10 times: never 3 in a
// row fail or take longer than 1 s (what would make the kubelet restart the
// pod: timeoutSeconds 1, failureThreshold 3). The endpoint stays bounded: at most httpMaxConns
// of the flood's connections are open on the server side at once.
func TestServeUnderIdleFlood(t *testing.T) {
	raw, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ln := &countingListener{Listener: raw}
	srv := Serve(ln, http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "live") }))
	defer srv.Close()
	addr := raw.Addr().(*net.TCPAddr)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var open, dials atomic.Int64
	for i := range 1000 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			dialer := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.IPv4(127, 0, 1, byte(1+i%8))}, Timeout: 500 * time.Millisecond}
			for {
				select {
				case <-stop:
					return
				default:
				}
				c, err := dialer.Dial("tcp4", addr.String())
				if err != nil {
					time.Sleep(10 * time.Millisecond)
					continue
				}
				dials.Add(1)
				open.Add(1)
				go func() { <-stop; c.Close() }()
				_, _ = c.Read(make([]byte, 1)) // until the server closes it
				open.Add(-1)
				c.Close()
				time.Sleep(50 * time.Millisecond) // a bounded flood
			}
		}()
	}
	defer func() { close(stop); wg.Wait() }()
	time.Sleep(time.Second) // the flood is in place
	get := func() (time.Duration, error) {
		c := &http.Client{Timeout: 2 * raceSlowdown * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
		start := time.Now()
		resp, err := c.Get("http://" + addr.String() + "/live")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				err = fmt.Errorf("status %d", resp.StatusCode)
			}
		}
		return time.Since(start), err
	}
	// The kubelet restarts the pod after failureThreshold (3) probes in a
	// row that took longer than timeoutSeconds (1 s, the operator's): that
	// must not happen. One slow answer on a loaded machine is not a restart;
	// the flood used to make every probe time out.
	timeout := raceSlowdown * time.Second
	var worst time.Duration
	slowInARow := 0
	for range 10 {
		d, err := get()
		if slowInARow = slowInARow + 1; err == nil && d <= timeout {
			slowInARow = 0
		}
		if slowInARow == 3 {
			t.Fatalf("/live under the flood: 3 probes in a row failed or took longer than %v (the last: %v after %v): the kubelet would restart the pod", timeout, err, d)
		}
		worst = max(worst, d)
		time.Sleep(100 * time.Millisecond)
	}
	t.Logf("10 probes, slowest %v; %d connections dialled by the flood, at most %d open in the server", worst, dials.Load(), ln.peak.Load())
	if p := ln.peak.Load(); p > httpMaxConns+1 { // +1: a newcomer before its victim closes
		t.Fatalf("%d connections open in the server at once, want at most %d", p, httpMaxConns)
	}
}

// countingListener counts the connections open at once.
type countingListener struct {
	net.Listener
	open, peak atomic.Int64
}

func (l *countingListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	n := l.open.Add(1)
	for p := l.peak.Load(); n > p && !l.peak.CompareAndSwap(p, n); p = l.peak.Load() {
	}
	return &countedConn{Conn: c, l: l}, nil
}

type countedConn struct {
	net.Conn
	l    *countingListener
	once sync.Once
}

func (c *countedConn) Close() error {
	c.once.Do(func() { c.l.open.Add(-1) })
	return c.Conn.Close()
}

// A health socket closed and served again at once (the bootstrap endpoints
// of cmd/stunnerd-xdp around a failed start) stays: the first server's
// listener must not unlink the path under the second one later.
func TestEndpointsUnixReopen(t *testing.T) {
	lf, err := logging.New("all:WARN", "text", io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	// One P: the servers' goroutines run only when this one blocks, so a
	// Close comes before its server's Serve, as on a loaded node.
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(1))
	sock := filepath.Join(t.TempDir(), "health.sock")
	h := http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "ok") })
	var last *Endpoints
	for range 20 {
		if last != nil {
			last.Close()
		}
		last = New(lf.Slog("test"))
		if err := last.ServeUnix(sock, h); err != nil {
			t.Fatal(err)
		}
	}
	defer last.Close()
	time.Sleep(100 * time.Millisecond) // the servers' goroutines have run
	if _, err := os.Stat(sock); err != nil {
		t.Fatalf("the socket of the running server is gone: %v", err)
	}
}
