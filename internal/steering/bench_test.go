package steering

import (
	"net"
	"net/netip"
	"testing"
)

// BenchmarkListenerDatagram is the cost the steering adds to a datagram that
// reaches a listener socket (the userspace path): one datagram sent and read
// per iteration over loopback, to a plain socket and to a socket in a steered
// reuseport group of two whose client is an allocation owner. Compare the
// sub-benchmarks of one run: the machine is shared and absolute figures move.
func BenchmarkListenerDatagram(b *testing.B) {
	run := func(b *testing.B, server, client *net.UDPConn) {
		to := addrPort(server.LocalAddr())
		msg, buf := make([]byte, 100), make([]byte, 1500)
		b.ReportAllocs()
		b.ResetTimer()
		for range b.N {
			if _, err := client.WriteToUDPAddrPort(msg, to); err != nil {
				b.Fatal(err)
			}
			if _, _, err := server.ReadFromUDPAddrPort(buf); err != nil {
				b.Fatal(err)
			}
		}
	}
	b.Run("plain", func(b *testing.B) {
		run(b, listenUDP(b, "udp4", "127.0.0.1:0"), listenUDP(b, "udp4", "127.0.0.1:0"))
	})
	b.Run("steered", func(b *testing.B) {
		dir := testDir(b)
		old, nu := mustOpen(b, dir), mustOpen(b, dir)
		a := listenUDP(b, "udp4", "127.0.0.1:0")
		g := Group{Protocol: UDP, Addr: addrPort(a.LocalAddr())}
		slot := register(b, old, a, g)
		register(b, nu, listenUDP(b, "udp4", g.Addr.String()), g)
		c := listenUDP(b, "udp4", "127.0.0.1:0")
		if err := old.AddFlow(g, addrPort(c.LocalAddr()), slot); err != nil {
			b.Fatal(err)
		}
		// Enough other allocations that the flow lookup is not a toy.
		for i := range 10000 {
			other := netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 1, byte(i >> 8), byte(i)}), 4000)
			if err := old.AddFlow(g, other, slot); err != nil {
				b.Fatal(err)
			}
		}
		before := stats(b, old)
		run(b, a, c)
		if st := stats(b, old); st.Owner-before.Owner < uint64(b.N) {
			b.Fatalf("%d owner verdicts for %d datagrams", st.Owner-before.Owner, b.N)
		}
	})
}
