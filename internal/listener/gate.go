package listener

import (
	"net"
	"sync"

	"github.com/pion/turn/v4"
)

// gate shuts pion/turn's event hooks off when the daemon closes what they
// write to (the mirror, the steering maps): pion reports the deletion of the
// allocations it closes from their own goroutines, after Server.Close has
// returned.
type gate struct {
	mu     sync.RWMutex
	closed bool
}

// close waits for the hooks running now; later ones do nothing.
func (g *gate) close() {
	g.mu.Lock()
	g.closed = true
	g.mu.Unlock()
}

// enter says whether a hook may run; if so, exit must follow.
func (g *gate) enter() bool {
	g.mu.RLock()
	if g.closed {
		g.mu.RUnlock()
		return false
	}
	return true
}

func (g *gate) exit() { g.mu.RUnlock() }

// wrap puts the hooks of h that reach the mirror or the steering behind the
// gate.
func (g *gate) wrap(h turn.EventHandler) turn.EventHandler {
	if f := h.OnAllocationCreated; f != nil {
		h.OnAllocationCreated = func(src, dst net.Addr, proto, user, realm string, relay net.Addr, port int) {
			if g.enter() {
				defer g.exit()
				f(src, dst, proto, user, realm, relay, port)
			}
		}
	}
	if f := h.OnAllocationDeleted; f != nil {
		h.OnAllocationDeleted = func(src, dst net.Addr, proto, user, realm string) {
			if g.enter() {
				defer g.exit()
				f(src, dst, proto, user, realm)
			}
		}
	}
	if f := h.OnPermissionCreated; f != nil {
		h.OnPermissionCreated = func(src, dst net.Addr, proto, user, realm string, relay net.Addr, peer net.IP) {
			if g.enter() {
				defer g.exit()
				f(src, dst, proto, user, realm, relay, peer)
			}
		}
	}
	if f := h.OnPermissionDeleted; f != nil {
		h.OnPermissionDeleted = func(src, dst net.Addr, proto, user, realm string, relay net.Addr, peer net.IP) {
			if g.enter() {
				defer g.exit()
				f(src, dst, proto, user, realm, relay, peer)
			}
		}
	}
	if f := h.OnChannelCreated; f != nil {
		h.OnChannelCreated = func(src, dst net.Addr, proto, user, realm string, relay, peer net.Addr, ch uint16) {
			if g.enter() {
				defer g.exit()
				f(src, dst, proto, user, realm, relay, peer, ch)
			}
		}
	}
	if f := h.OnChannelDeleted; f != nil {
		h.OnChannelDeleted = func(src, dst net.Addr, proto, user, realm string, relay, peer net.Addr, ch uint16) {
			if g.enter() {
				defer g.exit()
				f(src, dst, proto, user, realm, relay, peer, ch)
			}
		}
	}
	return h
}
