// Package e2e runs stunnerd-xdp in network namespaces with real traffic:
// STUNner's turncat and iperf2, a UDP echo peer, pion/turn clients. Each test
// builds a rig in its parent process and re-executes itself inside the server
// namespace, so that every socket the daemon (and pion/turn's goroutines) opens
// lives there; clients and peers run in their namespaces through `ip netns exec`.
package e2e

import (
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/l7mp/stunnerd-xdp/internal/channelmap"
	"github.com/l7mp/stunnerd-xdp/internal/daemon"
	"github.com/l7mp/stunnerd-xdp/internal/loader"
	"github.com/l7mp/stunnerd-xdp/internal/logging"
	"github.com/l7mp/stunnerd-xdp/internal/testenv"
	"github.com/l7mp/stunnerd-xdp/test/netns"
)

const (
	rigEnv   = "STUNNERD_XDP_RIG"
	user     = "user1"
	password = "passwd1"
)

var (
	listenAddr = netip.MustParseAddrPort("10.100.0.1:3478")
	relayAddr  = netip.MustParseAddr("10.200.0.1")
	peerAddr   = "10.200.0.2"
)

// socketBuffer is net.core.rmem_default while the tests run. turncat has no
// flag for its socket buffers, and with the default 208 KiB its loopback socket
// holds about 13 ms of a 20,000 packet/s stream: on this shared two-core VM
// stalls that long happen every few runs and show up as loss at the iperf
// server that no relay caused. The sysctl is global (not per namespace), so it
// is set once by the parent process and restored when the tests end.
const socketBuffer = "4194304"

func TestMain(m *testing.M) {
	restore := func() {}
	if !testenv.InNetns() && os.Geteuid() == 0 {
		const knob = "/proc/sys/net/core/rmem_default"
		if old, err := os.ReadFile(knob); err == nil {
			if err := os.WriteFile(knob, []byte(socketBuffer), 0); err == nil {
				restore = func() { _ = os.WriteFile(knob, old, 0) }
			}
		}
	}
	code := m.Run()
	restore()
	if daemonBin != "" {
		_ = os.RemoveAll(filepath.Dir(daemonBin))
	}
	os.Exit(code)
}

// rig is what the child sees of the namespaces its parent built.
type rig struct {
	client, server, peer *netns.NS
	serverIfaces         []string
}

// inRig runs body inside the server namespace of a fresh rig (bridged: client
// and peer behind one server interface).
func inRig(t *testing.T, bridged bool, body func(t *testing.T, r rig)) {
	if !testenv.InNetns() {
		netns.RequirePrivileged(t, "iperf")
		requireTool(t, turncatPath())
		requireTool(t, udpechoPath(t))
		var r *netns.Rig
		if bridged {
			r = netns.NewBridged(t)
		} else {
			r = netns.NewRouted(t)
		}
		spec := strings.Join([]string{r.Client.Name, r.Server.Name, r.Peer.Name, strings.Join(r.ServerIfaces(), "+")}, ",")
		testenv.RunInNetns(t, r.Server.Name, 3*time.Minute, rigEnv+"="+spec)
		return
	}
	parts := strings.Split(os.Getenv(rigEnv), ",")
	if len(parts) != 4 {
		t.Fatalf("bad %s=%q", rigEnv, os.Getenv(rigEnv))
	}
	body(t, rig{client: &netns.NS{Name: parts[0]}, server: &netns.NS{Name: parts[1]}, peer: &netns.NS{Name: parts[2]},
		serverIfaces: strings.Split(parts[3], "+")})
}

func repoRoot() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(file), "..", "..")
}

// turncatPath is STUNner's turncat v1.1.0 as `make tools` builds it.
func turncatPath() string {
	if p := os.Getenv("TURNCAT"); p != "" {
		return p
	}
	return filepath.Join(repoRoot(), "bin", "turncat")
}

var udpechoBin string

// udpechoPath builds test/cmd/udpecho once per process.
func udpechoPath(t *testing.T) string {
	if udpechoBin != "" {
		return udpechoBin
	}
	p := filepath.Join(repoRoot(), "bin", "udpecho")
	if testenv.InNetns() {
		udpechoBin = p
		return p
	}
	cmd := exec.Command("go", "build", "-o", p, "./test/cmd/udpecho")
	cmd.Dir = repoRoot()
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("build udpecho: %v\n%s", err, out)
	}
	udpechoBin = p
	return p
}

func requireTool(t *testing.T, path string) {
	t.Helper()
	if _, err := os.Stat(path); err == nil {
		return
	}
	if os.Getenv("CI") == "true" {
		t.Fatalf("%s is missing (run `make tools`); CI=true forbids skipping", path)
	}
	t.Skipf("%s is missing: run `make tools`", path)
}

// startDaemon runs stunnerd-xdp in this (the server) namespace.
func startDaemon(t *testing.T, mode loader.Mode, ifaces []string, tweak func(*daemon.Config)) *daemon.Daemon {
	t.Helper()
	logger, err := logging.New("all:WARN,loader:INFO", "text", testWriter{t})
	if err != nil {
		t.Fatal(err)
	}
	cfg := daemon.Config{
		Listen:       listenAddr,
		Users:        map[string]string{user: password},
		RelayAddress: relayAddr,
		XDPMode:      mode,
		Interfaces:   ifaces,
		MaxBindings:  4096,
		Logger:       logger,
	}
	if tweak != nil {
		tweak(&cfg)
	}
	d, err := daemon.Start(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := d.Close(); err != nil {
			t.Errorf("daemon close: %v", err)
		}
	})
	if mode != loader.ModeOff {
		got := d.Attached()
		for _, i := range ifaces {
			if got[i] != mode {
				t.Fatalf("interface %s attached %q, want %q", i, got[i], mode)
			}
		}
	}
	return d
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

// startTurncat tunnels udp://127.0.0.1:5000 in the client namespace to the peer
// through the relay, as STUNner's simple-tunnel guide does.
func startTurncat(t *testing.T, r rig, peerPort int) *netns.Proc {
	t.Helper()
	p := r.client.Start(t, turncatPath(), "--log=all:WARN", "udp://127.0.0.1:5000",
		fmt.Sprintf("turn://%s:%s@%s", user, password, listenAddr), fmt.Sprintf("udp://%s:%d", peerAddr, peerPort))
	// turncat listens at once; the allocation follows the first datagram.
	time.Sleep(500 * time.Millisecond)
	if p.Exited() {
		t.Fatalf("turncat exited: %s", p.Stderr())
	}
	return p
}

// paths is a snapshot of what each path relayed.
type paths struct {
	xdp                      channelmap.Stats
	userC2P, userP2C         uint64
	verdicts                 []uint64
	allocations, offloadSize int
}

func snapshot(t *testing.T, d *daemon.Daemon) paths {
	t.Helper()
	var p paths
	if m := d.Maps(); m != nil {
		var err error
		if p.xdp, err = m.Totals(); err != nil {
			t.Fatal(err)
		}
		if p.verdicts, err = m.Verdicts(); err != nil {
			t.Fatal(err)
		}
		p.offloadSize = m.Len()
	}
	u := d.UserspaceCounters()
	p.userC2P, p.userP2C = u.ClientToPeerPackets.Load(), u.PeerToClientPackets.Load()
	p.allocations = d.AllocationCount()
	return p
}

func (p paths) String() string {
	return fmt.Sprintf("xdp c2p=%d p2c=%d | userspace c2p=%d p2c=%d", p.xdp.ClientToPeerPackets, p.xdp.PeerToClientPackets, p.userC2P, p.userP2C)
}

func share(xdp, user uint64) float64 {
	if xdp+user == 0 {
		return 0
	}
	return float64(xdp) / float64(xdp+user)
}

func mustUDPAddr(s string) *net.UDPAddr {
	a, err := net.ResolveUDPAddr("udp4", s)
	if err != nil {
		panic(err)
	}
	return a
}

// metric reads one sample from /metrics inside the namespace.
func metric(t *testing.T, ns *netns.NS, name string) float64 {
	t.Helper()
	return scrape(t, ns).get(t, name)
}
