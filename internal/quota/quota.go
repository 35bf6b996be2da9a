// Package quota bounds TURN allocations per user and in total, across every
// listener and read loop of the daemon (each runs its own pion/turn server,
// so no single pion server sees them all).
//
// pion/turn asks its QuotaHandler before it creates an allocation and
// answers a refusal with 486 (Allocation Quota Reached); it does not say
// whether the allocation it then tries to create succeeds. So a grant is a
// reservation, held per (server, client address) until the same server
// reports the outcome: OnAllocationCreated turns it into a live allocation,
// OnAllocationError (pion's report of a request that failed, e.g. 508 when no
// relay port is free) gives it back. A pion server handles one client
// address's requests one at a time, in its read loop (UDP) or its
// connection's (TCP), so the outcome that follows a grant on the same
// (server, client) is that grant's.
package quota

import (
	"net"
	"sync"
	"sync/atomic"
)

// Limits are the quotas; zero means no limit.
type Limits struct {
	// PerUser bounds the allocations of one user-id (STUNner's
	// admin.user_quota, --user-quota).
	PerUser int
	// Total bounds the daemon's allocations (--total-quota).
	Total int
}

// Reason says why an allocation was refused.
type Reason int

const (
	// Granted: not refused.
	Granted Reason = iota
	// UserQuota: the user-id holds PerUser allocations.
	UserQuota
	// TotalQuota: the daemon holds Total allocations.
	TotalQuota
	// Draining: the daemon takes no new allocations (graceful shutdown).
	Draining
)

// Reasons lists the refusal reasons, for metrics.
var Reasons = []Reason{UserQuota, TotalQuota, Draining}

func (r Reason) String() string {
	switch r {
	case UserQuota:
		return "user_quota"
	case TotalQuota:
		return "total_quota"
	case Draining:
		return "draining"
	default:
		return "granted"
	}
}

// Server identifies one pion/turn server of the daemon.
type Server uint64

// pendingKey names an allocation (or a request for one) by the pion server
// and the client address: pion's five-tuple, as each server has one socket
// (UDP) or the client one connection (TCP).
type pendingKey struct {
	server Server
	client string
}

// Counter counts the daemon's allocations per user-id and in total.
type Counter struct {
	mu      sync.Mutex
	limits  Limits
	users   map[string]int // live and reserved allocations per user-id
	total   int
	pending map[pendingKey]string // grants awaiting their outcome -> user-id
	live    map[pendingKey]string // live allocations -> user-id

	refused [Draining + 1]atomic.Uint64
	servers atomic.Uint64
}

// New returns a Counter with limits.
func New(limits Limits) *Counter {
	return &Counter{limits: limits, users: map[string]int{}, pending: map[pendingKey]string{}, live: map[pendingKey]string{}}
}

// NewServer returns an identity for one more pion/turn server.
func (c *Counter) NewServer() Server { return Server(c.servers.Add(1)) }

// SetLimits changes the limits; live allocations above new limits stay (a
// quota refuses new allocations, it never closes one).
func (c *Counter) SetLimits(l Limits) {
	c.mu.Lock()
	c.limits = l
	c.mu.Unlock()
}

// Limits returns the limits in force.
func (c *Counter) Limits() Limits {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.limits
}

// Reserve is pion's QuotaHandler for server: it grants an allocation to
// user-id user from client, or says why not.
func (c *Counter) Reserve(s Server, client net.Addr, user string) Reason {
	c.mu.Lock()
	defer c.mu.Unlock()
	k := pendingKey{s, client.String()}
	// A grant still pending on this (server, client) belongs to a request
	// whose outcome pion did not report (it cannot happen with pion v4.1's
	// handlers, which report both): do not let it hold a slot forever.
	if prev, ok := c.pending[k]; ok {
		c.releaseLocked(prev)
		delete(c.pending, k)
	}
	switch {
	case c.limits.Total > 0 && c.total >= c.limits.Total:
		c.refused[TotalQuota].Add(1)
		return TotalQuota
	case c.limits.PerUser > 0 && c.users[user] >= c.limits.PerUser:
		c.refused[UserQuota].Add(1)
		return UserQuota
	}
	c.users[user]++
	c.total++
	c.pending[k] = user
	return Granted
}

// Refuse counts a refusal decided elsewhere (Draining).
func (c *Counter) Refuse(r Reason) { c.refused[r].Add(1) }

// Created is server's OnAllocationCreated: the grant to client is a live
// allocation of user-id user.
func (c *Counter) Created(s Server, client net.Addr, user string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	k := pendingKey{s, client.String()}
	if _, ok := c.pending[k]; ok {
		delete(c.pending, k)
	} else {
		// Created without a grant (no QuotaHandler on that server): count it.
		c.users[user]++
		c.total++
	}
	c.live[k] = user
}

// Failed is server's OnAllocationError: a request from client failed; a
// grant it held is given back.
func (c *Counter) Failed(s Server, client net.Addr) { c.drop(c.pending, s, client) }

// Deleted is server's OnAllocationDeleted: client's allocation is gone. The
// user-id is the one it was counted under (a reload may change how usernames
// map to user-ids meanwhile).
func (c *Counter) Deleted(s Server, client net.Addr) { c.drop(c.live, s, client) }

// drop releases what m holds for (s, client), if anything.
func (c *Counter) drop(m map[pendingKey]string, s Server, client net.Addr) {
	c.mu.Lock()
	defer c.mu.Unlock()
	k := pendingKey{s, client.String()}
	if user, ok := m[k]; ok {
		delete(m, k)
		c.releaseLocked(user)
	}
}

func (c *Counter) releaseLocked(user string) {
	if c.users[user] <= 1 {
		delete(c.users, user)
	} else {
		c.users[user]--
	}
	c.total--
}

// Stats are the counts, for metrics and tests.
type Stats struct {
	// Allocations are live and reserved allocations; Users the user-ids
	// holding them.
	Allocations, Users int
	// Refused counts refusals by reason.
	Refused map[Reason]uint64
	// PermissionsRefused counts permissions refused for the per-allocation
	// limit (Permissions.Refused).
	PermissionsRefused uint64
}

// Stats returns the counts.
func (c *Counter) Stats() Stats {
	c.mu.Lock()
	st := Stats{Allocations: c.total, Users: len(c.users), Refused: map[Reason]uint64{}}
	c.mu.Unlock()
	for _, r := range Reasons {
		st.Refused[r] = c.refused[r].Load()
	}
	return st
}

// Live returns the live allocations counted for server s (not the
// reservations), to compare with what the server holds.
func (c *Counter) Live(s Server) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := 0
	for k := range c.live {
		if k.server == s {
			n++
		}
	}
	return n
}

// User returns user's live and reserved allocations.
func (c *Counter) User(user string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.users[user]
}
