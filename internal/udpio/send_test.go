package udpio

import (
	"bytes"
	"net"
	"testing"
	"time"
)

// TestWriteTo: Conn and BatchConn deliver what the socket's own WriteTo
// would, to IPv4, IPv6 and IPv4-mapped destinations, fail where it fails, and
// allocate nothing per datagram.
func TestWriteTo(t *testing.T) {
	for _, tc := range []struct{ name, network, local, peerNet, peer string }{
		{"ipv4", "udp4", "127.0.0.1:0", "udp4", "127.0.0.1:0"},
		{"ipv6", "udp6", "[::1]:0", "udp6", "[::1]:0"},
		{"ipv4 from dual stack", "udp", "[::]:0", "udp4", "127.0.0.1:0"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			wc, err := NewConn(listen(t, tc.network, tc.local))
			if err != nil {
				t.Fatal(err)
			}
			bc := batch(t, listen(t, tc.network, tc.local))
			for _, w := range []net.PacketConn{wc, bc} {
				peer := listen(t, tc.peerNet, tc.peer)
				to := peer.LocalAddr().(*net.UDPAddr)
				if tc.name == "ipv4 from dual stack" {
					to = &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1), Port: to.Port} // 16-byte IPv4-mapped
				}
				p := []byte("relayed " + tc.name)
				if n, err := w.WriteTo(p, to); err != nil || n != len(p) {
					t.Fatalf("%T: %d, %v", w, n, err)
				}
				buf := make([]byte, 64)
				_ = peer.SetReadDeadline(time.Now().Add(2 * time.Second))
				n, from, err := peer.ReadFromUDP(buf)
				if err != nil || !bytes.Equal(buf[:n], p) {
					t.Fatalf("%T: the peer read %q, %v", w, buf[:n], err)
				}
				if from.Port != w.LocalAddr().(*net.UDPAddr).Port {
					t.Errorf("%T: from port %d, the socket's is %d", w, from.Port, w.LocalAddr().(*net.UDPAddr).Port)
				}
				if a := testing.AllocsPerRun(100, func() { _, _ = w.WriteTo(p, to) }); a != 0 {
					t.Errorf("%T: %.1f allocations per datagram", w, a)
				}
			}
		})
	}
	// Where Go's WriteTo fails, so does the raw one, with the same kind of error.
	wc, err := NewConn(listen(t, "udp4", "127.0.0.1:0"))
	if err != nil {
		t.Fatal(err)
	}
	v6 := &net.UDPAddr{IP: net.IPv6loopback, Port: 9}
	_, werr := wc.WriteTo([]byte("x"), v6)
	_, gerr := wc.UDPConn.WriteTo([]byte("x"), v6)
	if werr == nil || gerr == nil {
		t.Errorf("IPv6 destination on an IPv4 socket: %v, Go's: %v", werr, gerr)
	}
	unreachable := &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 0}
	_, werr = wc.WriteTo([]byte("x"), unreachable)
	_, gerr = wc.UDPConn.WriteTo([]byte("x"), unreachable)
	if (werr == nil) != (gerr == nil) {
		t.Errorf("port 0: %v, Go's: %v", werr, gerr)
	}
}
