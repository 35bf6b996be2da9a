// Package control mirrors pion/turn's channel bindings into the XDP maps. pion
// calls the EventHandler hooks under its own locks, so the hooks only queue the
// event; one worker applies events in order. A binding is offloaded only while
// pion holds both the channel and a permission for its peer's IP, so the kernel
// path never relays what pion/turn would refuse. A failed map write is logged
// and leaves the flow on the userspace path; a periodic reconcile repairs drift.
package control

import (
	"errors"
	"log/slog"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"

	"github.com/pion/turn/v4"

	"github.com/l7mp/stunnerd-xdp/internal/channelmap"
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
	evSync // a barrier: closes done when every earlier event is applied
)

type event struct {
	kind    eventKind
	alloc   allocKey
	relay   netip.AddrPort
	peer    netip.AddrPort
	peerIP  netip.Addr
	channel uint16
	offload Offload
	done    chan struct{}
}

// Stats are the mirror's own counters.
type Stats struct {
	Events, Installs, Removals, Errors, Drift uint64
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
	offload Offload

	events, installs, removals, errs, drift atomic.Uint64
}

// New starts a mirror with no offload (everything stays in userspace until
// SetOffload).
func New(log *slog.Logger) *Mirror {
	m := &Mirror{
		log:    log,
		wake:   make(chan struct{}, 1),
		done:   make(chan struct{}),
		allocs: make(map[allocKey]*allocation),
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
	m.events.Add(1)
	m.qmu.Lock()
	if m.closed {
		m.qmu.Unlock()
		if e.done != nil {
			close(e.done)
		}
		return
	}
	m.queue = append(m.queue, e)
	m.qmu.Unlock()
	select {
	case m.wake <- struct{}{}:
	default:
	}
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

// Close stops the worker after the queued events; the offload is left as is
// (the caller detaches and frees the maps).
func (m *Mirror) Close() {
	m.qmu.Lock()
	already := m.closed
	m.closed = true
	m.qmu.Unlock()
	if !already {
		close(m.wake)
	}
	<-m.done
}

func (m *Mirror) apply(e event) {
	switch e.kind {
	case evSync:
		close(e.done)
	case evSetOffload:
		if m.offload != nil {
			m.forEachInstalled(func(b channelmap.Binding) { m.remove(b.Key()) })
		}
		m.offload = e.offload
		m.forEachInstalled(func(b channelmap.Binding) { m.install(b) })
		close(e.done)
	case evAllocationCreated:
		if _, ok := m.allocs[e.alloc]; !ok {
			m.allocs[e.alloc] = &allocation{relay: e.relay, channels: map[uint16]netip.AddrPort{}, permissions: map[netip.Addr]bool{}}
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
		}
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
			}
		}
	case evChannelCreated:
		a := m.alloc(e)
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
		}
	}
}

// alloc returns the allocation, creating it when its creation event was missed.
func (m *Mirror) alloc(e event) *allocation {
	a, ok := m.allocs[e.alloc]
	if !ok {
		a = &allocation{relay: e.relay, channels: map[uint16]netip.AddrPort{}, permissions: map[netip.Addr]bool{}}
		m.allocs[e.alloc] = a
	}
	if e.relay.IsValid() {
		a.relay = e.relay
	}
	return a
}

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

// desired returns every binding that should be offloaded now.
func (m *Mirror) desired() map[channelmap.Key]channelmap.Binding {
	out := map[channelmap.Key]channelmap.Binding{}
	for k, a := range m.allocs {
		for ch, peer := range a.channels {
			if a.permissions[peer.Addr().Unmap()] {
				b := m.binding(k, a, ch)
				out[b.Key()] = b
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

func (m *Mirror) install(b channelmap.Binding) {
	if m.offload == nil {
		return
	}
	if err := m.offload.Upsert(b); err != nil {
		m.errs.Add(1)
		m.log.Warn("binding stays on the userspace path", "binding", b.String(), "error", err)
		return
	}
	m.installs.Add(1)
	m.log.Debug("binding offloaded", "binding", b.String())
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
		if hb, ok := have[k]; !ok || hb.Peer != b.Peer || hb.Relay != b.Relay {
			if err := m.offload.Upsert(b); err != nil {
				errs = append(errs, err)
				continue
			}
			repaired++
		}
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

// RunReconcile reconciles every interval until stop is closed.
func (m *Mirror) RunReconcile(interval time.Duration, stop <-chan struct{}) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-stop:
			return
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
	return Stats{Events: m.events.Load(), Installs: m.installs.Load(), Removals: m.removals.Load(),
		Errors: m.errs.Load(), Drift: m.drift.Load()}
}
