package daemon

import (
	"bytes"
	"net"
	"net/netip"
	"runtime"
	"testing"
	"time"

	"github.com/l7mp/stunnerd-xdp/internal/packet"
)

// BenchmarkUserspaceRelay relays 100-byte ChannelData from a bound client
// through the daemon (XDP off, one read loop) to a peer and reports the
// process's heap allocations per relayed packet. The client and the peer use
// socket calls that allocate nothing, so what is counted is the server's:
// the listener's read, pion/turn's handling and the relay socket's write.
func BenchmarkUserspaceRelay(b *testing.B) {
	listen := netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), freePort(b))
	startThreads(b, listen, "", 1)
	peer, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		b.Fatal(err)
	}
	defer peer.Close()
	_ = peer.SetReadBuffer(4 << 20)
	conn, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		b.Fatal(err)
	}
	relay, err := allocateOn(b, listen, conn)
	if err != nil {
		b.Fatal(err)
	}
	// pion's client binds channel 0x4000 to the first peer it writes to;
	// ChannelData on it reaches the peer once the bind is done.
	probe := packet.ChannelData(0x4000, []byte("probe"), nil)
	buf := make([]byte, 2048)
	for deadline := time.Now().Add(5 * time.Second); ; {
		if time.Now().After(deadline) {
			b.Fatal("channel 0x4000 not bound")
		}
		_, _ = relay.WriteTo([]byte("bind"), peer.LocalAddr())
		_, _ = conn.WriteToUDPAddrPort(probe, listen)
		_ = peer.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
		n, _, err := peer.ReadFromUDPAddrPort(buf)
		if err == nil && bytes.Equal(buf[:n], []byte("probe")) {
			break
		}
	}
	_ = peer.SetReadDeadline(time.Time{})
	data := packet.ChannelData(0x4000, make([]byte, 100), nil)
	const burst = 16 // in flight at once, well inside the socket buffers
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	packets := 0
	b.ResetTimer()
	for b.Loop() {
		for range burst {
			if _, err := conn.WriteToUDPAddrPort(data, listen); err != nil {
				b.Fatal(err)
			}
		}
		for range burst {
			n, _, err := peer.ReadFromUDPAddrPort(buf)
			if err != nil {
				b.Fatal(err)
			}
			if n != 100 {
				continue // a late probe or bind
			}
			packets++
		}
	}
	b.StopTimer()
	runtime.ReadMemStats(&after)
	b.ReportMetric(float64(after.Mallocs-before.Mallocs)/float64(packets), "allocs/pkt")
	b.ReportMetric(float64(after.TotalAlloc-before.TotalAlloc)/float64(packets), "B/pkt")
}
