package listener

import (
	"net"
	"sync"

	"github.com/pion/turn/v4"
)

// allocKey is pion's five-tuple within one of its servers: the client's and
// the server's transport addresses.
type allocKey struct{ client, server string }

// liveAlloc is what replacements knows of a live allocation.
type liveAlloc struct {
	relay string
	// late counts the Deleted reports still to come from allocations this
	// one replaced: pion reports them after it has closed them.
	late int
}

// replacements puts pion's allocation reports for one of its servers back
// in order for the hooks behind it (quota, permission limit, steering, peer
// ports, destinations, mirror). pion's DeleteAllocation takes an allocation
// out of its map, closes it (firing its permission and channel hooks) and
// only then reports it deleted; in that gap the same five-tuple can allocate
// again. Behind replacements, the new allocation's Created is preceded by a
// Deleted of the one it replaces (pion allows one allocation per
// five-tuple, so that one is gone), the late Deleted is swallowed, and the
// old allocation's late permission and channel hooks (told apart by their
// relay address, which differs while the old relay socket is open) are
// dropped.
type replacements struct {
	mu   sync.Mutex
	live map[allocKey]*liveAlloc
}

func addrString(a net.Addr) string {
	if a == nil {
		return ""
	}
	return a.String()
}

// wrap returns h behind the replacements. Allocation hooks run under the
// lock, so that the hooks behind see each five-tuple's reports in order.
func (r *replacements) wrap(h turn.EventHandler) turn.EventHandler {
	r.live = map[allocKey]*liveAlloc{}
	created, deleted := h.OnAllocationCreated, h.OnAllocationDeleted
	h.OnAllocationCreated = func(src, dst net.Addr, proto, user, realm string, relay net.Addr, port int) {
		r.mu.Lock()
		defer r.mu.Unlock()
		k := allocKey{addrString(src), addrString(dst)}
		a := r.live[k]
		if a != nil {
			a.late++
			if deleted != nil {
				deleted(src, dst, proto, user, realm)
			}
		} else {
			a = &liveAlloc{}
			r.live[k] = a
		}
		a.relay = addrString(relay)
		if created != nil {
			created(src, dst, proto, user, realm, relay, port)
		}
	}
	h.OnAllocationDeleted = func(src, dst net.Addr, proto, user, realm string) {
		r.mu.Lock()
		defer r.mu.Unlock()
		k := allocKey{addrString(src), addrString(dst)}
		a := r.live[k]
		switch {
		case a != nil && a.late > 0:
			a.late--
			return
		case a != nil:
			delete(r.live, k)
		}
		if deleted != nil {
			deleted(src, dst, proto, user, realm)
		}
	}
	if f := h.OnPermissionCreated; f != nil {
		h.OnPermissionCreated = func(src, dst net.Addr, proto, user, realm string, relay net.Addr, peer net.IP) {
			if r.current(src, dst, relay) {
				f(src, dst, proto, user, realm, relay, peer)
			}
		}
	}
	if f := h.OnPermissionDeleted; f != nil {
		h.OnPermissionDeleted = func(src, dst net.Addr, proto, user, realm string, relay net.Addr, peer net.IP) {
			if r.current(src, dst, relay) {
				f(src, dst, proto, user, realm, relay, peer)
			}
		}
	}
	if f := h.OnChannelCreated; f != nil {
		h.OnChannelCreated = func(src, dst net.Addr, proto, user, realm string, relay, peer net.Addr, ch uint16) {
			if r.current(src, dst, relay) {
				f(src, dst, proto, user, realm, relay, peer, ch)
			}
		}
	}
	if f := h.OnChannelDeleted; f != nil {
		h.OnChannelDeleted = func(src, dst net.Addr, proto, user, realm string, relay, peer net.Addr, ch uint16) {
			if r.current(src, dst, relay) {
				f(src, dst, proto, user, realm, relay, peer, ch)
			}
		}
	}
	return h
}

// current says whether a permission or channel hook with relay belongs to
// the live allocation of the five-tuple (or to none that replacements
// knows), not to one it replaced.
func (r *replacements) current(src, dst, relay net.Addr) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	a := r.live[allocKey{addrString(src), addrString(dst)}]
	return a == nil || a.relay == addrString(relay)
}
