package userspace

import (
	"errors"
	"math/rand/v2"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/l7mp/stunnerd-xdp/internal/channelmap"
	"github.com/l7mp/stunnerd-xdp/test/model"
)

// permit gives c's allocation a permission for peer, as pion's event does.
func permit(c *relayConn, peer net.PacketConn) {
	ip := peer.LocalAddr().(*net.UDPAddr).IP
	c.peers.change(func(p *peerSet) { p.perms[netip.AddrFrom4([4]byte(ip.To4()))] = struct{}{} })
}

func listenUDP(t testing.TB) net.PacketConn {
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
	permit(relay, peerA)
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

// TestRateLimitGCRA: without the kernel's buckets a relay socket charges its
// own with the engines' GCRA: random limits, lengths and clock steps give the
// model's verdicts and debts (test/model Charge, the spec of the kernel's
// buckets), limit changes keeping what is owed.
func TestRateLimitGCRA(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	relay := netip.MustParseAddrPort("10.0.0.1:50000")
	m, err := model.New(model.Env{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	now := uint64(1e12)
	m.Now = func() uint64 { return now }
	var g gcra
	limits := []channelmap.RateLimit{{PacketsPerSecond: 5}, {PacketsPerSecond: 50}, {PacketsPerSecond: 3000},
		{BytesPerSecond: 1000}, {BytesPerSecond: 1 << 20}, {PacketsPerSecond: 50, BytesPerSecond: 20000}, {PacketsPerSecond: 3e9}}
	var r channelmap.RateLimit
	for i := 0; i < 20000; i++ {
		if i%500 == 0 {
			r = limits[rng.IntN(len(limits))]
			m.SetEnv(model.Env{RateLimit: r})
		}
		now += uint64(rng.Int64N(int64(30 * time.Millisecond)))
		n := rng.IntN(1500)
		over, want := g.over(&r, now, n), m.Charge(relay, n)
		st := m.RateState(relay)
		if over != want || g.pktTAT != st.PacketTAT || g.byteTAT != st.ByteTAT {
			t.Fatalf("step %d, %+v, %d bytes: over %v owing %+v; the model: over %v owing %+v", i, r, n, over, g, want, st)
		}
	}
}

// TestRateLimitPermittedOnly: what a relay socket reads is charged only when
// pion relays it (a peer with a permission for its IP, or a channel to its
// exact address): a stranger's datagrams go to pion (which drops them)
// without spending the allocation's budget.
func TestRateLimitPermittedOnly(t *testing.T) {
	counters := &Counters{}
	limiter := NewRateLimiter(channelmap.RateLimit{PacketsPerSecond: 5}, counters)
	relay := &relayConn{PacketConn: listenUDP(t), counters: counters, budget: allocBucket{limiter: limiter}}
	peer, stranger, channelPeer := listenUDP(t), listenUDP(t), listenUDP(t)
	buf := make([]byte, 64)
	read := func(from net.PacketConn) bool {
		t.Helper()
		_ = relay.SetReadDeadline(time.Now().Add(100 * time.Millisecond))
		n, src, err := relay.ReadFrom(buf)
		if err != nil {
			return false
		}
		if src.String() != from.LocalAddr().String() {
			t.Fatalf("read %x from %v, want from %v", buf[:n], src, from.LocalAddr())
		}
		return true
	}
	send := func(from net.PacketConn) {
		t.Helper()
		if _, err := from.WriteTo([]byte("x"), relay.LocalAddr()); err != nil {
			t.Fatal(err)
		}
	}
	// Every socket here is on 127.0.0.1, and a permission is for an IP: the
	// peer gets a channel (its exact address), the stranger has neither.
	relay.peers.change(func(p *peerSet) {
		p.perms = map[netip.Addr]struct{}{}
		p.chans = map[netip.AddrPort]uint16{netip.MustParseAddrPort(peer.LocalAddr().String()): 0x4000}
	})
	for i := 0; i < 20; i++ {
		send(stranger)
		if !read(stranger) {
			t.Fatalf("the stranger's datagram %d did not reach pion", i)
		}
	}
	if got := counters.RateLimited.Load(); got != 0 {
		t.Fatalf("%d of the stranger's datagrams over the limit: they were charged", got)
	}
	send(peer)
	if !read(peer) {
		t.Fatal("the bound peer's first datagram was dropped after the stranger's")
	}
	// 5 pps: the next one is over (charged: the channel's exact address).
	send(peer)
	if read(peer) {
		t.Fatal("the bound peer's second datagram at once was within 5 pps")
	}
	// A channel is to one address: another port of the same IP is a stranger
	// without a permission for the IP.
	relay.peers.change(func(p *peerSet) {
		p.chans = map[netip.AddrPort]uint16{netip.MustParseAddrPort(channelPeer.LocalAddr().String()): 0x4000}
	})
	send(peer)
	if !read(peer) || counters.RateLimited.Load() != 1 {
		t.Fatalf("a peer without a channel or permission: not handed to pion uncharged (%d over)", counters.RateLimited.Load())
	}
}

// fakeKernel is KernelBuckets over the model's GCRA, counting what it is
// asked.
type fakeKernel struct {
	m        *model.Model
	holdErr  error
	held     map[netip.AddrPort]int
	charges  int
	released []netip.AddrPort
}

func (k *fakeKernel) HoldAlloc(relay netip.AddrPort) (uint32, error) {
	if k.holdErr != nil {
		return 0, k.holdErr
	}
	k.held[relay]++
	return 7, nil
}

func (k *fakeKernel) ReleaseAlloc(relay netip.AddrPort) {
	k.released = append(k.released, relay)
}

func (k *fakeKernel) Charge(id uint32, n int) (bool, error) {
	if id != 7 {
		return false, errors.New("not the held id")
	}
	k.charges++
	return k.m.Charge(netip.MustParseAddrPort("10.0.0.1:50000"), n), nil
}

// TestRateLimitKernelBuckets: with the kernel's buckets a relay socket holds
// its allocation's id once and charges every datagram there (its own bucket
// untouched); it falls back to its own bucket while no id can be had and
// tries again; a new set of buckets takes the place of the old (released);
// Close releases the id.
func TestRateLimitKernelBuckets(t *testing.T) {
	counters := &Counters{}
	limiter := NewRateLimiter(channelmap.RateLimit{PacketsPerSecond: 5}, counters)
	mm, err := model.New(model.Env{RateLimit: channelmap.RateLimit{PacketsPerSecond: 5}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	k := &fakeKernel{m: mm, held: map[netip.AddrPort]int{}, holdErr: channelmap.ErrFull}
	limiter.SetKernel(k)
	relayAddr := &net.UDPAddr{IP: net.IPv4(10, 0, 0, 1), Port: 50000}
	relay := newRelayConn(listenUDP(t), relayAddr, counters, limiter)
	peer := listenUDP(t)

	// No id: the socket's own bucket (5 pps: one goes, the next is over).
	if !relay.budget.allow(10) || relay.budget.allow(10) {
		t.Fatal("without an id: not the socket's own 5 pps")
	}
	if k.charges != 0 {
		t.Fatalf("charged the kernel %d times without an id", k.charges)
	}
	// An id: the kernel's bucket (empty: one goes, the next is over); the
	// socket's own is not charged.
	k.holdErr = nil
	own := relay.budget.own
	if !relay.budget.allow(10) || relay.budget.allow(10) {
		t.Fatal("with an id: not the kernel bucket's 5 pps")
	}
	if k.charges != 2 || k.held[netip.MustParseAddrPort("10.0.0.1:50000")] != 1 || relay.budget.own != own {
		t.Fatalf("with an id: %d kernel charges, held %v, own bucket %+v (was %+v); want 2, once, untouched", k.charges, k.held, relay.budget.own, own)
	}
	// New buckets (the program loaded again): the old id is released.
	k2 := &fakeKernel{m: mm, held: map[netip.AddrPort]int{}}
	limiter.SetKernel(k2)
	relay.budget.allow(10)
	if len(k.released) != 1 || k2.held[netip.MustParseAddrPort("10.0.0.1:50000")] != 1 {
		t.Fatalf("new buckets: released %v from the old, held %v in the new", k.released, k2.held)
	}
	// Writes to a peer are charged there too; Close lets go.
	before := k2.charges
	if _, err := relay.WriteTo([]byte("x"), peer.LocalAddr()); err != nil {
		t.Fatal(err)
	}
	if k2.charges != before+1 {
		t.Fatal("a write to a peer was not charged to the kernel's bucket")
	}
	relay.Close()
	if len(k2.released) != 1 {
		t.Fatalf("Close released %v", k2.released)
	}
	// Limit off: nothing is charged anywhere.
	limiter.Set(channelmap.RateLimit{})
	if !relay.budget.allow(10) || k2.charges != before+1 {
		t.Fatal("limit off: charged")
	}
}
