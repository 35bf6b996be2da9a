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

// TestRelayConnRateLimit: a relay socket (an allocation) has the program's
// budget (at 50 pps a burst of 50 ms: 3 datagrams, as the program's GCRA lets
// through), shared by both directions and every peer; what is over it is
// dropped; another allocation's socket has its own.
func TestRelayConnRateLimit(t *testing.T) {
	counters := &Counters{}
	limiter := NewRateLimiter(channelmap.RateLimit{PacketsPerSecond: 50}, counters)
	relay := &relayConn{PacketConn: listenUDP(t), counters: counters, budget: allocBucket{limiter: limiter}}
	other := &relayConn{PacketConn: listenUDP(t), counters: counters, budget: allocBucket{limiter: limiter}}
	peerA, peerB := listenUDP(t), listenUDP(t)
	write := func(c *relayConn, to net.PacketConn, n int) {
		t.Helper()
		for i := 0; i < n; i++ {
			if _, err := c.WriteTo([]byte("data"), to.LocalAddr()); err != nil {
				t.Fatal(err)
			}
		}
	}

	// One write to A and one to B, then A sends three: one more is within
	// the allocation's budget.
	write(relay, peerA, 1)
	write(relay, peerB, 1)
	for i := 0; i < 3; i++ {
		if _, err := peerA.WriteTo([]byte{byte(i)}, relay.LocalAddr()); err != nil {
			t.Fatal(err)
		}
	}
	// Another allocation's budget is its own: all three of its writes go.
	write(other, peerB, 3)
	if got := counters.ClientToPeerPackets.Load(); got != 5 {
		t.Fatalf("%d datagrams written to peers, want 5 (1 to A, 1 to B, 3 from the other allocation)", got)
	}
	buf := make([]byte, 64)
	_ = relay.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
	n, from, err := relay.ReadFrom(buf)
	if err != nil || n != 1 || buf[0] != 0 || from.String() != peerA.LocalAddr().String() {
		t.Fatalf("first read from A: %d %x from %v, %v; want its first datagram", n, buf[:n], from, err)
	}
	// The other two are over the budget (the allocation's 4th and 5th
	// datagrams): skipped, so the read times out well before the budget
	// refills (20 ms a datagram).
	_ = relay.SetReadDeadline(time.Now().Add(5 * time.Millisecond))
	if n, _, err := relay.ReadFrom(buf); err == nil {
		t.Fatalf("read %x from A over the limit", buf[:n])
	}
	write(relay, peerB, 1)
	if got, dropped := counters.ClientToPeerPackets.Load(), counters.RateLimited.Load(); got != 5 || dropped != 3 {
		t.Fatalf("%d written, %d dropped; want 5 and 3 (B's second write is over the shared budget)", got, dropped)
	}

	// Off: nothing is dropped.
	limiter.Set(channelmap.RateLimit{})
	write(relay, peerA, 10)
	if got := counters.ClientToPeerPackets.Load(); got != 15 {
		t.Fatalf("limit off: %d datagrams written, want 15", got)
	}
}
