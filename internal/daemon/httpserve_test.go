package daemon

import (
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"slices"
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

// The endpoints take httpMaxConns connections at once: clients that connect
// and send nothing cannot exhaust the process, and once they go (or the
// header timeout closes them) others are served.
func TestServeConnectionLimit(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := Serve(ln, http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "ok") }))
	defer srv.Close()
	url := "http://" + ln.Addr().String() + "/"
	get := func() error {
		c := &http.Client{Timeout: 500 * time.Millisecond, Transport: &http.Transport{DisableKeepAlives: true}}
		resp, err := c.Get(url)
		if err == nil {
			resp.Body.Close()
		}
		return err
	}
	if err := get(); err != nil {
		t.Fatal(err)
	}
	var idle []net.Conn
	for range httpMaxConns {
		c, err := net.Dial("tcp", ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		idle = append(idle, c)
	}
	time.Sleep(100 * time.Millisecond) // accepted
	if err := get(); err == nil {
		t.Fatalf("served with %d idle connections open, want the limit to hold it back", httpMaxConns)
	}
	for _, c := range idle {
		c.Close()
	}
	deadline := time.Now().Add(5 * time.Second)
	for get() != nil {
		if time.Now().After(deadline) {
			t.Fatal("not served after the idle connections closed")
		}
	}
}

func TestPprofLoopbackOnly(t *testing.T) {
	lf, err := logging.New("all:WARN", "text", io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		addr string
		ok   bool
	}{{"127.0.0.1:6060", true}, {"[::1]:6060", true}, {"0.0.0.0:6060", false}, {"10.0.0.1:6060", false}, {":6060", false}, {"localhost:6060", false}} {
		cfg := Config{Listen: netip.MustParseAddrPort("127.0.0.1:3478"), Users: map[string]string{"u": "p"}, PprofAddr: c.addr, Logger: lf}
		if err := cfg.validate(); (err == nil) != c.ok {
			t.Errorf("pprof on %q: %v, want ok=%v", c.addr, err, c.ok)
		}
	}
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
		last = NewEndpoints(lf.Slog("test"))
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
