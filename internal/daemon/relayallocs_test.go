package daemon

import (
	"bytes"
	"net"
	"net/netip"
	"runtime"
	"testing"
	"time"

	"github.com/l7mp/stunnerd-xdp/test/packet"
)

// relayRig is a daemon in userspace (one read loop) with a client bound to
// channel 0x4000 towards a peer. The client and the peer use socket calls
// that allocate nothing, so the process's allocations while it relays are the
// server's: the listener's read, the shortcut or pion/turn's handling, and
// the relay socket's write.
type relayRig struct {
	listen     netip.AddrPort
	conn, peer *net.UDPConn
	data, buf  []byte
}

func newRelayRig(t testing.TB, shortcut bool) *relayRig {
	listen := netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), freePort(t))
	if _, err := startThreadsErr(t, listen, "", 1, func(c *Config) { c.NoShortcut = !shortcut }); err != nil {
		t.Fatal(err)
	}
	r := &relayRig{listen: listen, data: packet.ChannelData(0x4000, make([]byte, 100), nil), buf: make([]byte, 2048)}
	var err error
	if r.peer, err = net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.peer.Close() })
	_ = r.peer.SetReadBuffer(4 << 20)
	if r.conn, err = net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)}); err != nil {
		t.Fatal(err)
	}
	relay, err := allocateOn(t, listen, r.conn)
	if err != nil {
		t.Fatal(err)
	}
	// pion's client binds channel 0x4000 to the first peer it writes to;
	// ChannelData on it reaches the peer once the bind is done.
	probe := packet.ChannelData(0x4000, []byte("probe"), nil)
	for deadline := time.Now().Add(5 * time.Second); ; {
		if time.Now().After(deadline) {
			t.Fatal("channel 0x4000 not bound")
		}
		_, _ = relay.WriteTo([]byte("bind"), r.peer.LocalAddr())
		_, _ = r.conn.WriteToUDPAddrPort(probe, listen)
		_ = r.peer.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
		n, _, err := r.peer.ReadFromUDPAddrPort(r.buf)
		if err == nil && bytes.Equal(r.buf[:n], []byte("probe")) {
			break
		}
	}
	_ = r.peer.SetReadDeadline(time.Time{})
	return r
}

// burst relays 16 datagrams (in flight at once, well inside the socket
// buffers) and returns how many 100-byte ones reached the peer.
func (r *relayRig) burst(t testing.TB) int {
	const burst = 16
	for range burst {
		if _, err := r.conn.WriteToUDPAddrPort(r.data, r.listen); err != nil {
			t.Fatal(err)
		}
	}
	got := 0
	_ = r.peer.SetReadDeadline(time.Now().Add(5 * time.Second))
	for range burst {
		n, _, err := r.peer.ReadFromUDPAddrPort(r.buf)
		if err != nil {
			t.Fatal(err)
		}
		if n == 100 { // else a late probe or bind
			got++
		}
	}
	return got
}

// allocsPerPacket relays bursts times 16 datagrams and returns the process's
// heap allocations and bytes per relayed packet.
func (r *relayRig) allocsPerPacket(t testing.TB, bursts int) (allocs, bytes float64) {
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	packets := 0
	for range bursts {
		packets += r.burst(t)
	}
	runtime.ReadMemStats(&after)
	return float64(after.Mallocs-before.Mallocs) / float64(packets), float64(after.TotalAlloc-before.TotalAlloc) / float64(packets)
}

// TestUserspaceRelayAllocs: the userspace relay path allocates nothing per
// packet with the shortcut; pion/turn's own handling allocates for its debug
// logs (which is what the shortcut saves).
func TestUserspaceRelayAllocs(t *testing.T) {
	for _, shortcut := range []bool{true, false} {
		r := newRelayRig(t, shortcut)
		r.allocsPerPacket(t, 16) // warm: the source caches, the pools
		allocs, _ := r.allocsPerPacket(t, 64)
		t.Logf("shortcut %v: %.3f allocations per relayed packet", shortcut, allocs)
		// A tolerance for the test's own runtime (its timers, the GC): far
		// below one per packet.
		switch {
		case shortcut && allocs > 0.1:
			t.Errorf("with the shortcut: %.2f allocations per relayed packet, want 0", allocs)
		case !shortcut && allocs < 1:
			t.Errorf("pion/turn's own handling: %.2f allocations per relayed packet; if pion no longer allocates, the shortcut's reason is gone", allocs)
		}
	}
}

// BenchmarkUserspaceRelay reports the heap allocations per relayed packet,
// with the shortcut and with pion/turn handling every datagram.
func BenchmarkUserspaceRelay(b *testing.B) {
	for _, c := range []struct {
		name     string
		shortcut bool
	}{{"shortcut", true}, {"pion", false}} {
		b.Run(c.name, func(b *testing.B) {
			r := newRelayRig(b, c.shortcut)
			var before, after runtime.MemStats
			runtime.GC()
			runtime.ReadMemStats(&before)
			packets := 0
			b.ResetTimer()
			for b.Loop() {
				packets += r.burst(b)
			}
			b.StopTimer()
			runtime.ReadMemStats(&after)
			b.ReportMetric(float64(after.Mallocs-before.Mallocs)/float64(packets), "allocs/pkt")
			b.ReportMetric(float64(after.TotalAlloc-before.TotalAlloc)/float64(packets), "B/pkt")
		})
	}
}
