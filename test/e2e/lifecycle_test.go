package e2e

import (
	"errors"
	"fmt"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/pion/turn/v4"

	"github.com/l7mp/stunnerd-xdp/internal/config"
	"github.com/l7mp/stunnerd-xdp/internal/daemon"
	"github.com/l7mp/stunnerd-xdp/internal/loader"
	"github.com/l7mp/stunnerd-xdp/test/netns"
)

// removalDeadline is how soon after pion's event a binding must leave the maps.
const removalDeadline = time.Second

// allocate makes a pion/turn client allocation in the server namespace and
// sends to the peer until its channel binding shows up in the maps.
func allocate(t *testing.T, r rig, d *daemon.Daemon) net.PacketConn {
	t.Helper()
	relay, err := r.server.Allocate(t, "udp4", "10.100.0.1:0", &turn.ClientConfig{TURNServerAddr: listenAddr.String(), Username: user, Password: password, Realm: config.DefaultRealm})
	if err != nil {
		t.Fatalf("allocate: %v", err)
	}
	peer := &net.UDPAddr{IP: net.ParseIP(peerAddr), Port: 5001}
	if err := netns.Eventually(5*time.Second, 50*time.Millisecond, func() error {
		if d.Maps().Len() != 0 {
			return nil
		}
		if _, err := relay.WriteTo([]byte("hello"), peer); err != nil {
			return netns.Abort(fmt.Errorf("write to peer: %w", err))
		}
		return errors.New("no channel binding in the maps")
	}); err != nil {
		t.Fatal(err)
	}
	return relay
}

// waitEmpty waits until the kernel maps hold nothing in either direction and
// returns how long that took.
func waitEmpty(t *testing.T, d *daemon.Daemon, limit time.Duration) time.Duration {
	t.Helper()
	start := time.Now()
	if err := netns.Eventually(limit, 10*time.Millisecond, func() error {
		c2p, err := d.Maps().Dump()
		if err != nil {
			return netns.Abort(err)
		}
		p2c, err := d.Maps().DumpPeerToClient()
		if err != nil {
			return netns.Abort(err)
		}
		if len(c2p) != 0 || p2c != 0 {
			return fmt.Errorf("the maps hold %d client->peer and %d peer->client entries", len(c2p), p2c)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	return time.Since(start)
}

// TestAllocationRefreshZeroRemovesBindings: a Refresh with lifetime 0 ends the
// allocation; its entries leave the maps within a second.
func TestAllocationRefreshZeroRemovesBindings(t *testing.T) {
	inRig(t, false, func(t *testing.T, r rig) {
		d := startDaemon(t, loader.ModeNative, r.serverIfaces, nil)
		relay := allocate(t, r, d)
		if d.AllocationCount() != 1 {
			t.Fatalf("%d allocations, want 1", d.AllocationCount())
		}
		if err := relay.Close(); err != nil { // sends Refresh(lifetime=0)
			t.Fatal(err)
		}
		took := waitEmpty(t, d, removalDeadline)
		t.Logf("bindings left the maps %v after the Refresh(0) was sent", took)
	})
}

// TestChannelExpiryRemovesBindings: a channel that is not refreshed expires
// (ChannelBindTimeout shortened to 2 s); its entries leave the maps within a
// second of the expiry.
func TestChannelExpiryRemovesBindings(t *testing.T) {
	inRig(t, false, func(t *testing.T, r rig) {
		const lifetime = 2 * time.Second
		d := startDaemon(t, loader.ModeNative, r.serverIfaces, func(c *daemon.Config) { c.ChannelBindTimeout = lifetime })
		allocate(t, r, d)
		took := waitEmpty(t, d, lifetime+removalDeadline)
		t.Logf("bindings left the maps %v after the binding was seen (lifetime %v)", took, lifetime)
		if took < lifetime/2 {
			t.Fatalf("binding removed after %v, long before it expired", took)
		}
		if _, ch := d.Mirror().Counts(); ch != 0 {
			t.Fatalf("mirror still holds %d channels", ch)
		}
		if d.AllocationCount() != 1 {
			t.Fatalf("the allocation went away with the channel (%d allocations)", d.AllocationCount())
		}
	})
}

// xdpAttached reports whether any XDP program is attached to the interface.
func xdpAttached(t *testing.T, ns *netns.NS, iface string) bool {
	t.Helper()
	out := ns.IP(t, "-d", "link", "show", "dev", iface)
	return strings.Contains(out, "prog/xdp") || strings.Contains(out, " xdp")
}

// TestKill9Detaches: the program is attached through bpf_links the daemon holds,
// so SIGKILL leaves no XDP program behind. Before the kill, the binary serves
// health and metrics as operators expect.
func TestKill9Detaches(t *testing.T) {
	r := parentRig(t)
	p := startBinary(t, r, "--metrics-addr=10.100.0.1:8080")
	for _, i := range r.ServerIfaces() {
		if !xdpAttached(t, r.Server, i) {
			t.Fatalf("no XDP program on %s while the daemon runs", i)
		}
	}
	for _, path := range []string{"/live", "/ready"} {
		if err := r.Server.GetOK("http://10.100.0.1:8086" + path); err != nil {
			t.Error(err)
		}
	}
	_, metrics, err := r.Server.HTTPGet("http://10.100.0.1:8080/metrics")
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		`stunnerd_xdp_attached{iface="srv0",mode="native"} 1`,
		`stunnerd_xdp_attached{iface="srv1",mode="native"} 1`,
		`stunnerd_xdp_packets_total{direction="client_to_peer",path="xdp"} 0`,
		`stunnerd_xdp_packets_total{direction="peer_to_client",path="userspace"} 0`,
		`stunnerd_xdp_bytes_total{direction="client_to_peer",path="userspace"} 0`,
		`stunnerd_xdp_verdicts_total{reason="pass_stun"}`,
		`stunnerd_xdp_allocations_active 0`,
		`stunnerd_xdp_channels_active 0`,
		`stunnerd_xdp_steering_total{verdict="owner"} 0`,
	} {
		if !strings.Contains(metrics, want) {
			t.Errorf("metrics lack %q", want)
		}
	}
	if !strings.Contains(p.Stderr(), `"scope":"loader"`) || !strings.Contains(p.Stderr(), `"mode":"native"`) {
		t.Errorf("JSON log does not say which mode each interface got:\n%s", p.Stderr())
	}

	_ = p.Kill() // SIGKILL to the process group; reports the killed exit
	_ = p.Wait(5 * time.Second)
	if !p.Exited() {
		t.Fatal("daemon survived SIGKILL")
	}
	for _, i := range r.ServerIfaces() {
		waitFor(t, "XDP program detached from "+i+" after kill -9", time.Second, func() bool { return !xdpAttached(t, r.Server, i) })
	}
}
