package daemon

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pion/turn/v4"

	"github.com/l7mp/stunnerd-xdp/internal/config"
	"github.com/l7mp/stunnerd-xdp/internal/loader"
	"github.com/l7mp/stunnerd-xdp/internal/logging"
	"github.com/l7mp/stunnerd-xdp/internal/nodelabel"
	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// TestConfigReadDuringReload: the configuration is read by goroutines other
// than the reload's (the node-label watcher, pion/turn's auth and quota
// callbacks, the health endpoint) while reloads replace it. Under -race (make
// test) any read not ordered with the reload's write fails the test.
func TestConfigReadDuringReload(t *testing.T) {
	listen := netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), freePort(t))
	health := filepath.Join(t.TempDir(), "health.sock")
	lf, err := logging.New("all:WARN", "text", t.Output())
	if err != nil {
		t.Fatal(err)
	}
	cfg := func(users map[string]string) Config {
		return Config{
			Listeners:    []config.ResolvedListener{{Name: "udp", Protocol: config.UDP, Addr: listen}},
			Users:        users,
			RelayAddress: netip.MustParseAddr("127.0.0.1"),
			MinRelayPort: 62000, MaxRelayPort: 62999,
			XDPMode:      loader.ModeOff,
			HealthSocket: health,
			Logger:       lf,
		}
	}
	d, err := Start(cfg(map[string]string{"u": "p"}))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })

	// duringReloads runs readers while reloads run back to back, and returns
	// the user the last reload added.
	duringReloads := func(readers ...func()) string {
		stop := make(chan struct{})
		last := make(chan string, 1)
		go func() {
			for i := 0; ; i++ {
				user := fmt.Sprint("u", i)
				if err := d.Reconfigure(cfg(map[string]string{"u": "p", user: "p"})); err != nil {
					t.Errorf("reload %d: %v", i, err)
				}
				select {
				case <-stop:
					last <- user
					return
				default:
				}
			}
		}()
		var wg sync.WaitGroup
		for _, r := range readers {
			wg.Go(r)
		}
		wg.Wait()
		close(stop)
		return <-last
	}
	const rounds = 5
	last := duringReloads(
		func() {
			for range rounds {
				if err := d.FollowNode(context.Background(), nodelabel.Default); err != nil {
					t.Errorf("node label: %v", err)
				}
			}
		},
		func() {
			for range rounds {
				if _, err := allocateAs(t, listen, "nobody"); err == nil {
					t.Error("an unknown user allocated")
				}
			}
		})
	if _, err := allocateAs(t, listen, last); err != nil {
		t.Errorf("the user of the last reload cannot allocate: %v", err)
	}

	// Draining: /ready and the quota callback look at the configuration.
	d.Drain()
	duringReloads(
		func() {
			for range rounds {
				if code := getUnix(t, health, "/ready"); code != http.StatusServiceUnavailable {
					t.Errorf("/ready while draining: %d, want %d", code, http.StatusServiceUnavailable)
				}
			}
		},
		func() {
			for range rounds {
				if _, err := allocateAs(t, listen, "u"); err == nil {
					t.Error("allocated while draining")
				}
			}
		})
}

// getUnix GETs path from the HTTP server on a unix socket; 0 on errors.
func getUnix(t *testing.T, socket, path string) int {
	c := http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", socket)
	}}}
	resp, err := c.Get("http://daemon" + path)
	if err != nil {
		t.Errorf("GET %s: %v", path, err)
		return 0
	}
	resp.Body.Close()
	return resp.StatusCode
}

// allocateAs tries a pion/turn allocation from loopback as user (password p);
// it returns the client's socket.
func allocateAs(t *testing.T, server netip.AddrPort, user string) (net.PacketConn, error) {
	conn, err := net.ListenPacket("udp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	_, err = testenv.Allocate(t, &turn.ClientConfig{
		TURNServerAddr: server.String(), STUNServerAddr: server.String(),
		Username: user, Password: "p", Realm: config.DefaultRealm, Conn: conn,
	})
	return conn, err
}

// TestCloseWithLiveAllocations: closing the daemon closes pion/turn's
// allocations, whose goroutines report their deletion after Server.Close has
// returned; those late hooks must not reach the closed mirror (under -race a
// send racing the close fails the test; without it, it may panic).
func TestCloseWithLiveAllocations(t *testing.T) {
	listen := netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), freePort(t))
	lf, err := logging.New("all:WARN", "text", t.Output())
	if err != nil {
		t.Fatal(err)
	}
	d, err := Start(Config{
		Listeners:    []config.ResolvedListener{{Name: "udp", Protocol: config.UDP, Addr: listen}},
		Users:        map[string]string{"u": "p"},
		RelayAddress: netip.MustParseAddr("127.0.0.1"),
		MinRelayPort: 63000, MaxRelayPort: 63999,
		XDPMode: loader.ModeOff,
		Logger:  lf,
	})
	if err != nil {
		t.Fatal(err)
	}
	var clients []net.PacketConn
	for range 10 {
		c, err := allocateAs(t, listen, "u")
		if err != nil {
			t.Fatal(err)
		}
		clients = append(clients, c)
	}
	if n := d.AllocationCount(); n != 10 {
		t.Fatalf("%d allocations, want 10", n)
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	closed := d.Mirror().Stats().Events
	// The clients' deallocations would wait for a server that is gone.
	for _, c := range clients {
		c.Close()
	}
	// Wait for the allocations' goroutines to report and end.
	eventually(t, 5*time.Second, "pion's allocation goroutines ended", func() bool {
		buf := make([]byte, 1<<20)
		return !strings.Contains(string(buf[:runtime.Stack(buf, true)]), "(*Allocation).packetHandler")
	})
	if late := d.Mirror().Stats().Events - closed; late != 0 {
		t.Errorf("%d pion/turn events reached the mirror after the daemon closed", late)
	}
}

// TestConfigSnapshotIsOwned: the running config shares no memory with the
// Config a caller passed to Start or Reconfigure, so a caller that reuses its
// value cannot change the snapshot under the daemon's readers.
func TestConfigSnapshotIsOwned(t *testing.T) {
	listen := netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), freePort(t))
	lf, err := logging.New("all:WARN", "text", t.Output())
	if err != nil {
		t.Fatal(err)
	}
	cfg := Config{
		Listeners:    []config.ResolvedListener{{Name: "udp", Protocol: config.UDP, Addr: listen, AllowPeers: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}}},
		Users:        map[string]string{"u": "p"},
		RelayAddress: netip.MustParseAddr("127.0.0.1"),
		MinRelayPort: 63000, MaxRelayPort: 63999,
		XDPMode: loader.ModeOff,
		Logger:  lf,
	}
	d, err := Start(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	check := func(when string) {
		t.Helper()
		got := d.config()
		if got.Listeners[0].Name != "udp" || got.Users["u"] != "p" || len(got.Users) != 1 {
			t.Errorf("%s: the caller's changes reached the running config: %+v, users %v", when, got.Listeners[0], got.Users)
		}
	}
	cfg.Listeners[0].Name, cfg.Users["intruder"] = "changed", "x"
	check("after Start")

	cfg.Listeners[0].Name, cfg.Users = "udp", map[string]string{"u": "p"}
	if err := d.Reconfigure(cfg); err != nil {
		t.Fatal(err)
	}
	cfg.Listeners[0].Name, cfg.Users["intruder"] = "changed", "x"
	check("after Reconfigure")

	// A setting only a restart changes: kept, and said with ErrNeedsRestart.
	cfg.Listeners[0].Name, cfg.Users = "udp", map[string]string{"u": "p"}
	cfg.MaxRelayPort = 63500
	if err := d.Reconfigure(cfg); !errors.Is(err, ErrNeedsRestart) {
		t.Errorf("reload with a new relay port range: %v, want ErrNeedsRestart", err)
	}
	if got := d.config().MaxRelayPort; got != 63999 {
		t.Errorf("relay port range changed to %d without a restart", got)
	}
}

// TestReloadKeepsNodeLabel: a reload whose config asks for another XDP mode
// goes to the offload manager as the config's input, which the node label
// outranks; the label going back to default hands the decision to the config
// again. Mode is the manager's decision, so no XDP is needed: the interface
// does not exist (nothing is attached anywhere).
func TestReloadKeepsNodeLabel(t *testing.T) {
	listen := netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), freePort(t))
	lf, err := logging.New("all:ERROR", "text", t.Output())
	if err != nil {
		t.Fatal(err)
	}
	cfg := Config{
		Listeners:    []config.ResolvedListener{{Name: "udp", Protocol: config.UDP, Addr: listen}},
		Users:        map[string]string{"u": "p"},
		RelayAddress: netip.MustParseAddr("127.0.0.1"),
		MinRelayPort: 61000, MaxRelayPort: 61999,
		ConfigXDPMode: loader.ModeOff,
		Interfaces:    []string{"nosuchif0"},
		Logger:        lf,
	}
	d, err := Start(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	wantMode := func(when string, want loader.Mode) {
		t.Helper()
		if got := d.Mode(); got != want {
			t.Errorf("%s: mode %q, want %q", when, got, want)
		}
	}
	wantMode("offload_engine None", loader.ModeOff)
	if err := d.FollowNode(context.Background(), nodelabel.Detach); err != nil {
		t.Fatal(err)
	}
	cfg.ConfigXDPMode = loader.ModeAuto
	if err := d.Reconfigure(cfg); err != nil {
		t.Fatal(err)
	}
	wantMode("label disabled, then a reload to offload_engine Auto", loader.ModeOff)
	// XDP cannot attach to the missing interface (nor load without root):
	// the mode stays what the inputs say.
	if err := d.FollowNode(context.Background(), nodelabel.Default); err == nil {
		t.Error("label back to default: no error, but the interface does not exist")
	}
	wantMode("label back to default", loader.ModeAuto)
	if len(d.Attached()) != 0 {
		t.Errorf("attached %v", d.Attached())
	}
}
