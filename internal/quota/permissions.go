package quota

import (
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
)

// Permissions bounds the peer IPs one allocation holds permissions for
// (--max-permissions). pion/turn asks its permission handler before each
// permission it installs, for CreatePermission and ChannelBind alike, and
// for a refresh as for a new one; it reports each new permission
// (OnPermissionCreated) before it asks about the next peer of the same
// request, and each one that expires or goes with its allocation
// (OnPermissionDeleted). So a peer IP the allocation holds already is a
// refresh, always allowed, and one more is allowed below the limit. A
// refusal is pion's answer to a refused peer: CreatePermission gets an error
// response (pion v4.1 sets no error code), ChannelBind 401.
type Permissions struct {
	mu    sync.Mutex
	limit int
	held  map[pendingKey]map[netip.Addr]struct{}

	refused atomic.Uint64
}

// NewPermissions bounds the permissions per allocation at limit (0: none).
func NewPermissions(limit int) *Permissions {
	return &Permissions{limit: limit, held: map[pendingKey]map[netip.Addr]struct{}{}}
}

// SetLimit changes the limit; permissions above a lower one stay until they
// expire.
func (p *Permissions) SetLimit(limit int) {
	p.mu.Lock()
	p.limit = limit
	p.mu.Unlock()
}

func peerKey(ip net.IP) netip.Addr {
	a, _ := netip.AddrFromSlice(ip)
	return a.Unmap()
}

// Allow is the permission handler's check for the allocation of client on
// server s.
func (p *Permissions) Allow(s Server, client net.Addr, peer net.IP) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	held := p.held[pendingKey{s, client.String()}]
	if _, ok := held[peerKey(peer)]; ok || p.limit <= 0 || len(held) < p.limit {
		return true
	}
	p.refused.Add(1)
	return false
}

// Created is server s's OnPermissionCreated.
func (p *Permissions) Created(s Server, client net.Addr, peer net.IP) {
	p.mu.Lock()
	defer p.mu.Unlock()
	k := pendingKey{s, client.String()}
	if p.held[k] == nil {
		p.held[k] = map[netip.Addr]struct{}{}
	}
	p.held[k][peerKey(peer)] = struct{}{}
}

// Deleted is server s's OnPermissionDeleted.
func (p *Permissions) Deleted(s Server, client net.Addr, peer net.IP) {
	p.mu.Lock()
	defer p.mu.Unlock()
	k := pendingKey{s, client.String()}
	delete(p.held[k], peerKey(peer))
	if len(p.held[k]) == 0 {
		delete(p.held, k)
	}
}

// Forget drops what the allocation of client on s held: it is gone.
func (p *Permissions) Forget(s Server, client net.Addr) {
	p.mu.Lock()
	defer p.mu.Unlock()
	delete(p.held, pendingKey{s, client.String()})
}

// Refused counts the permissions refused for the limit.
func (p *Permissions) Refused() uint64 { return p.refused.Load() }

// Held returns the permissions the allocation of client on s holds.
func (p *Permissions) Held(s Server, client net.Addr) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.held[pendingKey{s, client.String()}])
}
