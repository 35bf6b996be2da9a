// Package mirror mirrors pion/turn's channel bindings into the XDP maps. pion
// calls the EventHandler hooks under its own locks, so the hooks only queue the
// event; one worker applies events in order. A binding is offloaded only while
// pion holds both the channel and a permission for its peer's IP, so the kernel
// path never relays what pion/turn would refuse. A failed map write is logged
// and leaves the flow on the userspace path; a periodic reconcile repairs drift.
//
// XDP runs before netfilter, so a binding is offloaded only when the kernel
// would not translate its relay<->peer flow (see gate.go and
// internal/natcheck): peers in a no-offload prefix and NATed flows stay in
// userspace, flows without evidence yet wait there and are checked again.
//
// A flow is in the kernel only while the node's stack would carry it (see
// docs/datapath.md): a binding leaves the maps when the conntrack entry of its
// relay<->peer or client<->listener flow is removed (ConntrackRemoved), and
// stays out of them while an xfrm policy would block or encrypt one of its
// flows (SetXfrmPolicies). It comes back through the gate once the stack has
// made a new entry for the flow, as nf_flowtable offloads a flow after the
// ruleset accepted it.
package mirror

import (
	"errors"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/pion/turn/v4"

	"github.com/l7mp/stunnerd-xdp/internal/channelmap"
	"github.com/l7mp/stunnerd-xdp/internal/policywatch"
)

// Offload is where bindings go: the XDP maps (channelmap.Maps).
type Offload interface {
	Upsert(channelmap.Binding) error
	Delete(channelmap.Key) error
	Installed() []channelmap.Binding
	Dump() (map[channelmap.Key]channelmap.Binding, error)
	RemoveStray() (int, error)
}

type allocKey struct {
	client   netip.AddrPort
	listener netip.AddrPort
}

type allocation struct {
	relay       netip.AddrPort
	channels    map[uint16]netip.AddrPort // channel -> peer
	permissions map[netip.Addr]bool
}

type eventKind int

const (
	evAllocationCreated eventKind = iota
	evAllocationDeleted
	evPermissionCreated
	evPermissionDeleted
	evChannelCreated
	evChannelDeleted
	evSetOffload
	evSetGate      // a new NATChecker
	evSetNoOffload // new no-offload prefixes
	evSetXfrm      // new xfrm policies
	evFlowRemoved  // a conntrack entry was removed
	evFlowsLost    // conntrack notifications were lost: look at every offloaded flow
	evSync         // a barrier: closes done when every earlier event is applied
)

type event struct {
	kind    eventKind
	alloc   allocKey
	relay   netip.AddrPort
	peer    netip.AddrPort
	peerIP  netip.Addr
	channel uint16
	offload Offload
	checker NATChecker
	noOff   []netip.Prefix
	xfrm    policywatch.Policies
	removed policywatch.Removed
	done    chan struct{}
}

// Stats are the mirror's own counters.
type Stats struct {
	Events, Installs, Removals, Errors, Drift uint64
	// Full counts bindings the full maps refused (each once until it is
	// offloaded or gone).
	Full uint64
	// Evicted counts offloaded bindings that left the maps while pion kept
	// them, by reason (every reason of EvictReasons is present).
	Evicted map[string]uint64
}

// Mirror keeps pion's allocations, permissions and channels and the offload in step.
type Mirror struct {
	log *slog.Logger

	qmu    sync.Mutex
	queue  []event
	wake   chan struct{}
	closed bool
	done   chan struct{}

	// Owned by the worker; smu guards reads from other goroutines.
	smu     sync.RWMutex
	allocs  map[allocKey]*allocation
	byRelay map[netip.AddrPort]allocKey // relay socket -> its allocation
	offload Offload
	gate    *gate

	events, installs, removals, errs, drift atomic.Uint64
	evicted                                 [len(evictReasons)]atomic.Uint64
	noPath                                  atomic.Pointer[func() string]
}

// evictReasons index Mirror.evicted.
var evictReasons = [...]string{EvictConntrackDeleted, EvictConntrackExpired, EvictConntrackMissing, EvictXfrm}

// New starts a mirror with no offload (everything stays in userspace until
// SetOffload).
func New(log *slog.Logger) *Mirror {
	m := &Mirror{
		log:     log,
		wake:    make(chan struct{}, 1),
		done:    make(chan struct{}),
		allocs:  make(map[allocKey]*allocation),
		byRelay: make(map[netip.AddrPort]allocKey),
		gate:    newGate(log),
	}
	go m.run()
	return m
}

// EventHandler returns the hooks to put into turn.ServerConfig. Each of them
// only appends to a queue: it never blocks on the kernel or the worker.
func (m *Mirror) EventHandler() turn.EventHandler {
	return turn.EventHandler{
		OnAllocationCreated: func(src, dst net.Addr, proto, _, _ string, relay net.Addr, _ int) {
			if k, ok := key(src, dst, proto); ok {
				m.push(event{kind: evAllocationCreated, alloc: k, relay: addrPort(relay)})
			}
		},
		OnAllocationDeleted: func(src, dst net.Addr, proto, _, _ string) {
			if k, ok := key(src, dst, proto); ok {
				m.push(event{kind: evAllocationDeleted, alloc: k})
			}
		},
		OnPermissionCreated: func(src, dst net.Addr, proto, _, _ string, relay net.Addr, peer net.IP) {
			if k, ok := key(src, dst, proto); ok {
				m.push(event{kind: evPermissionCreated, alloc: k, relay: addrPort(relay), peerIP: ipAddr(peer)})
			}
		},
		OnPermissionDeleted: func(src, dst net.Addr, proto, _, _ string, relay net.Addr, peer net.IP) {
			if k, ok := key(src, dst, proto); ok {
				m.push(event{kind: evPermissionDeleted, alloc: k, relay: addrPort(relay), peerIP: ipAddr(peer)})
			}
		},
		OnChannelCreated: func(src, dst net.Addr, proto, _, _ string, relay, peer net.Addr, ch uint16) {
			if k, ok := key(src, dst, proto); ok {
				m.push(event{kind: evChannelCreated, alloc: k, relay: addrPort(relay), peer: addrPort(peer), channel: ch})
			}
		},
		OnChannelDeleted: func(src, dst net.Addr, proto, _, _ string, relay, peer net.Addr, ch uint16) {
			if k, ok := key(src, dst, proto); ok {
				m.push(event{kind: evChannelDeleted, alloc: k, relay: addrPort(relay), peer: addrPort(peer), channel: ch})
			}
		},
	}
}

// key identifies an allocation by its 5-tuple; only UDP allocations are
// offloaded (the kernel path is UDP only). pion/turn v4 labels TCP allocations
// "UDP" as well, so the daemon gives these hooks to UDP listeners only.
func key(src, dst net.Addr, proto string) (allocKey, bool) {
	if proto != "UDP" {
		return allocKey{}, false
	}
	k := allocKey{client: addrPort(src), listener: addrPort(dst)}
	return k, k.client.IsValid() && k.listener.IsValid()
}

// addrPort converts a pion address; IPv4 comes out plain, never 4-in-6.
func addrPort(a net.Addr) netip.AddrPort {
	var ap netip.AddrPort
	switch v := a.(type) {
	case *net.UDPAddr:
		ap = v.AddrPort()
	case *net.TCPAddr:
		ap = v.AddrPort()
	case nil:
		return ap
	default:
		ap, _ = netip.ParseAddrPort(a.String())
	}
	return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())
}

func ipAddr(ip net.IP) netip.Addr {
	a, _ := netip.AddrFromSlice(ip)
	return a.Unmap()
}

func (m *Mirror) push(e event) {
	if e.kind != evFlowRemoved && e.kind != evFlowsLost {
		m.events.Add(1) // pion's events, and the daemon's calls; not conntrack's
	}
	m.qmu.Lock()
	if m.closed {
		m.qmu.Unlock()
		if e.done != nil {
			close(e.done)
		}
		return
	}
	m.queue = append(m.queue, e)
	// Woken under qmu: Close closes wake under it too, so a push racing Close
	// never sends on a closed channel. The send never blocks.
	select {
	case m.wake <- struct{}{}:
	default:
	}
	m.qmu.Unlock()
}

func (m *Mirror) run() {
	defer close(m.done)
	for range m.wake {
		for {
			m.qmu.Lock()
			batch := m.queue
			m.queue = nil
			closed := m.closed
			m.qmu.Unlock()
			if len(batch) == 0 {
				if closed {
					return
				}
				break
			}
			m.smu.Lock()
			for _, e := range batch {
				m.apply(e)
			}
			m.smu.Unlock()
		}
	}
}

// Sync waits until every event queued before it has been applied.
func (m *Mirror) Sync() {
	done := make(chan struct{})
	m.push(event{kind: evSync, done: done})
	<-done
}

// SetOffload moves every offloadable binding to o (nil: to userspace only) and
// waits until that is done. Bindings are removed from the old offload first.
func (m *Mirror) SetOffload(o Offload) {
	done := make(chan struct{})
	m.push(event{kind: evSetOffload, offload: o, done: done})
	<-done
}

// SetGate makes c the judge of which flows the kernel NATs (nil: none) and
// waits until that is done. Verdicts already given stand. The mirror owns c:
// a checker that is an io.Closer is closed when it is replaced and by Close.
func (m *Mirror) SetGate(c NATChecker) {
	done := make(chan struct{})
	m.push(event{kind: evSetGate, checker: c, done: done})
	<-done
}

// SetNoOffloadPeers replaces the prefixes whose peers stay in userspace and
// waits until bindings moved accordingly: those now inside leave the offload,
// those now outside are checked and offloaded if they may be.
func (m *Mirror) SetNoOffloadPeers(prefixes []netip.Prefix) {
	done := make(chan struct{})
	m.push(event{kind: evSetNoOffload, noOff: slices.Clone(prefixes), done: done})
	<-done
}

// SetXfrmPolicies replaces the xfrm policies the gate consults and waits
// until bindings moved accordingly: those whose relay<->peer or
// client<->listener flow a policy now blocks or encrypts leave the offload,
// those no policy refuses any more are checked and offloaded if they may be.
func (m *Mirror) SetXfrmPolicies(ps policywatch.Policies) {
	done := make(chan struct{})
	m.push(event{kind: evSetXfrm, xfrm: slices.Clone(ps), done: done})
	<-done
}

// ConntrackRemoved takes the bindings whose relay<->peer or
// client<->listener flow the removed conntrack entry was out of the offload
// (it does not wait): they go back through the gate, which offloads them
// again once the stack made a new entry for the flow (for the client's, one
// that leads to the listener).
func (m *Mirror) ConntrackRemoved(r policywatch.Removed) {
	// Every UDP entry of the node goes (DNS lookups among them); only those
	// of a flow pion holds wake the worker.
	m.smu.RLock()
	ours := m.holds(r)
	m.smu.RUnlock()
	if ours {
		m.push(event{kind: evFlowRemoved, removed: r})
	}
}

// ConntrackLost says conntrack notifications were lost: every offloaded
// binding's entries are looked up, and those missing are handled as removed.
func (m *Mirror) ConntrackLost() { m.push(event{kind: evFlowsLost}) }

// Close stops the worker after the queued events; the offload is left as is
// (the caller detaches and frees the maps).
func (m *Mirror) Close() {
	m.qmu.Lock()
	already := m.closed
	m.closed = true
	if !already {
		close(m.wake)
	}
	m.qmu.Unlock()
	<-m.done
	if !already {
		m.smu.Lock()
		m.closeChecker()
		m.smu.Unlock()
	}
}

// closeChecker closes the checker and leaves it in place: a closed checker
// fails its checks, which keeps bindings in userspace (nil would admit them).
func (m *Mirror) closeChecker() {
	if c, ok := m.gate.checker.(io.Closer); ok {
		if err := c.Close(); err != nil {
			m.log.Warn("closing the NAT checker", "error", err)
		}
	}
}

func (m *Mirror) apply(e event) {
	switch e.kind {
	case evSync:
		close(e.done)
	case evSetGate:
		if m.gate.checker != e.checker {
			m.closeChecker()
		}
		m.gate.checker = e.checker
		close(e.done)
	case evSetNoOffload:
		readmit, evict := m.gate.setNoOffload(e.noOff)
		for _, k := range evict {
			m.remove(k)
		}
		for _, k := range readmit {
			if b, ok := m.held(k); ok {
				m.install(b)
			}
		}
		close(e.done)
	case evSetXfrm:
		readmit, evict := m.gate.setXfrm(e.xfrm)
		for _, k := range evict {
			m.remove(k)
			m.evicted[evictXfrmIdx].Add(1)
			p, _ := m.gate.xfrmRefuses(k, m.gate.entries[k])
			m.log.Info("an xfrm policy blocks or encrypts a flow of an offloaded binding: it leaves the kernel path",
				"client", k.Client.String(), "channel", k.Channel, "policy", p.String())
		}
		for _, k := range readmit {
			if b, ok := m.held(k); ok {
				m.install(b)
			}
		}
		close(e.done)
	case evFlowRemoved:
		m.flowRemoved(e.removed)
	case evFlowsLost:
		m.flowsLost()
	case evSetOffload:
		if m.offload != nil {
			m.forEachInstalled(func(b channelmap.Binding) { m.remove(b.Key()) })
		}
		m.offload = e.offload
		// Waiting for room was about the old maps; the new ones say anew.
		m.gate.clearFull()
		m.forEachInstalled(func(b channelmap.Binding) { m.install(b) })
		close(e.done)
	case evAllocationCreated:
		if _, ok := m.allocs[e.alloc]; !ok {
			m.allocs[e.alloc] = &allocation{relay: e.relay, channels: map[uint16]netip.AddrPort{}, permissions: map[netip.Addr]bool{}}
			m.indexRelay(e.alloc, netip.AddrPort{}, e.relay)
		}
	case evAllocationDeleted:
		a, ok := m.allocs[e.alloc]
		if !ok {
			return
		}
		for ch, peer := range a.channels {
			if a.permissions[peer.Addr().Unmap()] { // else it left with its permission
				m.remove(bindingKey(e.alloc, ch))
			}
			m.gate.forget(bindingKey(e.alloc, ch))
		}
		m.indexRelay(e.alloc, a.relay, netip.AddrPort{})
		delete(m.allocs, e.alloc)
	case evPermissionCreated:
		a := m.alloc(e)
		a.permissions[e.peerIP] = true
		for ch, peer := range a.channels {
			if peer.Addr().Unmap() == e.peerIP {
				m.install(m.binding(e.alloc, a, ch))
			}
		}
	case evPermissionDeleted:
		a, ok := m.allocs[e.alloc]
		if !ok {
			return
		}
		if !a.permissions[e.peerIP] {
			return
		}
		delete(a.permissions, e.peerIP)
		// pion keeps the channel, but without a permission the kernel must not
		// relay it: its traffic goes back to userspace.
		for ch, peer := range a.channels {
			if peer.Addr().Unmap() == e.peerIP {
				m.remove(bindingKey(e.alloc, ch))
				m.gate.forget(bindingKey(e.alloc, ch))
			}
		}
	case evChannelCreated:
		a := m.alloc(e)
		if old, ok := a.channels[e.channel]; ok && old != e.peer {
			// A missed deletion: the old peer's entry must not outlive it
			// when the gate keeps the new peer in userspace.
			m.remove(bindingKey(e.alloc, e.channel))
			m.gate.forget(bindingKey(e.alloc, e.channel))
		}
		a.channels[e.channel] = e.peer
		// pion grants (or refreshes) the permission before it reports the channel.
		a.permissions[e.peer.Addr().Unmap()] = true
		m.install(m.binding(e.alloc, a, e.channel))
	case evChannelDeleted:
		a, ok := m.allocs[e.alloc]
		if !ok {
			return
		}
		if peer, ok := a.channels[e.channel]; ok && peer == e.peer {
			delete(a.channels, e.channel)
			if a.permissions[peer.Addr().Unmap()] { // else it left with its permission
				m.remove(bindingKey(e.alloc, e.channel))
			}
			m.gate.forget(bindingKey(e.alloc, e.channel))
		}
	}
}

// alloc returns the allocation, creating it when its creation event was missed.
func (m *Mirror) alloc(e event) *allocation {
	a, ok := m.allocs[e.alloc]
	if !ok {
		a = &allocation{relay: e.relay, channels: map[uint16]netip.AddrPort{}, permissions: map[netip.Addr]bool{}}
		m.allocs[e.alloc] = a
		m.indexRelay(e.alloc, netip.AddrPort{}, e.relay)
	}
	if e.relay.IsValid() && a.relay != e.relay {
		m.indexRelay(e.alloc, a.relay, e.relay)
		a.relay = e.relay
	}
	return a
}

// indexRelay moves allocation k's entry in byRelay from old to relay
// (either may be invalid: none).
func (m *Mirror) indexRelay(k allocKey, old, relay netip.AddrPort) {
	if old.IsValid() && m.byRelay[unmap(old)] == k {
		delete(m.byRelay, unmap(old))
	}
	if relay.IsValid() {
		m.byRelay[unmap(relay)] = k
	}
}

func unmap(a netip.AddrPort) netip.AddrPort { return netip.AddrPortFrom(a.Addr().Unmap(), a.Port()) }

func bindingKey(k allocKey, ch uint16) channelmap.Key {
	return channelmap.Key{Client: k.client, Listener: k.listener, Channel: ch}
}

func (m *Mirror) binding(k allocKey, a *allocation, ch uint16) channelmap.Binding {
	// The source for replies is learned from the client's packets by the
	// program: a DNAT in front of the listener may change it.
	return channelmap.Binding{
		Client:   k.client,
		Listener: k.listener,
		Channel:  ch,
		Peer:     a.channels[ch],
		Relay:    a.relay,
	}
}

// held returns the binding pion holds under k, if it holds the channel and a
// permission for its peer.
func (m *Mirror) held(k channelmap.Key) (channelmap.Binding, bool) {
	ak := allocKey{client: k.Client, listener: k.Listener}
	a, ok := m.allocs[ak]
	if !ok {
		return channelmap.Binding{}, false
	}
	peer, ok := a.channels[k.Channel]
	if !ok || !a.permissions[peer.Addr().Unmap()] {
		return channelmap.Binding{}, false
	}
	return m.binding(ak, a, k.Channel), true
}

// desired returns every binding that should be offloaded now: pion holds it
// and the gate admits it.
func (m *Mirror) desired() map[channelmap.Key]channelmap.Binding {
	out := map[channelmap.Key]channelmap.Binding{}
	for k, a := range m.allocs {
		for ch, peer := range a.channels {
			if a.permissions[peer.Addr().Unmap()] {
				if b, ok := m.gate.admit(m.binding(k, a, ch)); ok {
					out[b.Key()] = b
				}
			}
		}
	}
	return out
}

func (m *Mirror) forEachInstalled(f func(channelmap.Binding)) {
	for _, b := range m.desired() {
		f(b)
	}
}

// install offloads b if the gate admits it (as the gate says: from the
// relay on the wire) and reports whether it did.
func (m *Mirror) install(b channelmap.Binding) bool {
	if m.offload == nil {
		return false
	}
	b, ok := m.gate.admit(b)
	if !ok {
		return false
	}
	if err := m.offload.Upsert(b); err != nil {
		if errors.Is(err, channelmap.ErrFull) {
			// Counted and logged once by the gate; the reconcile retries.
			m.gate.markFull(b.Key(), true)
			return false
		}
		m.errs.Add(1)
		m.log.Warn("binding stays on the userspace path", "binding", b.String(), "error", err)
		return false
	}
	m.gate.markFull(b.Key(), false)
	m.installs.Add(1)
	m.log.Debug("binding offloaded", "binding", b.String())
	return true
}

func (m *Mirror) remove(k channelmap.Key) {
	if m.offload == nil {
		return
	}
	if err := m.offload.Delete(k); err != nil {
		m.errs.Add(1)
		m.log.Error("binding removal failed, reconcile will retry", "client", k.Client.String(), "channel", k.Channel, "error", err)
		return
	}
	m.removals.Add(1)
	m.log.Debug("binding removed", "client", k.Client.String(), "channel", k.Channel)
}

// Reconcile compares the offload with what pion holds and repairs the
// difference: missing bindings are installed, extra ones and stray kernel
// entries removed. It returns how many it repaired.
func (m *Mirror) Reconcile() (int, error) {
	m.smu.Lock()
	defer m.smu.Unlock()
	if m.offload == nil {
		return 0, nil
	}
	want := m.desired()
	have, err := m.offload.Dump()
	if err != nil {
		return 0, err
	}
	repaired := 0
	var errs []error
	for k, b := range want {
		if hb, ok := have[k]; !ok || hb.Peer != b.Peer || hb.Relay != b.Relay || hb.OnWire() != b.OnWire() {
			if err := m.offload.Upsert(b); err != nil {
				// Full maps are no drift: the gate counts the waiting bindings
				// and logs once, not one error per binding per interval.
				if errors.Is(err, channelmap.ErrFull) {
					m.gate.markFull(k, true)
				} else {
					errs = append(errs, err)
				}
				continue
			}
			repaired++
		}
		m.gate.markFull(k, false)
	}
	for _, b := range m.offload.Installed() {
		if _, ok := want[b.Key()]; !ok {
			if err := m.offload.Delete(b.Key()); err != nil {
				errs = append(errs, err)
				continue
			}
			repaired++
		}
	}
	n, err := m.offload.RemoveStray()
	repaired += n
	if err != nil {
		errs = append(errs, err)
	}
	m.drift.Add(uint64(repaired))
	if repaired > 0 {
		m.log.Warn("reconcile repaired drift between pion/turn and the XDP maps", "repaired", repaired)
	}
	return repaired, errors.Join(errs...)
}

// RecheckPending asks the NAT checker again about up to RecheckBudget
// bindings that had no evidence yet and offloads those found offloadable. It
// also checks up to RecheckBudget bindings offloaded with a translation
// again, and moves those whose mapping is gone or changed: out of the kernel
// path, and back in from the new mapping when there is one. It returns how
// many it offloaded.
func (m *Mirror) RecheckPending() int {
	m.smu.Lock()
	defer m.smu.Unlock()
	if m.offload == nil {
		return 0 // they wait: SetOffload admits them when it comes
	}
	n := 0
	for _, k := range m.gate.revalidate(RecheckBudget) {
		// The old mapping's entries go first: the peer's datagrams to it
		// are no longer this binding's once the kernel has forgotten it.
		m.remove(k)
		if b, ok := m.held(k); ok && m.install(b) {
			n++
		}
	}
	for _, k := range m.gate.recheck(RecheckBudget) {
		if b, ok := m.held(k); ok && m.install(b) {
			n++
		}
	}
	return n
}

// FlowGateInterval is how often an offload that gates its flow caches by
// the bindings sending (FlowGater) counts them.
const FlowGateInterval = time.Second

// FlowGater is an Offload whose flow caches stand aside while many of its
// bindings send (channelmap.Maps.GateFlows).
type FlowGater interface {
	GateFlows() error
}

// GateFlows lets the offload, if it is a FlowGater, count its bindings
// that send and set its flow caches aside or use them.
func (m *Mirror) GateFlows() error {
	m.smu.RLock()
	g, ok := m.offload.(FlowGater)
	m.smu.RUnlock()
	if !ok {
		return nil
	}
	return g.GateFlows()
}

// RunReconcile reconciles every interval, rechecks pending bindings every
// RecheckInterval and gates the flow caches every FlowGateInterval, until
// stop is closed.
func (m *Mirror) RunReconcile(interval time.Duration, stop <-chan struct{}) {
	t := time.NewTicker(interval)
	defer t.Stop()
	recheck := time.NewTicker(RecheckInterval)
	defer recheck.Stop()
	gate := time.NewTicker(FlowGateInterval)
	defer gate.Stop()
	for {
		select {
		case <-stop:
			return
		case <-gate.C:
			if err := m.GateFlows(); err != nil {
				m.log.Debug("flow caches: cannot count the bindings that send", "error", err)
			}
		case <-recheck.C:
			m.RecheckPending()
		case <-t.C:
			if _, err := m.Reconcile(); err != nil {
				m.errs.Add(1)
				m.log.Error("reconcile failed", "error", err)
			}
		}
	}
}

// Counts returns the number of allocations and channel bindings pion holds.
func (m *Mirror) Counts() (allocations, channels int) {
	m.smu.RLock()
	defer m.smu.RUnlock()
	for _, a := range m.allocs {
		channels += len(a.channels)
	}
	return len(m.allocs), channels
}

// Stats returns the mirror's counters.
func (m *Mirror) Stats() Stats {
	evicted := make(map[string]uint64, len(evictReasons))
	for i, r := range evictReasons {
		evicted[r] = m.evicted[i].Load()
	}
	return Stats{Events: m.events.Load(), Installs: m.installs.Load(), Removals: m.removals.Load(),
		Errors: m.errs.Load(), Drift: m.drift.Load(), Full: m.gate.fullTotal.Load(), Evicted: evicted}
}

// UserspaceBindings returns how many bindings pion holds stay in userspace,
// by reason (every reason of UserspaceReasons is present). Bindings are
// judged while an offload is set; without one, every binding pion holds with
// a permission counts under the reason SetNoPath's function gives (a peer in
// a no-offload prefix under its own), so that a node whose kernel path is
// unavailable does not read as one without bindings.
func (m *Mirror) UserspaceBindings() map[string]int {
	why := ReasonNoKernelPath
	if f := m.noPath.Load(); f != nil {
		// Asked before taking smu: the function's owner may wait for the
		// worker, which takes smu.
		if r := (*f)(); r != "" {
			why = r
		}
	}
	m.smu.RLock()
	defer m.smu.RUnlock()
	out := m.gate.counts()
	if m.offload != nil {
		return out
	}
	for _, r := range []string{ReasonNAT, ReasonPending, ReasonFull, ReasonNoOffloadPeer, ReasonXfrm, ReasonClientConntrack} {
		out[r] = 0 // verdicts of an earlier offload: not why the bindings wait now
	}
	for _, a := range m.allocs {
		for _, peer := range a.channels {
			switch {
			case !a.permissions[peer.Addr().Unmap()]:
			case m.gate.noOffloadPeer(peer.Addr()):
				out[ReasonNoOffloadPeer]++
			default:
				out[why]++
			}
		}
	}
	return out
}

// SetNoPath gives the function that says why no offload is set (one of
// ReasonOff, ReasonRefused, ReasonNoKernelPath; "" counts as the last): the
// offload manager's Unavailable. It must not block on the mirror.
func (m *Mirror) SetNoPath(why func() string) { m.noPath.Store(&why) }
