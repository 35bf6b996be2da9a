// Package shield is the listener shield on the userspace path. What the
// kernel path drops at a UDP listener before any socket (bpf/relay.c
// listener_shield; test/model rules 12 and 13) the read loops drop here
// before pion/turn parses it: where no program runs (--xdp-mode=off, a
// kernel that refused it, a node label) and for what the program passed.
// Its tests are pion/turn's own, in its order (internal/server
// HandleRequest), so that it drops only what pion/turn would discard
// unanswered, and, with an admission rate, the requests of clients without
// an allocation over their source address's rate.
package shield

import (
	"encoding/binary"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"
)

// Class is what pion/turn makes of a datagram at a listener.
type Class int

const (
	// ChannelData is what proto.IsChannelData takes: the first two bits 01
	// and the length within the datagram. pion/turn hands it to the
	// allocation of (client, listener socket), or discards it.
	ChannelData Class = iota
	// Request is a STUN request pion/turn has a handler for: Binding,
	// Allocate, Refresh, CreatePermission, ChannelBind.
	Request
	// Indication is a Send indication.
	Indication
	// NotTURN is neither ChannelData nor a STUN message whose header decodes
	// (stun.Message.Decode: 20 bytes, the magic cookie, the length within
	// the datagram): discarded.
	NotTURN
	// Unhandled is STUN of a class and method pion/turn has no handler for
	// (a response, an unknown method): discarded.
	Unhandled
)

const (
	stunHeader  = 20
	magicCookie = 0x2112A442
)

// Classify says what pion/turn makes of the datagram b (its attributes are
// not walked: pion/turn discards what it cannot parse).
func Classify(b []byte) Class {
	if len(b) >= 4 && b[0]>>6 == 0b01 && int(binary.BigEndian.Uint16(b[2:])) <= len(b)-4 {
		return ChannelData
	}
	if len(b) < stunHeader || binary.BigEndian.Uint32(b[4:]) != magicCookie ||
		stunHeader+int(binary.BigEndian.Uint16(b[2:])) > len(b) {
		return NotTURN
	}
	// As stun reads the type: the class from bits 4 and 8, the method from
	// the rest below the top two bits.
	t := binary.BigEndian.Uint16(b)
	class := t>>4&1 | t>>7&2
	method := t&0xf | t>>1&0x70 | t>>2&0xf80
	switch {
	case class == 0 && (method == 0x001 || method == 0x003 || method == 0x004 || method == 0x008 || method == 0x009):
		return Request
	case class == 1 && method == 0x006:
		return Indication
	}
	return Unhandled
}

// Reason is why the shield dropped a datagram, as the kernel path counts it.
type Reason int

const (
	NoAllocation    Reason = iota // ChannelData from a client without an allocation
	NotTURNReason                 // Classify's NotTURN
	UnhandledReason               // Classify's Unhandled
	Admission                     // a request over its source address's rate
	reasons
)

// Names are the metric labels of the reasons, the kernel path's.
var Names = [reasons]string{"drop_shield_no_allocation", "drop_shield_not_turn", "drop_shield_stun_unhandled", "drop_shield_admission"}

// Counts count what the shield dropped, by reason.
type Counts [reasons]atomic.Uint64

// Allocations tells whether a client has an allocation on a listener socket
// (internal/allocflows).
type Allocations interface {
	Has(listener, client netip.AddrPort) bool
}

// Shield is the daemon's: one per daemon, shared by its UDP listeners'
// read loops.
type Shield struct {
	allocs Allocations // nil: none known, ChannelData is not tested
	counts *Counts
	admit  *admission // nil: no admission rate
}

// New returns the shield; rate (requests per second, 0: none) and burst are
// the admission of clients without an allocation, per source address.
func New(allocs Allocations, counts *Counts, rate float64, burst int) *Shield {
	s := &Shield{allocs: allocs, counts: counts}
	if rate > 0 {
		cost := time.Duration(float64(time.Second) / rate)
		s.admit = &admission{cost: cost, burst: time.Duration(max(burst-1, 0)) * cost, tats: map[netip.Addr]time.Duration{}}
	}
	return s
}

// Listener is the shield of one listener socket bound to addr.
func (s *Shield) Listener(addr netip.AddrPort) *Listener {
	if s == nil {
		return nil
	}
	return &Listener{s: s, addr: addr}
}

// Listener is a listener socket's shield; nil drops nothing.
type Listener struct {
	s    *Shield
	addr netip.AddrPort
}

// Drop tells whether to drop the datagram b from addr (and counts it).
func (l *Listener) Drop(b []byte, from net.Addr) bool {
	if l == nil {
		return false
	}
	ua, ok := from.(*net.UDPAddr)
	if !ok {
		return false
	}
	client := ua.AddrPort()
	client = netip.AddrPortFrom(client.Addr().Unmap(), client.Port())
	var r Reason
	switch Classify(b) {
	case ChannelData:
		a := l.s.allocs
		if a == nil || a.Has(l.addr, client) {
			return false
		}
		r = NoAllocation
	case Request:
		ad := l.s.admit
		if ad == nil || l.s.allocs != nil && l.s.allocs.Has(l.addr, client) || ad.admitted(client.Addr()) {
			return false
		}
		r = Admission
	case Indication:
		return false
	case NotTURN:
		r = NotTURNReason
	default:
		r = UnhandledReason
	}
	l.s.counts[r].Add(1)
	return true
}

// admission is the GCRA of model rule 13, per source address, on the
// monotonic clock.
type admission struct {
	cost, burst time.Duration
	mu          sync.Mutex
	tats        map[netip.Addr]time.Duration // since start
}

// maxSources bounds the addresses tracked: past it, those that owe nothing
// are forgotten, and if none does, all start afresh (a flood of spoofed
// sources must not grow the map without bound).
const maxSources = 1 << 16

var start = time.Now()

func (a *admission) admitted(src netip.Addr) bool {
	now := time.Since(start)
	a.mu.Lock()
	defer a.mu.Unlock()
	tat, ok := a.tats[src]
	if !ok && len(a.tats) >= maxSources {
		for k, t := range a.tats {
			if t <= now {
				delete(a.tats, k)
			}
		}
		if len(a.tats) >= maxSources {
			clear(a.tats)
		}
	}
	tat = max(tat, now)
	if tat-now > a.burst {
		return false
	}
	a.tats[src] = tat + a.cost
	return true
}
