package fallback

import (
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
// socket (one allocation: the program's unit) keeps one bucket, charged by the
// datagrams it sends to and reads from every peer, with the same rates and a
// burst of channelmap.RateBurst worth of them. Over the limit, a datagram is dropped
// whatever --over-limit says: pass only moves the decision to userspace.
type RateLimiter struct {
	limit    atomic.Pointer[channelmap.RateLimit]
	counters *Counters // RateLimited counts the drops
}

// NewRateLimiter returns a limiter with limit r (zero rates: none) that counts
// its drops in counters.
func NewRateLimiter(r channelmap.RateLimit, counters *Counters) *RateLimiter {
	l := &RateLimiter{counters: counters}
	l.Set(r)
	return l
}

// Set changes the limit; buckets start afresh at the new rates.
func (l *RateLimiter) Set(r channelmap.RateLimit) { l.limit.Store(&r) }

// bucket is one allocation's budget, for the limit it was made under.
type bucket struct {
	limit          *channelmap.RateLimit
	packets, bytes *rate.Limiter
}

func newBucket(r *channelmap.RateLimit) *bucket {
	b := &bucket{limit: r}
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
func (b *bucket) allow(now time.Time, n int) bool {
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

// allocBucket is one relay socket's (one allocation's) budget.
type allocBucket struct {
	limiter *RateLimiter
	mu      sync.Mutex
	bucket  *bucket
}

// allow tells whether a datagram of n bytes to or from a peer is within the
// allocation's limit, and charges it.
func (a *allocBucket) allow(n int) bool {
	if a.limiter == nil {
		return true
	}
	r := a.limiter.limit.Load()
	if r.Off() {
		return true
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.bucket == nil || a.bucket.limit != r {
		a.bucket = newBucket(r)
	}
	if a.bucket.allow(time.Now(), n) {
		return true
	}
	a.limiter.counters.RateLimited.Add(1)
	return false
}
