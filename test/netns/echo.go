package netns

import (
	"net"
	"net/netip"
	"testing"

	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// ServeUDPEcho answers every UDP datagram to addr inside the namespace with
// the same bytes, from a socket in this process, until the test ends: an
// echo for tests that cannot wait for a udpecho build.
func (n *NS) ServeUDPEcho(t testing.TB, addr netip.AddrPort) {
	t.Helper()
	network := "udp6"
	if addr.Addr().Is4() {
		network = "udp4"
	}
	var conn *net.UDPConn
	if err := n.Do(func() (err error) {
		conn, err = net.ListenUDP(network, net.UDPAddrFromAddrPort(addr))
		return err
	}); err != nil {
		t.Fatalf("netns %s: echo on %v: %v", n.Name, addr, err)
	}
	// Room for bursts: the benchmark's latency probes share it with load.
	testenv.ReadBuffer(t, conn, 4<<20)
	done := make(chan struct{})
	t.Cleanup(func() { conn.Close(); <-done })
	go func() {
		defer close(done)
		buf := make([]byte, 64<<10)
		for {
			size, from, err := conn.ReadFromUDPAddrPort(buf)
			if err != nil {
				return
			}
			_, _ = conn.WriteToUDPAddrPort(buf[:size], from)
		}
	}()
}
