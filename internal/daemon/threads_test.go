package daemon

import (
	"bytes"
	"net"
	"net/netip"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/pion/turn/v4"

	"github.com/l7mp/stunnerd-xdp/internal/config"
	"github.com/l7mp/stunnerd-xdp/internal/loader"
	"github.com/l7mp/stunnerd-xdp/internal/logging"
	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// TestUDPReadLoops: a UDP listener with several read loops (one SO_REUSEPORT
// socket and pion/turn server each) serves every client whichever socket its
// packets land on, relays both ways, spreads the clients over the sockets,
// and, without the steering, still keeps a second daemon off the port.
func TestUDPReadLoops(t *testing.T) {
	for _, steered := range []bool{false, true} {
		name := "exclusive"
		if steered {
			name = "steered"
		}
		t.Run(name, func(t *testing.T) {
			dir := ""
			if steered {
				testenv.RequireRoot(t)
				dir = testenv.BPFFS(t)
			}
			listen := netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), freePort(t))
			d := startThreads(t, listen, dir, 4)
			if n := len(d.listeners.Allocations()["udp"]); n != 4 {
				t.Fatalf("%d pion/turn servers on the UDP listener, want 4", n)
			}
			peer, err := net.ListenPacket("udp4", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			defer peer.Close()
			const clients = 16
			for i := range clients {
				relayThrough(t, listen, peer, byte(i))
			}
			if n := d.AllocationCount(); n != clients {
				t.Errorf("%d allocations, want %d", n, clients)
			}
			used := 0
			for _, n := range d.listeners.Allocations()["udp"] {
				if n > 0 {
					used++
				}
			}
			if used < 2 {
				t.Errorf("%d clients all on one of 4 sockets", clients)
			}
			_, err = startThreadsErr(t, listen, dir, 4)
			switch {
			case steered && err != nil:
				t.Errorf("a second daemon with the steering: %v", err)
			case !steered && (err == nil || !strings.Contains(err.Error(), syscall.EADDRINUSE.Error())):
				t.Errorf("a second daemon without the steering: %v, want address already in use", err)
			}
		})
	}
}

func startThreads(t testing.TB, listen netip.AddrPort, dir string, threads int) *Daemon {
	t.Helper()
	d, err := startThreadsErr(t, listen, dir, threads)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// startThreadsErr starts a daemon in userspace on listen with threads read
// loops; each of mods changes its config first.
func startThreadsErr(t testing.TB, listen netip.AddrPort, dir string, threads int, mods ...func(*Config)) (*Daemon, error) {
	t.Helper()
	lf, err := logging.New("all:WARN", "text", &testenv.LockedBuffer{})
	if err != nil {
		t.Fatal(err)
	}
	cfg := Config{
		Listeners:    []config.ResolvedListener{{Name: "udp", Protocol: config.UDP, Addr: listen}},
		Users:        map[string]string{"u": "p"},
		RelayAddress: netip.MustParseAddr("127.0.0.1"),
		MinRelayPort: 61000, MaxRelayPort: 61999,
		XDPMode:      loader.ModeOff,
		SteeringDir:  dir,
		UDPThreadNum: threads,
		AllowPeers:   []netip.Prefix{netip.MustParsePrefix("127.0.0.1/32")}, // the test's peer (an own address: admitted only by a /32)
		MetricsAddr:  "", HealthAddr: "",
		Logger: lf,
	}
	for _, m := range mods {
		m(&cfg)
	}
	d, err := Start(cfg)
	if err == nil {
		t.Cleanup(func() { d.Close() })
	}
	return d, err
}

// relayThrough allocates from a new client socket, sends a datagram to the
// peer through the relay and one back, and checks both arrive.
func relayThrough(t testing.TB, server netip.AddrPort, peer net.PacketConn, tag byte) {
	t.Helper()
	conn, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	relay, err := allocateOn(t, server, conn)
	if err != nil {
		t.Fatalf("client %d: allocate: %v", tag, err)
	}
	want := []byte{'c', tag}
	buf := make([]byte, 64)
	// The first write also creates the permission; repeat until the peer
	// hears it.
	var from net.Addr
	for deadline := time.Now().Add(3 * time.Second); from == nil; {
		if time.Now().After(deadline) {
			t.Fatalf("client %d: nothing reached the peer", tag)
		}
		if _, err := relay.WriteTo(want, peer.LocalAddr()); err != nil {
			t.Fatal(err)
		}
		_ = peer.SetReadDeadline(time.Now().Add(100 * time.Millisecond))
		for {
			n, a, err := peer.ReadFrom(buf)
			if err != nil {
				break
			}
			if bytes.Equal(buf[:n], want) {
				from = a
				break
			}
		}
	}
	if _, err := peer.WriteTo([]byte{'p', tag}, from); err != nil {
		t.Fatal(err)
	}
	_ = relay.SetReadDeadline(time.Now().Add(2 * time.Second))
	n, _, err := relay.ReadFrom(buf)
	if err != nil || !bytes.Equal(buf[:n], []byte{'p', tag}) {
		t.Fatalf("client %d: the peer's reply: %q, %v", tag, buf[:n], err)
	}
}

// allocateOn allocates with pion/turn's client on conn as user u.
func allocateOn(t testing.TB, server netip.AddrPort, conn *net.UDPConn) (net.PacketConn, error) {
	return testenv.Allocate(t, &turn.ClientConfig{
		TURNServerAddr: server.String(), STUNServerAddr: server.String(),
		Username: "u", Password: "p", Realm: config.DefaultRealm, Conn: conn,
	})
}
