// Package ctrefresh keeps the conntrack entries of the flows the kernel path
// relays alive. XDP runs before netfilter, so a datagram the relay program
// relays never meets conntrack: the entry pion's first packets created (the
// client's, which holds the DNAT of a VIP to this node; the relay<->peer one)
// is no longer refreshed and expires after the UDP timeout while the media
// flows. The client's next STUN request (Refresh, ChannelBind), which goes to
// pion through the stack, is then DNATed afresh, possibly to another node,
// where the allocation does not exist (437).
//
// The kernel's own flowtable offload has the same problem and refreshes its
// flows from their counters (nf_flow_table_core.c: flow_offload_refresh, and
// nf_flow_offload_stats for hardware counters); when a flow idles, its
// conntrack entry gets the normal UDP timeout from then on
// (flow_offload_fixup_ct). This package does the same from the per-binding
// counters of the relay program: every Interval it reads them, and for each
// binding whose counters advanced since the last look it sets the timeout of
// the client's and the peer's entries as the kernel would have on a packet in
// that direction (nf_conntrack_udp_packet: the unreplied timeout, or the
// stream timeout and ASSURED once the entry has seen a reply and is older
// than two seconds). An entry it cannot find is never re-created, and an
// entry that no longer leads to this node is left alone: see
// docs/internals.md ("Conntrack of offloaded flows").
package ctrefresh

import (
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/mdlayher/netlink"
	"github.com/ti-mo/conntrack"
	"golang.org/x/sys/unix"

	"github.com/l7mp/stunnerd-xdp/internal/channelmap"
	"github.com/l7mp/stunnerd-xdp/internal/natcheck"
)

// The namespace's UDP timeouts, in seconds: an entry that has not seen a
// reply (or is younger than streamAfter), and a stream.
const (
	UnrepliedSysctl = "/proc/sys/net/netfilter/nf_conntrack_udp_timeout"
	StreamSysctl    = "/proc/sys/net/netfilter/nf_conntrack_udp_timeout_stream"
)

// streamAfter is the kernel's stream rule (nf_conntrack_proto_udp.c,
// stream_ts): an entry that has seen a reply gets the stream timeout, and
// ASSURED, on a packet that comes more than two seconds after its first.
const streamAfter = 2 * time.Second

// Bounds of the interval between two looks (see Timeouts.Interval).
const (
	MinInterval = 250 * time.Millisecond
	MaxInterval = 10 * time.Second
)

// statusNATClash is IPS_NAT_CLASH, which the kernel aliases to
// IPS_UNTRACKED's bit: such an entry never becomes ASSURED.
const statusNATClash = conntrack.StatusUntracked

// ErrNoConntrack: conntrack is not loaded in the network namespace, so no
// entry exists to keep alive (and asking ctnetlink would load it).
var ErrNoConntrack = errors.New("conntrack is not loaded in this network namespace")

// Timeouts are the namespace's UDP conntrack timeouts.
type Timeouts struct {
	Unreplied, Stream time.Duration
}

// ReadTimeouts reads the UDP timeouts of the calling thread's network
// namespace; ErrNoConntrack when the conntrack module is not loaded.
func ReadTimeouts() (Timeouts, error) {
	return readTimeouts(UnrepliedSysctl, StreamSysctl)
}

func readTimeouts(unreplied, stream string) (Timeouts, error) {
	var t Timeouts
	for _, s := range []struct {
		path string
		out  *time.Duration
	}{{unreplied, &t.Unreplied}, {stream, &t.Stream}} {
		b, err := os.ReadFile(s.path)
		if errors.Is(err, os.ErrNotExist) {
			return Timeouts{}, ErrNoConntrack
		}
		if err != nil {
			return Timeouts{}, fmt.Errorf("conntrack UDP timeout: %w", err)
		}
		n, err := strconv.ParseUint(strings.TrimSpace(string(b)), 10, 32)
		if err != nil {
			return Timeouts{}, fmt.Errorf("conntrack UDP timeout %s: %w", s.path, err)
		}
		*s.out = time.Duration(n) * time.Second
	}
	return t, nil
}

// Interval is how often to look at the counters: a quarter of the shortest
// timeout, so that an active flow's entry is refreshed three times before it
// could expire and lives at most a quarter of its timeout longer after the
// flow stops than the kernel would have kept it (30 s and 120 s by default:
// every 7.5 s). Bounded by MinInterval and MaxInterval.
func (t Timeouts) Interval() time.Duration {
	shortest := min(t.Unreplied, t.Stream)
	return min(max(shortest/4, MinInterval), MaxInterval)
}

// Table is the part of ctnetlink the refresher uses (*conntrack.Conn).
type Table interface {
	Get(conntrack.Flow) (conntrack.Flow, error)
	Update(conntrack.Flow) error
}

// Stats count what the refresher did over its life.
type Stats struct {
	// Rounds: looks at the counters that found conntrack loaded.
	Rounds uint64
	// Refreshed: entries whose timeout was set.
	Refreshed uint64
	// ClientMissing: a kernel-relayed client flow had no entry (expired
	// before it could be refreshed, or deleted: kube-proxy deletes the
	// entries of an endpoint it removed). Not re-created.
	ClientMissing uint64
	// PeerMissing: the same for a relay<->peer flow.
	PeerMissing uint64
	// Elsewhere: the entry found no longer leads where the kernel path
	// relays (a client entry DNATed to another node, a peer entry now
	// NATed): left alone.
	Elsewhere uint64
	// Skipped: entries the kernel does not refresh either (a fixed
	// timeout, a flowtable's, dying).
	Skipped uint64
	// Errors: ctnetlink requests that failed otherwise.
	Errors uint64
}

// Refresher keeps the conntrack entries of kernel-relayed flows alive. Round
// and Run are for one goroutine; Stats may be called from any.
type Refresher struct {
	log      *slog.Logger
	now      func() time.Time
	timeouts func() (Timeouts, error)
	dial     func() (Table, func() error, error)
	isLocal  func(netip.Addr) bool

	table     Table
	closeConn func() error

	// last is every binding's counters at the previous look.
	last map[channelmap.Key]channelmap.Stats
	// firstSeen is when each entry (by conntrack id) was first looked at:
	// the refresher's lower bound of its age, for the stream rule.
	firstSeen map[uint32]time.Time
	// gone are the flows logged as having lost their entry, so that a flow
	// is logged once per loss.
	gone map[tuple]bool
	// streams are the flows whose entry was a stream (SEEN_REPLY and
	// ASSURED) at the last look, by the entry's reply tuple: a stream stays
	// one, so the next refresh is a blind update of its timeout, without a
	// look-up. Looking the entry up by its reply tuple also checks that it
	// still translates as it did: an entry re-created to another endpoint
	// has another reply tuple, and the update does not find it.
	streams map[tuple]conntrack.Tuple

	rounds, refreshed, clientMissing, peerMissing, elsewhere, skipped, errs atomic.Uint64
}

// Config configures a Refresher; zero fields take the defaults.
type Config struct {
	Log *slog.Logger
	// Timeouts reads the UDP timeouts (ReadTimeouts).
	Timeouts func() (Timeouts, error)
	// Dial opens ctnetlink in the calling thread's network namespace; a
	// nil Table (and no error) when conntrack is not loaded there.
	Dial func() (Table, func() error, error)
	// IsLocal tells whether an address is this node's (a wildcard
	// listener's entries lead to one of them); net.InterfaceAddrs by default.
	IsLocal func(netip.Addr) bool
	Now     func() time.Time
}

// New returns a refresher; it opens ctnetlink on its first round that finds
// conntrack loaded.
func New(cfg Config) *Refresher {
	r := &Refresher{
		log: cfg.Log, now: cfg.Now, timeouts: cfg.Timeouts, dial: cfg.Dial, isLocal: cfg.IsLocal,
		last: map[channelmap.Key]channelmap.Stats{}, firstSeen: map[uint32]time.Time{}, gone: map[tuple]bool{},
		streams: map[tuple]conntrack.Tuple{},
	}
	if r.log == nil {
		r.log = slog.New(slog.DiscardHandler)
	}
	if r.now == nil {
		r.now = time.Now
	}
	if r.timeouts == nil {
		r.timeouts = ReadTimeouts
	}
	if r.dial == nil {
		r.dial = func() (Table, func() error, error) {
			if _, err := os.Stat(natcheck.CountSysctl); err != nil {
				// Not loaded: no entries, and a ctnetlink request would
				// load it.
				return nil, nil, nil
			}
			c, err := conntrack.Dial(&netlink.Config{})
			if err != nil {
				return nil, nil, err
			}
			return c, c.Close, nil
		}
	}
	if r.isLocal == nil {
		r.isLocal = natcheck.IsLocal
	}
	return r
}

// Close closes the ctnetlink socket.
func (r *Refresher) Close() {
	if r.closeConn != nil {
		_ = r.closeConn()
	}
	r.table, r.closeConn = nil, nil
}

// Stats returns the counts so far.
func (r *Refresher) Stats() Stats {
	return Stats{
		Rounds: r.rounds.Load(), Refreshed: r.refreshed.Load(), ClientMissing: r.clientMissing.Load(),
		PeerMissing: r.peerMissing.Load(), Elsewhere: r.elsewhere.Load(), Skipped: r.skipped.Load(), Errors: r.errs.Load(),
	}
}

// Run looks every interval the timeouts call for, until stop closes. live
// returns the bindings the kernel path holds with their counters; ok=false
// when the kernel path relays nothing (not attached): then nothing is read.
func (r *Refresher) Run(stop <-chan struct{}, live func() ([]channelmap.Live, bool, error)) {
	defer r.Close()
	every := MinInterval // the first look comes soon; then as the timeouts say
	var lastErr string
	for {
		t := time.NewTimer(every)
		select {
		case <-stop:
			t.Stop()
			return
		case <-t.C:
		}
		to, err := r.timeouts()
		if err != nil {
			// No conntrack: nothing to keep alive; look again later (a
			// rule that needs conntrack may come).
			every = MaxInterval
			if !errors.Is(err, ErrNoConntrack) {
				lastErr = r.logOnce(lastErr, "cannot read the conntrack UDP timeouts", err)
			}
			continue
		}
		every = to.Interval()
		bindings, ok, err := live()
		if ok {
			// Bindings whose slot could not be read are left out of this
			// round; the others are refreshed all the same.
			err = errors.Join(err, r.Round(bindings, to))
		}
		if err != nil {
			lastErr = r.logOnce(lastErr, "conntrack refresh of kernel-relayed flows", err)
		} else {
			lastErr = ""
		}
	}
}

// logOnce logs err unless it is the one logged last, and returns its text.
func (r *Refresher) logOnce(last, msg string, err error) string {
	if s := err.Error(); s != last {
		r.log.Warn(msg, "error", err)
		return s
	}
	return last
}

// side is which conntrack entry of a binding a tuple names.
type side uint8

const (
	clientSide side = iota // client -> the address the client sends to
	peerSide               // relay -> peer
)

// tuple is one flow as the kernel path's client->peer packets carry it:
// client->wire destination, relay->peer.
type tuple struct {
	side     side
	src, dst netip.AddrPort
}

// want is what the kernel path relayed of one flow since the last look.
type want struct {
	// fwd: packets went src->dst (client->peer ChannelData); back: dst->src
	// (peer->client).
	fwd, back bool
	// listener is the client side's listener socket: the entry must lead
	// there.
	listener netip.AddrPort
	// wire is the peer side's relay as the peer sees it: the entry must
	// map the relay there (itself when untranslated).
	wire netip.AddrPort
}

// Round is one look: the bindings' counters against the previous look's, and
// the refresh of the entries of the flows that advanced, under the timeouts.
func (r *Refresher) Round(bindings []channelmap.Live, to Timeouts) error {
	wants := r.advanced(bindings)
	if len(wants) == 0 {
		// Nothing relayed: what was known of the flows is stale by the
		// next time they are.
		clear(r.streams)
		clear(r.gone)
		return nil
	}
	if r.table == nil {
		t, closeConn, err := r.dial()
		if err != nil {
			return fmt.Errorf("conntrack netlink: %w", err)
		}
		if t == nil {
			return nil // conntrack not loaded: no entries
		}
		r.table, r.closeConn = t, closeConn
	}
	r.rounds.Add(1)
	now := r.now()
	seen := make(map[uint32]time.Time, len(r.firstSeen))
	streams := make(map[tuple]conntrack.Tuple, len(r.streams))
	var errs []error
	for tp, w := range wants {
		if err := r.refresh(tp, w, to, now, seen, streams); err != nil {
			r.errs.Add(1)
			errs = append(errs, err)
			if !errors.Is(err, unix.EBUSY) {
				// A socket error: dial again next round.
				r.Close()
				break
			}
		}
	}
	r.firstSeen = seen
	r.streams = streams // a flow idle for a look is looked up again
	for tp := range r.gone {
		if wants[tp] == nil {
			delete(r.gone, tp) // the flow stopped, or its binding went
		}
	}
	return errors.Join(errs...)
}

// advanced compares the counters with the last look's and returns the flows
// that advanced. A binding seen for the first time advanced if it relayed
// anything at all.
func (r *Refresher) advanced(bindings []channelmap.Live) map[tuple]*want {
	next := make(map[channelmap.Key]channelmap.Stats, len(bindings))
	wants := map[tuple]*want{}
	add := func(tp tuple, c2p, p2c bool, listener, wire netip.AddrPort) {
		w := wants[tp]
		if w == nil {
			w = &want{listener: listener, wire: wire}
			wants[tp] = w
		}
		w.fwd = w.fwd || c2p
		w.back = w.back || p2c
	}
	for _, l := range bindings {
		b, k := l.Binding, l.Binding.Key()
		prev := r.last[k]
		next[k] = l.Stats
		c2p := l.Stats.ClientToPeerPackets != prev.ClientToPeerPackets
		p2c := l.Stats.PeerToClientPackets != prev.PeerToClientPackets
		if !c2p && !p2c {
			continue
		}
		// The client's entry: the program learns where the client's
		// packets arrive on the wire (a VIP, a NodePort: address and port)
		// from its first accepted ChannelData, and relays neither
		// direction before it knows.
		if wire := b.ReplyFrom(); wire.IsValid() {
			add(tuple{clientSide, unmap(b.Client), unmap(wire)}, c2p, p2c, unmap(b.Listener), netip.AddrPort{})
		}
		// The peer's entry is pion's flow (relay -> peer) whatever the
		// node translates it to.
		add(tuple{peerSide, unmap(b.Relay), unmap(b.Peer)}, c2p, p2c, netip.AddrPort{}, unmap(b.OnWire()))
	}
	r.last = next
	return wants
}

func unmap(a netip.AddrPort) netip.AddrPort { return netip.AddrPortFrom(a.Addr().Unmap(), a.Port()) }

// refresh looks the flow's entry up and sets its timeout as the kernel would
// have on the packets the kernel path relayed.
func (r *Refresher) refresh(tp tuple, w *want, to Timeouts, now time.Time, seen map[uint32]time.Time,
	streams map[tuple]conntrack.Tuple) error {
	if reply, ok := r.streams[tp]; ok {
		err := r.table.Update(conntrack.Flow{TupleReply: reply, Timeout: uint32(to.Stream / time.Second)})
		if err == nil {
			streams[tp] = reply
			r.refreshed.Add(1)
			return nil
		}
		if !errors.Is(err, unix.ENOENT) {
			return fmt.Errorf("conntrack update %v->%v: %w", tp.src, tp.dst, err)
		}
		// Gone, or re-created with another translation: look it up.
	}
	q := conntrack.NewFlow(unix.IPPROTO_UDP, 0, tp.src.Addr(), tp.dst.Addr(), tp.src.Port(), tp.dst.Port(), 0, 0)
	e, err := r.table.Get(q)
	if errors.Is(err, unix.ENOENT) {
		r.missing(tp)
		return nil
	}
	if err != nil {
		return fmt.Errorf("conntrack get %v->%v: %w", tp.src, tp.dst, err)
	}
	if r.gone[tp] {
		delete(r.gone, tp)
		r.log.Info("a kernel-relayed flow has a conntrack entry again", "src", tp.src.String(), "dst", tp.dst.String())
	}
	first, ok := r.firstSeen[e.ID]
	if !ok {
		first = now
	}
	seen[e.ID] = first

	// The kernel looks a tuple up in both directions: src->dst may be the
	// entry's reply direction (the peer sent first).
	origAdv, replyAdv := w.fwd, w.back
	if !sameTuple(e.TupleOrig, tp.src, tp.dst) {
		origAdv, replyAdv = replyAdv, origAdv
	}
	if !r.leadsHere(tp, w, e) {
		r.elsewhere.Add(1)
		return nil
	}
	upd, ok := Decide(e, origAdv, replyAdv, now.Sub(first) >= streamAfter, to)
	if !ok {
		r.skipped.Add(1)
		return nil
	}
	switch err := r.table.Update(upd); {
	case errors.Is(err, unix.ENOENT):
		r.missing(tp) // gone between the two requests
		return nil
	case err != nil:
		return fmt.Errorf("conntrack update %v->%v: %w", tp.src, tp.dst, err)
	}
	r.refreshed.Add(1)
	final := conntrack.StatusSeenReply | conntrack.StatusAssured
	if st := e.Status | upd.Status; st&final == final && upd.Timeout == uint32(to.Stream/time.Second) &&
		!e.TupleReply.IP.IsIPv6() { // conntrack.Update takes a reply tuple alone only for IPv4
		streams[tp] = e.TupleReply
	}
	return nil
}

// missing counts a kernel-relayed flow without an entry, and logs it once
// per loss.
func (r *Refresher) missing(tp tuple) {
	if tp.side == peerSide {
		r.peerMissing.Add(1)
	} else {
		r.clientMissing.Add(1)
	}
	if r.gone[tp] {
		return
	}
	r.gone[tp] = true
	if tp.side == clientSide {
		r.log.Info("the conntrack entry of a kernel-relayed client flow is gone (expired, or deleted as kube-proxy "+
			"does for a removed endpoint); not re-created: the client's next request meets the DNAT rules afresh",
			"client", tp.src.String(), "to", tp.dst.String())
	} else {
		r.log.Debug("no conntrack entry for a kernel-relayed relay<->peer flow", "relay", tp.src.String(), "peer", tp.dst.String())
	}
}

func sameTuple(t conntrack.Tuple, src, dst netip.AddrPort) bool {
	return t.IP.SourceAddress.Unmap() == src.Addr() && t.Proto.SourcePort == src.Port() &&
		t.IP.DestinationAddress.Unmap() == dst.Addr() && t.Proto.DestinationPort == dst.Port()
}

// leadsHere tells whether the entry still translates the flow as the kernel
// path relays it. The client's: its replies come from the listener socket
// (the DNAT target is this node's listener) to the client itself. The
// peer's: not translated at all, or a source NAT of the relay to the
// address and port the binding relays from (natcheck let only such flows
// into the kernel path). An entry that maps the relay elsewhere is another
// flow's mapping: the mirror's gate moves the binding.
func (r *Refresher) leadsHere(tp tuple, w *want, e conntrack.Flow) bool {
	if tp.side == peerSide {
		res := natcheck.ClassifyRelay(e, tp.src, tp.dst)
		switch res.Verdict {
		case natcheck.Direct:
			return !w.wire.IsValid() || w.wire == tp.src
		case natcheck.Translated:
			return res.Wire == w.wire
		}
		return false
	}
	// The reply direction of the client's entry runs listener -> client.
	rep := e.TupleReply
	if !sameTuple(e.TupleOrig, tp.src, tp.dst) {
		rep = e.TupleOrig // the entry was made in the other direction
	}
	from := netip.AddrPortFrom(rep.IP.SourceAddress.Unmap(), rep.Proto.SourcePort)
	to := netip.AddrPortFrom(rep.IP.DestinationAddress.Unmap(), rep.Proto.DestinationPort)
	if to != tp.src || from.Port() != w.listener.Port() {
		return false
	}
	if w.listener.Addr().IsUnspecified() {
		return r.isLocal(from.Addr())
	}
	return from.Addr() == w.listener.Addr()
}

// Decide returns the update that gives entry e what the kernel's UDP tracker
// (nf_conntrack_udp_packet) would have given it on packets in the original
// (orig) and reply (reply) directions, and false when the kernel would not
// touch its timeout. old tells that the entry is more than two seconds old,
// which makes a replied entry a stream.
func Decide(e conntrack.Flow, orig, reply, old bool, to Timeouts) (conntrack.Flow, bool) {
	st := e.Status
	if (!orig && !reply) || st&(conntrack.StatusFixedTimeout|conntrack.StatusOffload|conntrack.StatusDying) != 0 {
		// A fixed timeout is never refreshed by packets; a flowtable keeps
		// its own entries alive; a dying one is going.
		return conntrack.Flow{}, false
	}
	next := st
	if reply {
		// nf_conntrack_in marks a reply; a packet after it finds the mark.
		next |= conntrack.StatusSeenReply
	}
	timeout := to.Unreplied
	if next&conntrack.StatusSeenReply != 0 && (old || st&conntrack.StatusAssured != 0) {
		timeout = to.Stream
		if st&statusNATClash == 0 {
			next |= conntrack.StatusAssured
		}
	}
	secs := uint32(timeout / time.Second)
	if secs == 0 {
		return conntrack.Flow{}, false
	}
	u := conntrack.Flow{TupleOrig: e.TupleOrig, TupleReply: e.TupleReply, Timeout: secs, Zone: e.Zone}
	if next != st {
		// Only bits the kernel lets ctnetlink set (SEEN_REPLY, ASSURED) are
		// added; the rest is sent back as read.
		u.Status = next
	}
	return u, true
}
