package destinations

import (
	"context"
	"errors"
	"log/slog"
	"maps"
	"net/netip"
	"slices"
	"sync"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// Sink receives the whole table after every change. It is called from one
// goroutine at a time; an error makes the tracker retry the push.
type Sink func(Table) error

// Config configures a Tracker.
type Config struct {
	Sink Sink
	Log  *slog.Logger
	// NetNS is the network namespace whose addresses and conntrack are
	// watched; zero or netns.None() for the caller's (the daemon's).
	NetNS netns.NsHandle
	// Coalesce is how long changes gather before a push (default 50ms).
	Coalesce time.Duration
	// MaxLearned bounds the learned VIPs (default DefaultMaxLearned).
	MaxLearned int
	// ReceiveBuffer is the size of the socket buffer address notifications
	// queue in; 0: net.core.rmem_default. A burst that overruns it costs a
	// re-list.
	ReceiveBuffer int
}

// Defaults for the zero fields of Config.
const (
	DefaultCoalesce   = 50 * time.Millisecond
	DefaultMaxLearned = 1024
	// retryInterval paces re-subscribing to netlink and re-pushing a table
	// the sink refused.
	retryInterval = time.Second
)

// Tracker keeps the table of accepted destinations up to date: it follows the
// node's addresses through netlink, learns VIPs from conntrack as allocations
// arrive, and pushes the table to its sink. Its methods never block on the
// kernel, so pion/turn's event hooks may call them.
type Tracker struct {
	cfg Config
	log *slog.Logger

	mu        sync.Mutex
	listeners []netip.AddrPort
	events    []event
	force     bool // push even if the table did not change
	wake      chan struct{}
	subErr    chan error // from the netlink subscription's goroutine
	current   Table

	stop, stopped chan struct{}

	// Owned by run.
	local    []netip.Addr
	allocs   map[allocation]netip.AddrPort // -> learned destination, invalid if none
	refs     map[Learned]int
	pushed   Table
	pushErr  error
	conn     *conntrackConn
	socks    *sockDiag
	reported map[string]string // what -> last error logged, to log each error once
}

type allocation struct{ client, listener netip.AddrPort }

type eventKind int

const (
	allocated eventKind = iota
	deallocated
)

type event struct {
	kind eventKind
	allocation
}

// New starts a tracker for the given listener socket addresses. Netlink
// problems do not stop it: it serves the specific listeners, logs, and keeps
// retrying.
func New(cfg Config, listeners []netip.AddrPort) *Tracker {
	if cfg.Coalesce == 0 {
		cfg.Coalesce = DefaultCoalesce
	}
	if cfg.MaxLearned == 0 {
		cfg.MaxLearned = DefaultMaxLearned
	}
	if cfg.NetNS == 0 {
		cfg.NetNS = netns.None()
	}
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	t := &Tracker{
		cfg:       cfg,
		log:       cfg.Log,
		listeners: normalizeAll(listeners),
		force:     true,
		wake:      make(chan struct{}, 1),
		subErr:    make(chan error, 1),
		current:   Table{},
		stop:      make(chan struct{}),
		stopped:   make(chan struct{}),
		allocs:    map[allocation]netip.AddrPort{},
		refs:      map[Learned]int{},
		reported:  map[string]string{},
	}
	t.conn = &conntrackConn{netNS: cfg.NetNS}
	t.socks = &sockDiag{netNS: cfg.NetNS}
	go t.run()
	return t
}

// SetListeners replaces the listener socket addresses (on a reload). What
// was learned for a listener that is gone is forgotten.
func (t *Tracker) SetListeners(listeners []netip.AddrPort) {
	t.mu.Lock()
	t.listeners = normalizeAll(listeners)
	t.mu.Unlock()
	t.poke()
}

// AllocationCreated reports a new allocation of client on listener (its
// socket address): the tracker looks the flow up in conntrack and learns the
// VIP it came through, if any.
func (t *Tracker) AllocationCreated(client, listener netip.AddrPort) {
	t.queue(event{kind: allocated, allocation: allocation{normalize(client), normalize(listener)}})
}

// AllocationDeleted reports that an allocation is gone; a VIP learned for it
// is forgotten with the last allocation through it. (pion/turn reports the
// deletion of every allocation, also of those a closing server drops: their
// relay socket's read loop ends in DeleteAllocation.)
func (t *Tracker) AllocationDeleted(client, listener netip.AddrPort) {
	t.queue(event{kind: deallocated, allocation: allocation{normalize(client), normalize(listener)}})
}

// Resync pushes the table again even if it did not change: the sink's
// target was (re)created.
func (t *Tracker) Resync() {
	t.mu.Lock()
	t.force = true
	t.mu.Unlock()
	t.poke()
}

// Table returns the table last computed.
func (t *Tracker) Table() Table {
	t.mu.Lock()
	defer t.mu.Unlock()
	return maps.Clone(t.current)
}

// Close stops the tracker.
func (t *Tracker) Close() {
	select {
	case <-t.stop:
	default:
		close(t.stop)
	}
	<-t.stopped
}

func (t *Tracker) queue(e event) {
	t.mu.Lock()
	t.events = append(t.events, e)
	t.mu.Unlock()
	t.poke()
}

func (t *Tracker) poke() {
	select {
	case t.wake <- struct{}{}:
	default:
	}
}

func (t *Tracker) run() {
	defer close(t.stopped)
	defer t.conn.close()
	defer t.socks.close()

	var updates chan netlink.AddrUpdate
	var subDone chan struct{}
	subscribe := func() bool {
		ch, done := make(chan netlink.AddrUpdate, 64), make(chan struct{})
		err := netlink.AddrSubscribeWithOptions(ch, done, netlink.AddrSubscribeOptions{
			Namespace:         &t.cfg.NetNS,
			ReceiveBufferSize: t.cfg.ReceiveBuffer,
			// The library closes ch after a receive error (an overflow,
			// ENOBUFS): the loop then subscribes again and re-lists.
			ErrorCallback: func(err error) {
				select {
				case <-done: // closed by us
				case t.subErr <- err:
				default:
				}
			},
		})
		if err != nil {
			close(done)
			t.report(problemSubscribe, err)
			return false
		}
		t.report(problemSubscribe, nil)
		updates, subDone = ch, done
		return true
	}
	relist := func() bool {
		local, err := listLocal(t.cfg.NetNS)
		t.report(problemList, err)
		if err != nil {
			return false
		}
		t.local = local
		return true
	}
	// Subscribe before listing, so that no change falls between the two.
	healthy := subscribe() && relist()

	coalesce := time.NewTimer(0) // the first push
	defer coalesce.Stop()
	pending := true
	schedule := func() {
		if !pending {
			pending = true
			coalesce.Reset(t.cfg.Coalesce)
		}
	}
	retry := time.NewTicker(retryInterval)
	defer retry.Stop()
	addrsChanged := false
	var subErr error // the subscription's last error, logged when it ends
	for {
		select {
		case <-t.stop:
			if subDone != nil {
				close(subDone)
				// The subscription's goroutine may be blocked on a send:
				// let it see the closed socket and close updates.
				for range updates {
				}
			}
			return
		case err := <-t.subErr:
			subErr = err
		case _, ok := <-updates:
			if !ok {
				// Changes were lost (typically ENOBUFS: a burst overran the
				// socket): subscribe again and re-list at once.
				close(subDone)
				updates, subDone = nil, nil
				t.log.Info("destinations: address changes were lost; re-listing", "error", subErr)
				healthy = subscribe() && relist()
				schedule()
				continue
			}
			addrsChanged = true
			schedule()
		case <-t.wake:
			t.processEvents()
			schedule()
		case <-retry.C:
			switch {
			case !healthy:
				if updates == nil && !subscribe() {
					continue
				}
				if healthy = relist(); healthy {
					schedule()
				}
			case t.pushErr != nil:
				schedule()
			}
		case <-coalesce.C:
			pending = false
			if addrsChanged {
				addrsChanged = false
				healthy = relist()
			}
			t.publish()
		}
	}
}

// processEvents applies the queued allocation events.
func (t *Tracker) processEvents() {
	t.mu.Lock()
	events, listeners := t.events, t.listeners
	t.events = nil
	t.mu.Unlock()
	live := map[netip.AddrPort]bool{}
	for _, l := range listeners {
		live[l] = true
	}
	for a := range t.allocs {
		if !live[a.listener] {
			t.forget(a)
		}
	}
	for _, e := range events {
		switch e.kind {
		case allocated:
			if _, dup := t.allocs[e.allocation]; dup || !live[e.listener] {
				continue
			}
			d := t.learn(e.allocation, listeners)
			t.allocs[e.allocation] = d
			if d.IsValid() {
				l := Learned{Dest: d, Listener: e.listener}
				if t.refs[l] == 0 && len(t.refs) >= t.cfg.MaxLearned {
					t.report(problemLearn, errTooManyLearned)
					t.allocs[e.allocation] = netip.AddrPort{}
					continue
				}
				t.refs[l]++
			}
		case deallocated:
			t.forget(e.allocation)
		}
	}
}

// forget drops an allocation, and the VIP learned for it with the last
// allocation through it.
func (t *Tracker) forget(a allocation) {
	d, ok := t.allocs[a]
	if !ok {
		return
	}
	delete(t.allocs, a)
	if !d.IsValid() {
		return
	}
	l := Learned{Dest: d, Listener: a.listener}
	if t.refs[l]--; t.refs[l] <= 0 {
		delete(t.refs, l)
	}
}

var errTooManyLearned = errors.New("too many learned VIPs")

// publish computes the table and pushes it when it changed or a push is due.
func (t *Tracker) publish() {
	t.mu.Lock()
	listeners, force := t.listeners, t.force
	t.force = false
	t.mu.Unlock()
	learned := make([]Learned, 0, len(t.refs))
	for l := range t.refs {
		learned = append(learned, l)
	}
	next := Compute(listeners, t.local, learned)
	t.mu.Lock()
	t.current = next
	t.mu.Unlock()
	if !force && t.pushErr == nil && t.pushed != nil && maps.Equal(next, t.pushed) {
		return
	}
	t.logDiff(t.pushed, next)
	t.pushErr = t.cfg.Sink(maps.Clone(next))
	t.report(problemPush, t.pushErr)
	if t.pushErr == nil {
		t.pushed = next
	}
}

func (t *Tracker) logDiff(prev, next Table) {
	if !t.log.Enabled(context.Background(), slog.LevelDebug) {
		return
	}
	for d, l := range next {
		if p, ok := prev[d]; !ok || p != l {
			t.log.Debug("destination accepted", "dest", d.String(), "listener", l.String())
		}
	}
	for d, l := range prev {
		if _, ok := next[d]; !ok {
			t.log.Debug("destination dropped", "dest", d.String(), "listener", l.String())
		}
	}
}

// problem is something that can fail, and what its failure costs.
type problem struct{ what, effect string }

var (
	problemSubscribe = problem{"subscribing to address changes", "the table follows the node's addresses only as often as it is re-listed"}
	problemList      = problem{"listing the node's addresses", "the wildcard listeners' entries may be stale"}
	problemConntrack = problem{"conntrack look-up", "VIPs go unlearned and their ChannelData stays on the userspace path"}
	problemSockets   = problem{"listing the sockets on a NodePort", "port-translated destinations go unlearned and stay on the userspace path"}
	problemLearn     = problem{"learning a VIP", "new VIPs stay on the userspace path"}
	problemPush      = problem{"pushing the table", "the XDP program's table is stale until a push succeeds"}
)

// report logs an error of p the first time it is seen, and its end.
func (t *Tracker) report(p problem, err error) {
	prev, had := t.reported[p.what]
	switch {
	case err == nil && had:
		delete(t.reported, p.what)
		t.log.Info("destinations: "+p.what+" works again", "was", prev)
	case err != nil && prev != err.Error():
		t.reported[p.what] = err.Error()
		t.log.Warn("destinations: "+p.what+" failed: "+p.effect, "error", err)
	}
}

// listLocal returns the addresses the kernel delivers to locally in ns:
// every address but tentative (DAD in progress) and failed ones.
func listLocal(ns netns.NsHandle) ([]netip.Addr, error) {
	h, err := netlink.NewHandleAt(ns, unix.NETLINK_ROUTE)
	if err != nil {
		return nil, err
	}
	defer h.Close()
	var addrs []netlink.Addr
	for range 3 {
		// An interrupted dump (a change raced it) may be inconsistent: retry.
		if addrs, err = h.AddrList(nil, netlink.FAMILY_ALL); !errors.Is(err, netlink.ErrDumpInterrupted) {
			break
		}
	}
	if err != nil {
		return nil, err
	}
	var out []netip.Addr
	for _, a := range addrs {
		// The kernel delivers to an optimistic address during DAD, never to
		// a failed one.
		if a.Flags&unix.IFA_F_DADFAILED != 0 || a.Flags&(unix.IFA_F_TENTATIVE|unix.IFA_F_OPTIMISTIC) == unix.IFA_F_TENTATIVE {
			continue
		}
		if ip, ok := netip.AddrFromSlice(a.IP); ok {
			out = append(out, ip.Unmap())
		}
	}
	slices.SortFunc(out, netip.Addr.Compare)
	return slices.Compact(out), nil
}

func normalizeAll(ls []netip.AddrPort) []netip.AddrPort {
	out := make([]netip.AddrPort, 0, len(ls))
	for _, l := range ls {
		out = append(out, normalize(l))
	}
	slices.SortFunc(out, netip.AddrPort.Compare)
	return slices.Compact(out)
}
