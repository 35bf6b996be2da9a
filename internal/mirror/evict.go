package mirror

import (
	"net/netip"

	"github.com/l7mp/stunnerd-xdp/internal/channelmap"
	"github.com/l7mp/stunnerd-xdp/internal/natcheck"
	"github.com/l7mp/stunnerd-xdp/internal/policywatch"
)

// Indices of Mirror.evicted, in evictReasons' order.
const (
	evictDeletedIdx = iota
	evictExpiredIdx
	evictMissingIdx
	evictXfrmIdx
)

// flowRemoved evicts the bindings one of whose flows the removed entry was:
// pion's relay<->peer flow (made in either direction) or the client's flow
// to the listener (made by the client: its replies come from the listener to
// the client, whatever address the client sent to).
//
// Any removal evicts, expiry included: after it the stack meets the flow's
// next packet as a new one, against the whole ruleset, as nf_flowtable tears
// its entry down whenever conntrack removes the flow. The refresher
// (internal/ctrefresh) keeps the entries of flows the kernel relays from
// expiring, so an expiry means the flow idled (or the refresh failed), and
// the binding is back in the kernel once pion's packets made a new entry.
func (m *Mirror) flowRemoved(r policywatch.Removed) {
	why := evictExpiredIdx
	if r.Deleted {
		why = evictDeletedIdx
	}
	m.eachFlowOf(r, func(k channelmap.Key, client bool) {
		if client {
			m.evict(k, why, gateClientGone, r.OrigDst)
		} else {
			m.evict(k, why, gatePending, netip.AddrPort{})
		}
	})
}

// holds tells whether the removed entry is a flow of a binding pion holds.
func (m *Mirror) holds(r policywatch.Removed) bool {
	found := false
	m.eachFlowOf(r, func(channelmap.Key, bool) { found = true })
	return found
}

// eachFlowOf calls f with every binding the entry was a flow of: its
// relay<->peer flow (client false) or its client's (client true).
func (m *Mirror) eachFlowOf(r policywatch.Removed, f func(k channelmap.Key, client bool)) {
	for _, t := range [][2]netip.AddrPort{{r.OrigSrc, r.OrigDst}, {r.OrigDst, r.OrigSrc}} {
		ak, ok := m.byRelay[t[0]]
		if !ok {
			continue
		}
		for ch, peer := range m.allocs[ak].channels {
			if unmap(peer) == t[1] {
				f(bindingKey(ak, ch), false)
			}
		}
	}
	l := r.ReplySrc
	for _, listener := range []netip.AddrPort{l, netip.AddrPortFrom(netip.IPv4Unspecified(), l.Port()),
		netip.AddrPortFrom(netip.IPv6Unspecified(), l.Port())} {
		// The client as pion sees it is where the replies go.
		ak := allocKey{client: r.ReplyDst, listener: listener}
		for ch := range m.allocs[ak].channelsOrNil() {
			f(bindingKey(ak, ch), true)
		}
	}
}

// channelsOrNil is a's channels; none for a nil allocation.
func (a *allocation) channelsOrNil() map[uint16]netip.AddrPort {
	if a == nil {
		return nil
	}
	return a.channels
}

// evict takes binding k out of the offload if it is there and sends its gate
// entry to s (gatePending: the relay<->peer entry went; gateClientGone: the
// client's, which went to clientWire), counted under reason index why. An
// entry kept in userspace for another reason (NAT, no-offload peer, xfrm)
// stays as it is: it is judged afresh when that reason goes; one already
// waiting for a new entry of its relay<->peer flow now waits for the
// client's too.
func (m *Mirror) evict(k channelmap.Key, why int, s gateState, clientWire netip.AddrPort) {
	e := m.gate.entries[k]
	if e == nil {
		return
	}
	switch {
	case e.state.offloadable():
		if !e.full && m.offload != nil {
			m.remove(k)
			m.evicted[why].Add(1)
			m.log.Debug("the conntrack entry of an offloaded flow was removed: the binding leaves the kernel path",
				"client", k.Client.String(), "channel", k.Channel, "reason", evictReasons[why], "waits for", s.String())
		}
	case e.state == gatePending && s == gateClientGone:
	default:
		return
	}
	m.gate.requeue(k, e, s, clientWire)
}

// flowsLost looks up the entries of every offloaded binding after conntrack
// notifications were lost, and evicts those whose entry no longer leads where
// the binding relays: the relay<->peer one as the gate judged it (gone
// included), the client's where the program learned the client sends to
// (when it leads elsewhere).
func (m *Mirror) flowsLost() {
	if m.offload == nil || m.gate.checker == nil {
		return
	}
	installed, err := m.offload.Dump()
	if err != nil {
		m.log.Warn("conntrack notifications were lost and the maps cannot be read: bindings stay as they are", "error", err)
		return
	}
	cc, _ := m.gate.checker.(ClientChecker)
	n := 0
	for k, b := range installed {
		e := m.gate.entries[k]
		if e == nil || !e.state.offloadable() {
			continue
		}
		// Only a client entry that leads elsewhere evicts here: none at all
		// is also what a namespace conntrack does not track shows (no rule
		// there asks for it: the binding was admitted so), and a 5.10 guest
		// running make demo saw lost notifications evict its one binding so.
		if wire := b.ReplyFrom(); cc != nil && wire.IsValid() {
			if v, err := cc.CheckClient(k.Client, wire, k.Listener); err == nil && v == natcheck.ClientElsewhere {
				m.evict(k, evictMissingIdx, gateClientGone, wire)
				n++
				continue
			}
		}
		r, err := m.gate.checker.Check(e.relay, e.peer)
		if err != nil {
			continue
		}
		if s := verdictState(r.Verdict); s != e.state || s == gateTranslated && r.Wire != e.wire {
			m.evict(k, evictMissingIdx, gatePending, netip.AddrPort{})
			n++
		}
	}
	m.log.Warn("conntrack notifications were lost: looked up the entries of every offloaded binding",
		"offloaded", len(installed), "evicted", n)
}

// verdictState is the gate state a checker's verdict leads to.
func verdictState(v natcheck.Verdict) gateState {
	switch v {
	case natcheck.Direct:
		return gateDirect
	case natcheck.Translated:
		return gateTranslated
	case natcheck.NATed:
		return gateNAT
	}
	return gatePending
}
