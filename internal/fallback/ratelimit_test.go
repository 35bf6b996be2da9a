package fallback

import (
	"net"
	"testing"
	"time"

	"github.com/l7mp/stunnerd-xdp/internal/channelmap"
)

func listenUDP(t *testing.T) net.PacketConn {
	t.Helper()
	c, err := net.ListenPacket("udp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// TestRelayConnRateLimit: the relay socket's wrapper gives each peer the
// program's budget (at 50 pps a burst of 50 ms: 3 datagrams, as the program's
// GCRA lets through), shared by both directions, and drops what is over it.
func TestRelayConnRateLimit(t *testing.T) {
	limiter := NewRateLimiter(channelmap.RateLimit{PacketsPerSecond: 50})
	counters := &Counters{}
	relay := &relayConn{PacketConn: listenUDP(t), counters: counters, buckets: peerBuckets{limiter: limiter}}
	peerA, peerB := listenUDP(t), listenUDP(t)

	// Two writes to A, then A sends three: one more is within its budget.
	for i := 0; i < 2; i++ {
		if _, err := relay.WriteTo([]byte("to-a"), peerA.LocalAddr()); err != nil {
			t.Fatal(err)
		}
	}
	for i := 0; i < 3; i++ {
		if _, err := peerA.WriteTo([]byte{byte(i)}, relay.LocalAddr()); err != nil {
			t.Fatal(err)
		}
	}
	// B's budget is its own: all three of its writes go.
	for i := 0; i < 3; i++ {
		if _, err := relay.WriteTo([]byte("to-b"), peerB.LocalAddr()); err != nil {
			t.Fatal(err)
		}
	}
	if got := counters.ClientToPeerPackets.Load(); got != 5 {
		t.Fatalf("%d datagrams written to peers, want 5 (2 to A, 3 to B)", got)
	}
	buf := make([]byte, 64)
	_ = relay.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
	n, from, err := relay.ReadFrom(buf)
	if err != nil || n != 1 || buf[0] != 0 || from.String() != peerA.LocalAddr().String() {
		t.Fatalf("first read from A: %d %x from %v, %v; want its first datagram", n, buf[:n], from, err)
	}
	// The other two are over A's budget (its 4th and 5th datagrams): skipped,
	// so the read times out well before A's budget refills (20 ms a datagram).
	_ = relay.SetReadDeadline(time.Now().Add(5 * time.Millisecond))
	if n, _, err := relay.ReadFrom(buf); err == nil {
		t.Fatalf("read %x from A over its limit", buf[:n])
	}
	if got := limiter.Dropped.Load(); got != 2 {
		t.Fatalf("%d datagrams dropped, want 2", got)
	}

	// Off: nothing is dropped.
	limiter.Set(channelmap.RateLimit{})
	for i := 0; i < 10; i++ {
		if _, err := relay.WriteTo([]byte("to-a"), peerA.LocalAddr()); err != nil {
			t.Fatal(err)
		}
	}
	if got := counters.ClientToPeerPackets.Load(); got != 15 {
		t.Fatalf("limit off: %d datagrams written, want 15", got)
	}
}
