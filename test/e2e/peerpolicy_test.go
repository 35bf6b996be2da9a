package e2e

import (
	"net"
	"net/netip"
	"strings"
	"testing"

	"github.com/l7mp/stunnerd-xdp/internal/config"
	"github.com/l7mp/stunnerd-xdp/internal/daemon"
	"github.com/l7mp/stunnerd-xdp/internal/loader"
)

// internalPeers are one peer in each internal network the daemon refuses by
// default; the first is the rig's echo peer.
var internalPeers = []string{peerAddr, "172.16.0.1", "192.168.1.1", "100.64.0.1", "fd00::1"}

// TestInternalPeersClosedByDefault: with the default flags a pion/turn client
// cannot reach peers in 10/8, 172.16/12, 192.168/16, 100.64/10 or fc00::/7
// (403 Forbidden), and can when --allow-peer or a STUNner cluster admits
// them; XDP and off alike (the refusal is pion's permission check, before
// any channel reaches the maps).
func TestInternalPeersClosedByDefault(t *testing.T) {
	for _, mode := range []loader.Mode{loader.ModeNative, loader.ModeOff} {
		t.Run(string(mode), func(t *testing.T) {
			inRig(t, false, func(t *testing.T, r rig) { testInternalPeersClosed(t, r, mode) })
		})
	}
}

func testInternalPeersClosed(t *testing.T, r rig, mode loader.Mode) {
	startEcho(t, r.peer, echoPeer)
	write := func(relay net.PacketConn, peer string) error {
		_, err := relay.WriteTo([]byte("x"), &net.UDPAddr{IP: net.ParseIP(peer), Port: int(echoPeer.Port())})
		return err
	}
	// Defaults: every internal peer is refused with 403, nothing relayed.
	d := startDaemon(t, mode, r.serverIfaces, func(c *daemon.Config) { c.AllowPeers = nil })
	relay, err := allocateFrom(t, r.client)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range internalPeers {
		if err := write(relay, p); err == nil || !strings.Contains(err.Error(), "403") {
			t.Errorf("default flags, peer %s: %v, want a 403", p, err)
		}
	}
	if s := snapshot(t, d); s.userC2P != 0 || s.xdp.ClientToPeerPackets != 0 {
		t.Errorf("default flags: relayed %+v to refused peers", s)
	}
	relay.Close()
	d.Close()

	// --allow-peer opens them; the echo peer's session relays (in the kernel
	// unless off).
	var open []netip.Prefix
	for _, p := range []string{"10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "fc00::/7"} {
		open = append(open, netip.MustParsePrefix(p))
	}
	d = startDaemon(t, mode, r.serverIfaces, func(c *daemon.Config) { c.AllowPeers = open })
	if relay, err = allocateFrom(t, r.client); err != nil {
		t.Fatal(err)
	}
	for _, p := range internalPeers[1:] {
		if err := write(relay, p); err != nil {
			t.Errorf("--allow-peer, peer %s: %v", p, err)
		}
	}
	checkAdmitted(t, d, relay, mode, "--allow-peer")
	relay.Close()
	d.Close()

	// A STUNner cluster of the echo peer admits it, and only it.
	d = startDaemon(t, mode, r.serverIfaces, func(c *daemon.Config) {
		c.AllowPeers = nil
		c.Listeners = []config.ResolvedListener{{Name: "udp", Protocol: config.UDP, Addr: listenAddr,
			AllowPeers: []netip.Prefix{netip.MustParsePrefix(peerAddr + "/32")}, Allowlist: true}}
	})
	if relay, err = allocateFrom(t, r.client); err != nil {
		t.Fatal(err)
	}
	if err := write(relay, "172.16.0.1"); err == nil || !strings.Contains(err.Error(), "403") {
		t.Errorf("cluster of %s, peer 172.16.0.1: %v, want a 403", peerAddr, err)
	}
	checkAdmitted(t, d, relay, mode, "cluster")
	relay.Close()
}

// checkAdmitted runs an echo session to the rig's peer and fails unless it
// came back, relayed by XDP unless mode is off.
func checkAdmitted(t *testing.T, d *daemon.Daemon, relay net.PacketConn, mode loader.Mode, what string) {
	t.Helper()
	before := snapshot(t, d)
	sent, got, _ := echoSession(t, relay, 200, 2e9)
	after := snapshot(t, d)
	if sent == 0 || float64(got) < 0.9*float64(sent) {
		t.Errorf("%s: %d of %d echoes", what, got, sent)
	}
	xdp := after.xdp.ClientToPeerPackets - before.xdp.ClientToPeerPackets
	if mode != loader.ModeOff && xdp == 0 {
		t.Errorf("%s: XDP relayed nothing of %d datagrams", what, sent)
	}
	if mode == loader.ModeOff && xdp != 0 {
		t.Errorf("%s: off, yet XDP relayed %d", what, xdp)
	}
}
