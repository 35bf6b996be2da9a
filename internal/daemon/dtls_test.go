package daemon

import (
	"context"
	"crypto/tls"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/pion/dtls/v3"
	"github.com/pion/turn/v4"

	"github.com/l7mp/stunnerd-xdp/internal/config"
	"github.com/l7mp/stunnerd-xdp/internal/connlimit"
	"github.com/l7mp/stunnerd-xdp/internal/loader"
	"github.com/l7mp/stunnerd-xdp/internal/logging"
	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// dialDTLS makes a DTLS connection to addr and completes its handshake.
func dialDTLS(t *testing.T, addr netip.AddrPort) net.Conn {
	t.Helper()
	c, err := dtls.DialWithOptions("udp4", net.UDPAddrFromAddrPort(addr), dtls.WithInsecureSkipVerify(true))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := c.HandshakeContext(ctx); err != nil {
		c.Close()
		t.Fatalf("DTLS handshake: %v", err)
	}
	return c
}

// A TURN-DTLS listener (STUNner's DTLS Gateway) serves a pion/turn client
// over pion/dtls: it allocates and relays both ways through a UDP peer; the
// connection counts toward the limits, and an idle DTLS connection is closed
// at the idle timeout as a TLS one is.
func TestDTLSListener(t *testing.T) {
	cert, _, _ := testenv.SelfSigned(t)
	listen := netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), freePort(t))
	lim := connlimit.Defaults()
	lim.IdleTimeout = 500 * time.Millisecond
	d := startDTLS(t, listen, cert, "", lim)
	peer, err := net.ListenPacket("udp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer peer.Close()
	relay, err := testenv.Allocate(t, &turn.ClientConfig{TURNServerAddr: listen.String(), STUNServerAddr: listen.String(),
		Username: "alice", Password: "a", Realm: config.DefaultRealm, Conn: turn.NewSTUNConn(dialDTLS(t, listen))})
	if err != nil {
		t.Fatalf("allocation over DTLS: %v", err)
	}
	defer relay.Close()
	// pion/turn v4's client STUNConn waits for more after a frame under 9
	// bytes (consumeSingleTURNFrame): ChannelData with 5 bytes or more.
	testenv.RoundTrip(t, relay, peer)
	if open := d.Guards().Conns.Open; open != 1 {
		t.Fatalf("%d connections counted, want 1", open)
	}
	idle := dialDTLS(t, listen)
	defer idle.Close()
	_ = idle.SetReadDeadline(time.Now().Add(3 * time.Second))
	start := time.Now()
	_, err = idle.Read(make([]byte, 1500))
	t.Logf("idle read: %v after %v", err, time.Since(start))
	if err == nil || isTimeout(err) {
		t.Fatalf("an idle DTLS connection: %v, want it closed", err)
	}
	if got := d.Guards().Conns.IdleTimeouts; got < 1 {
		t.Fatalf("%d idle timeouts counted (%+v)", got, d.Guards().Conns)
	}
}

// With the steering, a second daemon binds the same DTLS listener (a rolling
// update): the first daemon's DTLS session keeps relaying through it, and a
// new session goes to the newer daemon.
func TestDTLSSteered(t *testing.T) {
	testenv.RequireRoot(t)
	cert, _, _ := testenv.SelfSigned(t)
	listen := netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), freePort(t))
	pins := testenv.BPFFS(t)
	start := func() *Daemon { return startDTLS(t, listen, cert, pins, connlimit.Limits{}) }
	allocate := func() net.PacketConn {
		t.Helper()
		relay, err := testenv.Allocate(t, &turn.ClientConfig{TURNServerAddr: listen.String(), STUNServerAddr: listen.String(),
			Username: "alice", Password: "a", Realm: config.DefaultRealm, Conn: turn.NewSTUNConn(dialDTLS(t, listen))})
		if err != nil {
			t.Fatalf("allocation over DTLS: %v", err)
		}
		t.Cleanup(func() { relay.Close() })
		return relay
	}
	peer, err := net.ListenPacket("udp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer peer.Close()
	a := start()
	old := allocate()
	testenv.RoundTrip(t, old, peer)
	b := start()
	for range 3 {
		testenv.RoundTrip(t, old, peer)
	}
	testenv.RoundTrip(t, allocate(), peer)
	if na, nb := a.AllocationCount(), b.AllocationCount(); na != 1 || nb != 1 {
		t.Fatalf("allocations: first daemon %d, second %d; want 1 and 1", na, nb)
	}
}

// startDTLS starts a daemon with one TURN-DTLS listener on listen for alice,
// relaying to loopback peers, and closes it when the test ends.
func startDTLS(t *testing.T, listen netip.AddrPort, cert tls.Certificate, steeringDir string, lim connlimit.Limits) *Daemon {
	t.Helper()
	lf, err := logging.New("all:WARN", "text", &testenv.LockedBuffer{})
	if err != nil {
		t.Fatal(err)
	}
	d, err := Start(Config{
		Listeners:    []config.ResolvedListener{{Name: "dtls", Protocol: config.DTLS, Addr: listen, Cert: &cert}},
		Users:        map[string]string{"alice": "a"},
		RelayAddress: netip.MustParseAddr("127.0.0.1"),
		MinRelayPort: 62100, MaxRelayPort: 62199,
		AllowPeers:  []netip.Prefix{netip.MustParsePrefix("127.0.0.1/32")},
		XDPMode:     loader.ModeOff,
		SteeringDir: steeringDir,
		ConnLimits:  lim,
		Logger:      lf,
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	return d
}
