package fallback

import (
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/time/rate"

	"github.com/l7mp/stunnerd-xdp/internal/channelmap"
)

// maxDatagram is the largest UDP payload pion relays: the byte bucket holds one
// on top of its burst, so that a large datagram is never over the limit by
// itself (the program lets any packet go while what it owes is within the
// burst: the same budget, up to one datagram).
const maxDatagram = 65535

// RateLimiter is the userspace twin of the program's rate limit: every relay
// socket keeps a bucket per peer address (a relay socket is an allocation,
// allocation and peer a channel binding: the program's unit), charged by
// datagrams in both directions together, with the same rates and a burst of
// channelmap.RateBurst worth of them. Over the limit, a datagram is dropped
// whatever --over-limit says: pass only moves the decision to userspace.
type RateLimiter struct {
	limit atomic.Pointer[channelmap.RateLimit]
	// Dropped counts the datagrams dropped over the limit.
	Dropped atomic.Uint64
}

// NewRateLimiter returns a limiter with limit r (zero rates: none).
func NewRateLimiter(r channelmap.RateLimit) *RateLimiter {
	l := &RateLimiter{}
	l.Set(r)
	return l
}

// Set changes the limit; buckets start afresh at the new rates.
func (l *RateLimiter) Set(r channelmap.RateLimit) { l.limit.Store(&r) }

// peerBucket is one binding's budget, for the limit it was made under.
type peerBucket struct {
	limit          *channelmap.RateLimit
	packets, bytes *rate.Limiter
}

func newPeerBucket(r *channelmap.RateLimit) *peerBucket {
	b := &peerBucket{limit: r}
	burst := channelmap.RateBurst.Seconds()
	if r.PacketsPerSecond > 0 {
		b.packets = rate.NewLimiter(rate.Limit(r.PacketsPerSecond), int(float64(r.PacketsPerSecond)*burst)+1)
	}
	if r.BytesPerSecond > 0 {
		b.bytes = rate.NewLimiter(rate.Limit(r.BytesPerSecond), int(float64(r.BytesPerSecond)*burst)+maxDatagram)
	}
	return b
}

// allow charges a datagram of n bytes of data, or tells it is over (then
// nothing is charged).
func (b *peerBucket) allow(now time.Time, n int) bool {
	if b.packets != nil && b.bytes != nil {
		// Both or neither: a packet the byte budget refuses must not spend a
		// packet token.
		rp := b.packets.ReserveN(now, 1)
		if !rp.OK() || rp.DelayFrom(now) > 0 {
			rp.CancelAt(now)
			return false
		}
		if !b.bytes.AllowN(now, n) {
			rp.CancelAt(now)
			return false
		}
		return true
	}
	if b.packets != nil {
		return b.packets.AllowN(now, 1)
	}
	return b.bytes == nil || b.bytes.AllowN(now, n)
}

// peerBuckets are one relay socket's buckets, by peer.
type peerBuckets struct {
	limiter *RateLimiter
	mu      sync.Mutex
	peers   map[netip.AddrPort]*peerBucket
}

// allow tells whether a datagram of n bytes to or from peer is within the
// limit, and charges it.
func (p *peerBuckets) allow(peer net.Addr, n int) bool {
	if p == nil || p.limiter == nil {
		return true
	}
	r := p.limiter.limit.Load()
	if r.Off() {
		return true
	}
	ua, ok := peer.(*net.UDPAddr)
	if !ok {
		return true
	}
	key := unmapAddrPort(ua.AddrPort())
	p.mu.Lock()
	defer p.mu.Unlock()
	b := p.peers[key]
	if b == nil || b.limit != r {
		if p.peers == nil {
			p.peers = map[netip.AddrPort]*peerBucket{}
		}
		b = newPeerBucket(r)
		p.peers[key] = b
	}
	if b.allow(time.Now(), n) {
		return true
	}
	p.limiter.Dropped.Add(1)
	return false
}

func unmapAddrPort(a netip.AddrPort) netip.AddrPort {
	return netip.AddrPortFrom(a.Addr().Unmap(), a.Port())
}
