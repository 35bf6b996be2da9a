package userspace

import (
	"net/netip"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/l7mp/stunnerd-xdp/internal/channelmap"
)

// One bucket per allocation for both paths. An allocation's datagrams are
// charged to one budget whichever path relays them: the engines charge the
// packets they relay to the allocation's bucket in the kernel (alloc_rates),
// and pion/turn's relay sockets charge what pion relays to that same bucket,
// through the charge program (KernelBuckets: channelmap.Maps.Charge), so a
// client splitting its traffic between ChannelData (kernel) and Send
// indications (userspace) gets the limit once, not once per path. A relay
// socket holds its allocation's bucket id for as long as it is open, so the
// allocation keeps its bucket whether or not it has a binding installed, and
// its bindings are given the same id.
//
// Without the kernel's buckets (--xdp-mode=off, the program never loaded) a
// relay socket charges a bucket of its own in userspace with the same GCRA,
// over the same clock (CLOCK_MONOTONIC, bpf_ktime_get_ns's): what the model
// (test/model overLimit) says of the kernel's. A socket also falls back
// to it while the kernel cannot give the allocation an id (every id taken:
// more allocations than --max-bindings) and tries again per datagram. What an
// allocation owed in one bucket does not move to the other when it changes
// buckets (the program loaded while the allocation lived, ids ran out): at
// most one burst (channelmap.RateBurst) more goes through at the change.

// KernelBuckets are the engines' rate-limit buckets (channelmap.Maps).
type KernelBuckets interface {
	// HoldAlloc returns the bucket id of the allocation relayed at relay and
	// keeps it until ReleaseAlloc.
	HoldAlloc(relay netip.AddrPort) (uint32, error)
	ReleaseAlloc(relay netip.AddrPort)
	// Charge charges a datagram of dataLen bytes of data to bucket id, or
	// tells that it is over the limit (then charges nothing).
	Charge(id uint32, dataLen int) (over bool, err error)
}

// kernel is one set of KernelBuckets, as SetKernel gave it: a socket holding
// an id in it tells by the pointer whether the set is still the current one.
type kernel struct{ b KernelBuckets }

// RateLimiter is the userspace side of the allocations' rate limit: every
// relay socket (one allocation: the program's unit) charges what pion relays
// through it, to and from every peer, to its allocation's bucket. Over the
// limit, a datagram is dropped whatever --over-limit says: pass only moves the
// decision to userspace.
type RateLimiter struct {
	limit    atomic.Pointer[channelmap.RateLimit]
	kernel   atomic.Pointer[kernel]
	counters *Counters // RateLimited counts the drops
	now      func() uint64
}

// NewRateLimiter returns a limiter with limit r (zero rates: none) that counts
// its drops in counters.
func NewRateLimiter(r channelmap.RateLimit, counters *Counters) *RateLimiter {
	l := &RateLimiter{counters: counters, now: monotonicNow}
	l.Set(r)
	return l
}

// Set changes the limit (the kernel's is set apart: channelmap.Maps.SetRateLimit).
// What allocations owe so far stays in their buckets, as in the kernel's.
func (l *RateLimiter) Set(r channelmap.RateLimit) { l.limit.Store(&r) }

// SetKernel makes relay sockets charge the engines' buckets from their next
// datagram on; nil: their own buckets in userspace.
func (l *RateLimiter) SetKernel(b KernelBuckets) {
	if b == nil {
		l.kernel.Store(nil)
		return
	}
	if k := l.kernel.Load(); k != nil && k.b == b {
		return
	}
	l.kernel.Store(&kernel{b: b})
}

// monotonicNow is CLOCK_MONOTONIC in ns: the engines' clock.
func monotonicNow() uint64 {
	var ts unix.Timespec
	_ = unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts)
	return uint64(ts.Nano())
}

// gcra is an allocation's bucket in userspace: the engines' GCRA (bpf/rate.h,
// test/model overLimit): the instants by which what the allocation
// relayed is paid for at the limit's rates, for packets and for bytes; a
// datagram goes while they are at most channelmap.RateBurst ahead of now.
type gcra struct{ pktTAT, byteTAT uint64 }

// over charges a datagram of n bytes of data at now, or tells that it is over
// the limit (and charges nothing).
func (g *gcra) over(r *channelmap.RateLimit, now uint64, n int) bool {
	burst := uint64(channelmap.RateBurst)
	pkt, bytes := max(g.pktTAT, now), max(g.byteTAT, now)
	var pktCost, byteCost uint64
	if r.PacketsPerSecond > 0 {
		if pkt-now > burst {
			return true
		}
		pktCost = max(uint64(time.Second)/r.PacketsPerSecond, 1)
	}
	if r.BytesPerSecond > 0 {
		if bytes-now > burst {
			return true
		}
		byteCost = uint64(n) * uint64(time.Second) / r.BytesPerSecond
	}
	g.pktTAT, g.byteTAT = pkt+pktCost, bytes+byteCost
	return false
}

// allocBucket is one relay socket's (one allocation's) budget.
type allocBucket struct {
	limiter *RateLimiter
	// relay is the allocation's relayed transport address, as pion reports
	// it (invalid: not known, only the userspace bucket is charged).
	relay netip.AddrPort

	mu     sync.Mutex
	own    gcra    // the userspace bucket
	held   *kernel // the kernel buckets the id is held in (nil: none)
	id     uint32
	closed bool
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
	over := a.overLocked(r, n)
	a.mu.Unlock()
	if over {
		a.limiter.counters.RateLimited.Add(1)
	}
	return !over
}

func (a *allocBucket) overLocked(r *channelmap.RateLimit, n int) bool {
	if k := a.limiter.kernel.Load(); k != nil && !a.closed && a.relay.IsValid() {
		if a.held != k {
			a.releaseLocked()
			if id, err := k.b.HoldAlloc(a.relay); err == nil {
				a.held, a.id = k, id
			}
		}
		if a.held == k {
			if over, err := k.b.Charge(a.id, n); err == nil {
				return over
			}
		}
	}
	return a.own.over(r, a.limiter.now(), n)
}

// release gives the kernel bucket's id back: the socket is closed.
func (a *allocBucket) release() {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.closed = true
	a.releaseLocked()
}

func (a *allocBucket) releaseLocked() {
	if a.held != nil {
		a.held.b.ReleaseAlloc(a.relay)
		a.held = nil
	}
}
