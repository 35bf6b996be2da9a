package daemon

import (
	"errors"
	"net"
	"net/netip"
	"strings"
	"syscall"
	"testing"

	"github.com/pion/turn/v4"

	"github.com/l7mp/stunnerd-xdp/internal/config"
	"github.com/l7mp/stunnerd-xdp/internal/loader"
	"github.com/l7mp/stunnerd-xdp/internal/logging"
	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// freePort finds a port on loopback that is free now for both UDP and TCP
// (the tests' listeners take both): an ephemeral one, so the tests' relay
// ranges lie above net.ipv4.ip_local_port_range (32768-60999 by default).
// TCP picks it: a UDP pick may be the source port of another test's TCP
// connection. It can still be taken before the caller binds it (see
// startQuota).
func freePort(t testing.TB) uint16 {
	t.Helper()
	for range 20 {
		l, err := net.Listen("tcp4", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		port := l.Addr().(*net.TCPAddr).Port
		c, err := net.ListenPacket("udp4", netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), uint16(port)).String())
		_ = l.Close()
		if err != nil {
			continue
		}
		_ = c.Close()
		return uint16(port)
	}
	t.Fatal("no port free for both UDP and TCP on 127.0.0.1")
	return 0
}

func startOn(t *testing.T, listen netip.AddrPort, dir string) (*Daemon, *testenv.LockedBuffer, error) {
	t.Helper()
	var logs testenv.LockedBuffer
	lf, err := logging.New("all:INFO", "text", &logs)
	if err != nil {
		t.Fatal(err)
	}
	d, err := Start(Config{
		Listeners: []config.ResolvedListener{
			{Name: "udp", Protocol: config.UDP, Addr: listen},
			{Name: "tcp", Protocol: config.TCP, Addr: listen},
		},
		Users:        map[string]string{"u": "p"},
		RelayAddress: netip.MustParseAddr("127.0.0.1"),
		MinRelayPort: 61000, MaxRelayPort: 61999,
		XDPMode:     loader.ModeOff,
		SteeringDir: dir,
		Logger:      lf,
	})
	if err == nil {
		t.Cleanup(func() { d.Close() })
	}
	return d, &logs, err
}

// TestTwoDaemonsShareThePorts: with the steering a second daemon binds the
// same UDP and TCP listener while the first runs; without it (no bpffs) the
// daemon says so and binds exclusively, and a second one is refused.
func TestTwoDaemonsShareThePorts(t *testing.T) {
	testenv.RequireRoot(t)
	listen := netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), freePort(t))

	pins := testenv.BPFFS(t)
	a, _, err := startOn(t, listen, pins)
	if err != nil {
		t.Fatal(err)
	}
	b, logs, err := startOn(t, listen, pins)
	if err != nil {
		t.Fatalf("second daemon with the steering: %v", err)
	}
	if !strings.Contains(logs.String(), "listener handover on") {
		t.Errorf("no handover log:\n%s", logs.String())
	}
	if st := b.Status(); st.XDP.Steering == nil {
		t.Errorf("status without steering: %+v", st)
	}
	// A new client allocates on the newer daemon.
	for i := range 3 {
		allocate(t, listen)
		if na, nb := a.AllocationCount(), b.AllocationCount(); na != 0 || nb != i+1 {
			t.Fatalf("allocations: first daemon %d, second %d; want 0 and %d", na, nb, i+1)
		}
	}
	b.Close()
	a.Close()

	other := netip.AddrPortFrom(listen.Addr(), freePort(t))
	notBPF := t.TempDir()
	_, logs, err = startOn(t, other, notBPF)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(logs.String(), "no listener handover") || !strings.Contains(logs.String(), "not on a bpf filesystem") {
		t.Errorf("the fallback to exclusive sockets was not logged:\n%s", logs.String())
	}
	if _, _, err := startOn(t, other, notBPF); !errors.Is(err, syscall.EADDRINUSE) {
		t.Errorf("second daemon without the steering: %v, want address already in use", err)
	}
}

// allocate makes a pion/turn allocation from loopback that lives until the
// test ends.
func allocate(t *testing.T, server netip.AddrPort) {
	t.Helper()
	conn, err := net.ListenPacket("udp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := testenv.Allocate(t, &turn.ClientConfig{
		TURNServerAddr: server.String(), STUNServerAddr: server.String(),
		Username: "u", Password: "p", Realm: config.DefaultRealm, Conn: conn,
	}); err != nil {
		t.Fatalf("allocate: %v", err)
	}
}
