// Package e2e runs stunnerd-xdp in network namespaces with real traffic:
// STUNner's turncat and iperf2, a UDP echo peer, pion/turn clients. Each test
// builds a rig in its parent process and re-executes itself inside the server
// namespace, so that every socket the daemon (and pion/turn's goroutines) opens
// lives there; clients and peers run in their namespaces through `ip netns exec`.
package e2e

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/l7mp/stunnerd-xdp/internal/channelmap"
	"github.com/l7mp/stunnerd-xdp/internal/daemon"
	"github.com/l7mp/stunnerd-xdp/internal/loader"
	"github.com/l7mp/stunnerd-xdp/internal/logging"
	"github.com/l7mp/stunnerd-xdp/test/netns"
	"github.com/l7mp/stunnerd-xdp/test/testenv"
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

// TestMain raises net.core.rmem_default for turncat (netns.RaiseRmemDefault)
// once, in the parent process, and restores it when the tests end.
func TestMain(m *testing.M) {
	restore := func() {}
	if !testenv.InNetns() && os.Geteuid() == 0 {
		if _, r, err := netns.RaiseRmemDefault(); err == nil {
			restore = r
		}
	}
	code := m.Run()
	restore()
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
	inRigWith(t, bridged, false, 3*time.Minute, body)
}

// inRigWith is inRig with IPv6 on the client side (netns.WithIPv6) when ipv6
// and the child bounded by timeout. The parent builds the rig and re-executes
// the test in its server namespace; the child gets the names in rigEnv.
func inRigWith(t *testing.T, bridged, ipv6 bool, timeout time.Duration, body func(t *testing.T, r rig)) {
	if !testenv.InNetns() {
		netns.RequirePrivileged(t, "iperf")
		netns.RequireBinary(t, netns.Turncat)
		netns.RequireBinary(t, netns.UDPEcho)
		var opts []netns.Option
		if bridged {
			opts = append(opts, netns.Bridged())
		}
		if ipv6 {
			opts = append(opts, netns.WithIPv6())
		}
		r := netns.New(t, opts...)
		if ipv6 && (r.ClientIf.Addr6 != client6 || r.ServerClientIf.Addr6 != listen6.Addr()) {
			t.Fatalf("rig IPv6 addresses client %v server %v, want %v and %v", r.ClientIf.Addr6, r.ServerClientIf.Addr6, client6, listen6.Addr())
		}
		spec := strings.Join([]string{r.Client.Name, r.Server.Name, r.Peer.Name, strings.Join(r.ServerIfaces(), "+"), strconv.FormatBool(ipv6)}, ",")
		testenv.RunInNetns(t, r.Server.Name, timeout, rigEnv+"="+spec)
		return
	}
	parts := strings.Split(os.Getenv(rigEnv), ",")
	if len(parts) != 5 {
		t.Fatalf("bad %s=%q", rigEnv, os.Getenv(rigEnv))
	}
	if parts[4] != strconv.FormatBool(ipv6) {
		t.Fatalf("%s wants a rig with IPv6 %v, runs in one with %s", t.Name(), ipv6, parts[4])
	}
	body(t, rig{client: &netns.NS{Name: parts[0]}, server: &netns.NS{Name: parts[1]}, peer: &netns.NS{Name: parts[2]},
		serverIfaces: strings.Split(parts[3], "+")})
}

// waitFor fails the test unless cond comes true within limit (scaled:
// testenv.Timeout).
func waitFor(t testing.TB, what string, limit time.Duration, cond func() bool) {
	t.Helper()
	if err := netns.Eventually(limit, 20*time.Millisecond, func() error {
		if cond() {
			return nil
		}
		return errors.New(what)
	}); err != nil {
		t.Fatalf("%s: not within %v", what, testenv.Timeout(limit))
	}
}

// parentRig is a routed rig for a test that runs the stunnerd-xdp binary in it
// from the parent process: such a test is never re-executed in a namespace.
func parentRig(t *testing.T) *netns.Rig {
	t.Helper()
	if testenv.InNetns() {
		t.Skip("parent-only test")
	}
	netns.RequirePrivileged(t)
	return netns.NewRouted(t)
}

// startEchoSession starts the daemon in mode, the echo peer and a pion/turn
// allocation from the client: the start of most relay tests.
func startEchoSession(t *testing.T, r rig, mode loader.Mode) (*daemon.Daemon, net.PacketConn) {
	t.Helper()
	d := startDaemon(t, mode, r.serverIfaces, nil)
	startEcho(t, r.peer, echoPeer)
	relay, err := allocateFrom(t, r.client)
	if err != nil {
		t.Fatal(err)
	}
	return d, relay
}

// startEcho runs udpecho's server in ns on addr and waits until it listens.
func startEcho(t testing.TB, ns *netns.NS, addr netip.AddrPort) *netns.Proc {
	t.Helper()
	p := ns.Start(t, netns.RequireBinary(t, netns.UDPEcho), "serve", addr.String())
	if err := ns.WaitUDPBound(int(addr.Port()), 5*time.Second, p); err != nil {
		t.Fatal(err)
	}
	return p
}

// startDaemon runs stunnerd-xdp in this (the server) namespace.
func startDaemon(t *testing.T, mode loader.Mode, ifaces []string, tweak func(*daemon.Config)) *daemon.Daemon {
	t.Helper()
	logger, err := logging.New("all:WARN,loader:INFO", "text", t.Output())
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
		// The rig's peer is in a private network the defaults refuse:
		// opened as an operator would, for it alone.
		AllowPeers: []netip.Prefix{netip.MustParsePrefix(peerAddr + "/32")},
		Logger:     logger,
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

// startTurncat tunnels udp://127.0.0.1:5000 in the client namespace to the peer
// through the relay, as STUNner's simple-tunnel guide does.
func startTurncat(t *testing.T, r rig, peerPort int) *netns.Proc {
	t.Helper()
	return r.client.StartTurncat(t, fmt.Sprintf("turn://%s:%s@%s", user, password, listenAddr), fmt.Sprintf("%s:%d", peerAddr, peerPort))
}

// paths is a snapshot of what each path relayed.
type paths struct {
	xdp                      channelmap.Stats
	userC2P, userP2C         uint64
	verdicts                 []uint64
	allocations, offloadSize int
	shield                   [4]uint64 // the read loops' shield, by shield.Reason
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
	for i := range p.shield {
		p.shield[i] = u.Shield[i].Load()
	}
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
