package mirror

import (
	"log/slog"
	"net/netip"
	"slices"
	"sync/atomic"
	"time"

	"github.com/l7mp/stunnerd-xdp/internal/channelmap"
	"github.com/l7mp/stunnerd-xdp/internal/natcheck"
	"github.com/l7mp/stunnerd-xdp/internal/policywatch"
)

// NATChecker tells whether the kernel translates a relay<->peer flow
// (natcheck.Checker).
type NATChecker interface {
	Check(relay, peer netip.AddrPort) (natcheck.Result, error)
}

// ClientChecker tells whether a client's conntrack entry leads to the
// listener (natcheck.Checker). A NATChecker that is one is asked before a
// binding whose client's entry was removed is offloaded again.
type ClientChecker interface {
	CheckClient(client, wire, listener netip.AddrPort) (natcheck.ClientVerdict, error)
}

// Reasons a binding pion/turn holds stays on the userspace path, the label of
// stunnerd_xdp_bindings_userspace.
const (
	// ReasonNAT: the kernel NATs the relay<->peer flow (a ClusterIP peer
	// DNATed by kube-proxy, a masquerade rule), which XDP would skip.
	ReasonNAT = "nat"
	// ReasonNoOffloadPeer: the peer is in a --no-offload-peer or Service CIDR.
	ReasonNoOffloadPeer = "no_offload_peer"
	// ReasonPending: no conntrack evidence yet; pion relays the flow (which
	// creates the evidence) and the mirror asks again every RecheckInterval.
	ReasonPending = "pending"
	// ReasonFull: the XDP maps are full (--max-bindings).
	ReasonFull = "full"
	// ReasonXfrm: an xfrm policy would block or encrypt the relay<->peer or
	// the client<->listener flow (policywatch.Policies.Refuses).
	ReasonXfrm = "xfrm"
	// ReasonClientConntrack: the client's conntrack entry was removed and
	// no new one leads to the listener yet: the client's packets meet the
	// rules afresh (a DNAT may send them to another node).
	ReasonClientConntrack = "client_conntrack"
	// The reasons of every binding while no program carries any (the mirror
	// has no offload; see offload.Manager.Unavailable):
	// ReasonOff: the XDP mode is off (flag, config, node label, a hand-over).
	ReasonOff = "off"
	// ReasonRefused: the kernel refused the program (its verifier, a helper
	// or attach type it lacks).
	ReasonRefused = "program_refused"
	// ReasonNoKernelPath: XDP is wanted but attached nowhere (the load
	// failed, no interface took the program yet).
	ReasonNoKernelPath = "no_kernel_path"
)

// UserspaceReasons lists every reason, so that a gauge exports all of them.
var UserspaceReasons = []string{ReasonNAT, ReasonNoOffloadPeer, ReasonPending, ReasonFull, ReasonXfrm,
	ReasonClientConntrack, ReasonOff, ReasonRefused, ReasonNoKernelPath}

// Reasons an offloaded binding left the kernel's maps while pion/turn kept
// it, the label of stunnerd_xdp_bindings_evicted_total.
const (
	// EvictConntrackDeleted: the conntrack entry of its relay<->peer or
	// client<->listener flow was deleted through netlink (conntrack -D or
	// -F, kube-proxy, a CNI).
	EvictConntrackDeleted = "conntrack_deleted"
	// EvictConntrackExpired: the kernel removed the entry itself (its
	// timeout ran out, an early drop, a NAT clean-up).
	EvictConntrackExpired = "conntrack_expired"
	// EvictConntrackMissing: the entry was found missing when the mirror
	// looked after conntrack notifications were lost.
	EvictConntrackMissing = "conntrack_missing"
	// EvictXfrm: an xfrm policy that blocks or encrypts the flow appeared.
	EvictXfrm = "xfrm"
)

// EvictReasons lists every eviction reason.
var EvictReasons = []string{EvictConntrackDeleted, EvictConntrackExpired, EvictConntrackMissing, EvictXfrm}

// RecheckInterval is how often pending bindings are checked again, and
// RecheckBudget how many of them at most per tick: a burst of new bindings
// is worked off over a few ticks instead of holding the mirror's lock. A
// binding that stays pending (no traffic yet, or a NOTRACK flow) is checked
// ever less often, down to every MaxRecheckBackoff, so that idle bindings do
// not cost a steady stream of netlink requests.
const (
	RecheckInterval   = 250 * time.Millisecond
	RecheckBudget     = 256
	MaxRecheckBackoff = 4 * time.Second
)

type gateState uint8

const (
	gateDirect gateState = iota + 1
	gateNAT
	gateNoOffload
	gatePending
	// gateTranslated: the node source-NATs the flow (natcheck.Translated):
	// offloaded from the translated relay, and checked again every
	// RecheckInterval (see revalidate).
	gateTranslated
	// gateXfrm: an xfrm policy would block or encrypt one of its flows.
	gateXfrm
	// gateClientGone: the client's conntrack entry was removed; checked
	// again (as pending) until a new one leads to the listener.
	gateClientGone
)

func (s gateState) String() string {
	switch s {
	case gateDirect:
		return "direct"
	case gateNAT:
		return "nat"
	case gateNoOffload:
		return "no_offload_peer"
	case gatePending:
		return "pending"
	case gateTranslated:
		return "translated"
	case gateXfrm:
		return "xfrm"
	case gateClientGone:
		return "client_conntrack"
	}
	return "none"
}

// offloadable tells the states whose bindings go to the kernel path.
func (s gateState) offloadable() bool { return s == gateDirect || s == gateTranslated }

// gateEntry is the verdict for one binding pion holds with a permission.
type gateEntry struct {
	relay, peer netip.AddrPort
	wire        netip.AddrPort // gateTranslated: the relay as the peer sees it
	state       gateState
	gen         uint64 // tells a queued recheck of this entry from one of a predecessor
	backoff     time.Duration
	due         time.Time // pending: when to check again
	full        bool      // offloadable, but Upsert said channelmap.ErrFull
	// clientWire is where the client's removed entry sent its packets
	// (gateClientGone): the new one is looked up there.
	clientWire netip.AddrPort
}

type queuedCheck struct {
	key channelmap.Key
	gen uint64
}

// gate decides which bindings may be offloaded. It is owned by the mirror's
// worker (under Mirror.smu).
type gate struct {
	log       *slog.Logger
	now       func() time.Time
	checker   NATChecker // nil: nothing is checked, every flow is direct
	noOffload []netip.Prefix
	xfrm      policywatch.Policies

	entries map[channelmap.Key]*gateEntry
	queue   []queuedCheck // pending entries, checked round robin
	// translated are the entries offloaded with a translation, checked
	// again round robin: the kernel keeps a NAT mapping only while its
	// conntrack entry lives, and the next one may map the relay elsewhere.
	translated []queuedCheck
	gen        uint64

	loggedNAT map[netip.AddrPort]bool // peers logged as NATed

	full      int           // entries with full set
	fullTotal atomic.Uint64 // entries that ever got full set (read by Stats)

	checkErrs    uint64
	lastCheckErr time.Time
}

// maxLoggedNAT bounds the memory spent on "logged once per peer"; past it the
// set starts over and a peer may be logged again.
const maxLoggedNAT = 4096

func newGate(log *slog.Logger) *gate {
	return &gate{log: log, now: time.Now, entries: map[channelmap.Key]*gateEntry{}, loggedNAT: map[netip.AddrPort]bool{}}
}

// admit reports whether binding b may be offloaded, and returns it as it is
// to be installed (with the relay on the wire when the node translates it),
// deciding (and caching) its verdict when b is new or its relay or peer
// changed.
func (g *gate) admit(b channelmap.Binding) (channelmap.Binding, bool) {
	k := b.Key()
	e := g.entries[k]
	if e == nil || e.relay != b.Relay || e.peer != b.Peer {
		g.forget(k)
		g.gen++
		e = &gateEntry{relay: b.Relay, peer: b.Peer, gen: g.gen}
		g.entries[k] = e
		g.classify(k, e)
	}
	b.Wire = netip.AddrPort{}
	if e.state == gateTranslated {
		b.Wire = e.wire
	}
	return b, e.state.offloadable()
}

// classify sets a fresh entry's state; a pending entry joins the queue, a
// translated one the revalidation.
func (g *gate) classify(k channelmap.Key, e *gateEntry) {
	if g.noOffloadPeer(e.peer.Addr()) {
		e.state = gateNoOffload
		return
	}
	if _, ok := g.xfrmRefuses(k, e); ok {
		e.state = gateXfrm
		return
	}
	g.setState(k, e, g.check(e))
}

// xfrmRefuses returns the xfrm policy that would block or encrypt one of
// the binding's flows: relay (and the relay on the wire, once known)
// <-> peer, listener <-> client.
func (g *gate) xfrmRefuses(k channelmap.Key, e *gateEntry) (policywatch.Policy, bool) {
	if len(g.xfrm) == 0 {
		return policywatch.Policy{}, false
	}
	if p, ok := g.xfrm.Refuses(e.relay, e.peer); ok {
		return p, true
	}
	if e.wire.IsValid() && e.wire != e.relay {
		if p, ok := g.xfrm.Refuses(e.wire, e.peer); ok {
			return p, true
		}
	}
	return g.xfrm.Refuses(k.Listener, k.Client)
}

// setState moves e to state s and into the queue that follows s.
func (g *gate) setState(k channelmap.Key, e *gateEntry, s gateState) {
	if _, ok := g.xfrmRefuses(k, e); ok && s.offloadable() {
		s = gateXfrm // a policy refuses the relay on the wire the check found
	}
	e.state = s
	switch s {
	case gatePending:
		g.queue = append(g.queue, queuedCheck{key: k, gen: e.gen})
	case gateTranslated:
		g.translated = append(g.translated, queuedCheck{key: k, gen: e.gen})
	}
}

func (g *gate) check(e *gateEntry) gateState {
	if g.checker == nil {
		return gateDirect
	}
	r, err := g.checker.Check(e.relay, e.peer)
	if err != nil {
		g.checkFailed("cannot tell whether the kernel NATs a peer; its bindings stay in userspace until it can",
			"relay", e.relay.String(), "peer", e.peer.String(), "error", err)
		return g.pending(e)
	}
	switch r.Verdict {
	case natcheck.Direct:
		return gateDirect
	case natcheck.Translated:
		if e.wire != r.Wire {
			g.log.Debug("the kernel source-NATs this flow: offloaded from the translated relay",
				"peer", e.peer.String(), "relay", e.relay.String(), "on the wire", r.Wire.String(), "evidence", r.Why)
		}
		e.wire = r.Wire
		e.backoff = 0
		return gateTranslated
	case natcheck.NATed:
		if !g.loggedNAT[e.peer] {
			if len(g.loggedNAT) >= maxLoggedNAT {
				clear(g.loggedNAT)
			}
			g.loggedNAT[e.peer] = true
			g.log.Info("the kernel NATs this peer: its bindings stay on the userspace path",
				"peer", e.peer.String(), "relay", e.relay.String(), "evidence", r.Why)
		}
		return gateNAT
	default:
		return g.pending(e)
	}
}

// checkFailed counts a failed check and logs it, one line a minute at most:
// the checks run for every pending binding four times a second.
func (g *gate) checkFailed(msg string, args ...any) {
	g.checkErrs++
	if now := g.now(); now.Sub(g.lastCheckErr) >= time.Minute {
		g.lastCheckErr = now
		g.log.Warn(msg, append(args, "errors", g.checkErrs)...)
	}
}

// clientBack tells whether the client of an entry whose client's conntrack
// entry was removed has a new one that leads to the listener. A checker that
// cannot tell (none, or not a ClientChecker) has no conntrack to ask: yes.
func (g *gate) clientBack(k channelmap.Key, e *gateEntry) bool {
	cc, ok := g.checker.(ClientChecker)
	if !ok || !e.clientWire.IsValid() {
		return true
	}
	v, err := cc.CheckClient(k.Client, e.clientWire, k.Listener)
	if err != nil {
		g.checkFailed("cannot tell where a client's conntrack entry leads; its bindings stay in userspace until it can",
			"client", k.Client.String(), "error", err)
		return false
	}
	if v == natcheck.ClientHere {
		e.clientWire = netip.AddrPort{}
		return true
	}
	return false
}

// requeue moves an entry whose binding left the kernel's maps (a conntrack
// entry of its flows is gone) to s, gatePending or gateClientGone, checked
// again from the next recheck on.
func (g *gate) requeue(k channelmap.Key, e *gateEntry, s gateState, clientWire netip.AddrPort) {
	g.setFull(e, false)
	g.gen++
	e.gen = g.gen // queued checks of its former state are void
	e.backoff = 0
	e.due = g.now()
	if s == gateClientGone {
		e.clientWire = clientWire
	}
	e.state = s
	g.queue = append(g.queue, queuedCheck{key: k, gen: e.gen})
}

// pending schedules the entry's next check, each one later than the last.
func (g *gate) pending(e *gateEntry) gateState {
	e.backoff = min(max(2*e.backoff, RecheckInterval), MaxRecheckBackoff)
	e.due = g.now().Add(e.backoff)
	return gatePending
}

func (g *gate) noOffloadPeer(a netip.Addr) bool {
	a = a.Unmap()
	for _, p := range g.noOffload {
		if p.Contains(a) {
			return true
		}
	}
	return false
}

// forget drops the verdict of a binding that is no longer offloadable (its
// channel, permission or allocation is gone).
func (g *gate) forget(k channelmap.Key) {
	if e := g.entries[k]; e != nil {
		g.setFull(e, false)
		delete(g.entries, k)
	}
}

// recheck checks up to budget pending entries that are due again, round
// robin, and returns the keys that turned offloadable.
func (g *gate) recheck(budget int) []channelmap.Key {
	var direct []channelmap.Key
	now := g.now()
	queue := g.queue
	var seen []queuedCheck // go to the back: the next tick starts where this one stopped
	for len(queue) > 0 && budget > 0 {
		q := queue[0]
		queue = queue[1:]
		e := g.entries[q.key]
		if e == nil || e.gen != q.gen || e.state != gatePending && e.state != gateClientGone {
			continue // forgotten or replaced since it was queued
		}
		if now.Before(e.due) {
			seen = append(seen, q)
			continue
		}
		budget--
		if e.state == gateClientGone && !g.clientBack(q.key, e) {
			g.pending(e)
			seen = append(seen, q)
			continue
		}
		switch s := g.check(e); s {
		case gatePending:
			e.state = s
			seen = append(seen, q)
		default:
			g.setState(q.key, e, s)
			if e.state.offloadable() {
				direct = append(direct, q.key)
			}
		}
	}
	g.queue = append(slices.Clip(queue), seen...)
	return direct
}

// revalidate checks up to budget translated entries again, round robin, and
// returns the keys whose verdict changed: their entry is gone (flushed,
// deleted, expired: the kernel would map the relay afresh on pion's next
// packet, so the old mapping must not be used), or maps the relay elsewhere,
// or no longer translates as the kernel path can. Their bindings are to be
// removed and admitted again (installed from the new mapping, or kept in
// userspace while there is none: pending).
func (g *gate) revalidate(budget int) []channelmap.Key {
	var changed []channelmap.Key
	queue := g.translated
	g.translated = nil // setState queues those translated anew here
	var kept []queuedCheck
	for len(queue) > 0 && budget > 0 {
		q := queue[0]
		queue = queue[1:]
		e := g.entries[q.key]
		if e == nil || e.gen != q.gen || e.state != gateTranslated {
			continue // forgotten or replaced since
		}
		budget--
		wire := e.wire
		s := g.check(e)
		if s == gateTranslated && e.wire == wire {
			kept = append(kept, q)
			continue
		}
		g.log.Debug("the NAT mapping of an offloaded flow changed: its binding is admitted again",
			"peer", e.peer.String(), "relay", e.relay.String(), "was on the wire", wire.String(), "now", s)
		g.setState(q.key, e, s)
		changed = append(changed, q.key)
	}
	g.translated = append(append(g.translated, queue...), kept...)
	return changed
}

// setNoOffload replaces the no-offload prefixes and returns the keys of
// entries that moved: out of the prefixes (to be admitted again) and into
// them (to be removed from the offload).
func (g *gate) setNoOffload(prefixes []netip.Prefix) (readmit, evict []channelmap.Key) {
	g.noOffload = prefixes
	return g.reclassify(gateNoOffload, func(_ channelmap.Key, e *gateEntry) bool { return g.noOffloadPeer(e.peer.Addr()) })
}

// setXfrm replaces the xfrm policies and returns the keys of entries that
// moved: out of every refusing policy's reach (to be admitted again) and into
// one (to be removed from the offload). A peer in a no-offload prefix stays
// under that reason.
func (g *gate) setXfrm(ps policywatch.Policies) (readmit, evict []channelmap.Key) {
	g.xfrm = ps
	return g.reclassify(gateXfrm, func(k channelmap.Key, e *gateEntry) bool {
		_, refused := g.xfrmRefuses(k, e)
		return refused
	})
}

// reclassify moves the entries that in holds for into state s and returns
// those it removed from the offload (evict), and moves those in s that in no
// longer holds for out, forgotten, to be admitted again (readmit).
func (g *gate) reclassify(s gateState, in func(channelmap.Key, *gateEntry) bool) (readmit, evict []channelmap.Key) {
	for k, e := range g.entries {
		switch {
		case e.state != s && e.state != gateNoOffload && in(k, e):
			if e.state.offloadable() && !e.full {
				evict = append(evict, k)
			}
			g.setFull(e, false)
			e.state = s
		case e.state == s && !in(k, e):
			g.forget(k)
			readmit = append(readmit, k)
		}
	}
	return readmit, evict
}

// setFull records whether the maps refused the entry's binding; it logs when
// the maps fill up and when they have room again, not per binding.
func (g *gate) setFull(e *gateEntry, full bool) {
	if e == nil || e.full == full {
		return
	}
	e.full = full
	if full {
		g.full++
		g.fullTotal.Add(1)
		if g.full == 1 {
			g.log.Warn("the XDP binding maps are full (--max-bindings): new bindings stay on the userspace path until there is room")
		}
		return
	}
	g.full--
	if g.full == 0 {
		g.log.Info("no binding waits for room in the XDP maps any more")
	}
}

func (g *gate) markFull(k channelmap.Key, full bool) { g.setFull(g.entries[k], full) }

// clearFull forgets which bindings the maps refused.
func (g *gate) clearFull() {
	for _, e := range g.entries {
		g.setFull(e, false)
	}
}

// counts returns the bindings kept in userspace, by reason.
func (g *gate) counts() map[string]int {
	out := make(map[string]int, len(UserspaceReasons))
	for _, r := range UserspaceReasons {
		out[r] = 0
	}
	for _, e := range g.entries {
		switch e.state {
		case gateNAT:
			out[ReasonNAT]++
		case gateNoOffload:
			out[ReasonNoOffloadPeer]++
		case gatePending:
			out[ReasonPending]++
		case gateXfrm:
			out[ReasonXfrm]++
		case gateClientGone:
			out[ReasonClientConntrack]++
		}
	}
	out[ReasonFull] = g.full
	return out
}
