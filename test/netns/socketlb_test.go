package netns_test

import (
	"fmt"
	"net"
	"net/netip"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/l7mp/stunnerd-xdp/test/netns"
	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// socketLBClientEnv makes the test binary a client for TestSocketLB instead of running tests: it
// waits to be moved into a socket-LB cgroup, then sends a datagram to the service address the
// variable holds and prints where the reply came from.
const socketLBClientEnv = "SXDP_SOCKETLB_CLIENT"

func TestMain(m *testing.M) {
	if service := os.Getenv(socketLBClientEnv); service != "" {
		if err := socketLBClient(service); err != nil {
			fmt.Fprintln(os.Stderr, "socket LB client:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

func socketLBClient(service string) error {
	// Sockets are translated by the cgroup they are created in.
	if err := netns.Eventually(10*time.Second, 20*time.Millisecond, func() error {
		b, err := os.ReadFile("/proc/self/cgroup")
		if err != nil || strings.Contains(string(b), "-socketlb") {
			return err
		}
		return fmt.Errorf("not moved to the socket LB cgroup: %s", b)
	}); err != nil {
		return err
	}
	c, err := net.ListenPacket("udp4", ":0")
	if err != nil {
		return err
	}
	defer c.Close()
	to, err := net.ResolveUDPAddr("udp4", service)
	if err != nil {
		return err
	}
	if _, err := c.WriteTo([]byte("ping"), to); err != nil {
		return err
	}
	_ = c.SetReadDeadline(time.Now().Add(testenv.Timeout(5 * time.Second)))
	buf := make([]byte, 64)
	n, from, err := c.ReadFrom(buf)
	if err != nil {
		return err
	}
	fmt.Printf("reply %q from %v\n", buf[:n], from)
	return nil
}

// TestSocketLB: a process whose sockets SocketLB translates reaches the backend through the service
// address and sees the reply come from the service; the backend sees the process's own address,
// and the node's netfilter holds no translation.
func TestSocketLB(t *testing.T) {
	netns.RequirePrivileged(t, "conntrack")
	r := netns.NewRouted(t)
	service := netip.MustParseAddrPort("10.96.0.10:7100")
	backend := netip.MustParseAddrPort(r.PeerIf.Addr.String() + ":7100")
	var conn *net.UDPConn
	if err := r.Peer.Do(func() error {
		var err error
		conn, err = net.ListenUDP("udp4", net.UDPAddrFromAddrPort(backend))
		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	seen := make(chan netip.AddrPort, 1)
	go func() {
		buf := make([]byte, 64)
		n, from, err := conn.ReadFromUDPAddrPort(buf)
		if err != nil {
			return
		}
		seen <- from
		_, _ = conn.WriteToUDPAddrPort(append([]byte("pong:"), buf[:n]...), from)
	}()

	t.Setenv(socketLBClientEnv, service.String())
	p := r.Server.Start(t, os.Args[0])
	netns.SocketLB(t, p.PID(), service, backend)
	if err := p.Wait(15 * time.Second); err != nil {
		t.Fatalf("client: %v\n%s%s", err, p.Stdout(), p.Stderr())
	}
	if want := fmt.Sprintf("reply \"pong:ping\" from %v", service); !strings.Contains(p.Stdout(), want) {
		t.Errorf("client printed %q, want %q", p.Stdout(), want)
	}
	select {
	case from := <-seen:
		if from.Addr() != r.ServerPeerIf.Addr {
			t.Errorf("the backend got the datagram from %v, want the server's %v", from, r.ServerPeerIf.Addr)
		}
	default:
		t.Error("the backend got nothing")
	}
	if out := r.Server.Run(t, "conntrack", "-L", "-p", "udp"); strings.Contains(out, service.Addr().String()) {
		t.Errorf("conntrack shows the service address: the translation must not be netfilter's:\n%s", out)
	}
}
