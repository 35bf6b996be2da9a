package daemon

import (
	"net"
	"time"

	"github.com/pion/turn/v4"

	"github.com/l7mp/stunnerd-xdp/internal/metrics"
	"github.com/l7mp/stunnerd-xdp/internal/quota"
)

// Quota returns the allocation quotas' and the permission limit's counts.
func (d *Daemon) Quota() quota.Stats {
	st := d.quota.Stats()
	st.PermissionsRefused = d.perms.Refused()
	return st
}

// Guards returns the counts of the TCP and TLS connection limits and of the
// request checks in front of pion (turnguard).
func (d *Daemon) Guards() metrics.Guards {
	return metrics.Guards{Conns: d.conns.Stats(), WrongCredentials: d.guarded.WrongCredentials.Load(),
		StaleNonces: d.guarded.StaleNonces.Load(), ChannelsRefused: d.guarded.ChannelsRefused.Load()}
}

// AutoQuota in Config.UserQuota or Config.TotalQuota asks for the default.
const AutoQuota = -1

// memoryLimit is the process's memory limit (a variable for tests).
var memoryLimit = quota.MemoryLimit

// resolveQuotas replaces AutoQuota with the defaults:
//   - the total quota is what the relay port range and the memory limit
//     allow (quota.DefaultTotal);
//   - the per-user quota is quota.DefaultPerUser when the credentials tell
//     users apart: ephemeral credentials (the user-id beside the expiry) or
//     more than one static user. With one static username every client is
//     the same user, and a per-user quota would be a second total quota:
//     none, and the total quota bounds them all.
func (c *Config) resolveQuotas() {
	if c.TotalQuota == AutoQuota {
		mem, err := memoryLimit()
		if err != nil {
			mem = 0 // the port range alone
		}
		c.TotalQuota = quota.DefaultTotal(int(c.MaxRelayPort)-int(c.MinRelayPort)+1, mem)
	}
	if c.UserQuota == AutoQuota {
		c.UserQuota = 0
		if c.Secret != "" || len(c.Users) > 1 {
			c.UserQuota = quota.DefaultPerUser
			if c.TotalQuota > 0 {
				c.UserQuota = min(c.UserQuota, c.TotalQuota)
			}
		}
	}
}

// quotaLimits are the configured quotas.
func (c *Config) quotaLimits() quota.Limits {
	return quota.Limits{PerUser: c.UserQuota, Total: c.TotalQuota}
}

// userID is the identity a user quota counts: the username, or for ephemeral
// (TURN REST API) credentials, EXPIRY:USERID or USERID:EXPIRY, the user-id
// beside the expiry (ephemeralUsername), so that fresh credentials for one
// user-id share its quota (as STUNner's UserQuota does for EXPIRY:USERID).
func (a *authState) userID(username string) string {
	if a.rest != nil {
		if _, id, ok := ephemeralUsername(username); ok {
			return id
		}
	}
	return username
}

// quotaHandler is pion's QuotaHandler for one of its servers: while draining
// and over a quota, new allocations get 486 (Allocation Quota Reached);
// existing ones keep refreshing and relaying.
func (d *Daemon) quotaHandler(s quota.Server) turn.QuotaHandler {
	return func(username, _ string, src net.Addr) bool {
		reason := quota.Draining
		if !d.draining.Load() {
			reason = d.quota.Reserve(s, src, d.auth.Load().userID(username))
		} else {
			d.quota.Refuse(reason)
		}
		if reason == quota.Granted {
			return true
		}
		// A credential holder can ask again and again: rate-limited.
		d.strangerLog.Info("allocation refused", "reason", reason.String(), "user", username, "client", src.String())
		return false
	}
}

// limitPermissions is the permission handler h of server s with the
// per-allocation permission limit after it.
func (d *Daemon) limitPermissions(s quota.Server, h turn.PermissionHandler) turn.PermissionHandler {
	return func(client net.Addr, peer net.IP) bool {
		if !h(client, peer) {
			return false
		}
		if d.perms.Allow(s, client, peer) {
			return true
		}
		d.strangerLog.Info("permission refused", "client", client.String(), "peer", peer.String(), "reason", "permission quota of the allocation")
		return false
	}
}

// withQuota tells the quota counter the outcome of what quotaHandler granted
// on server s, and when the allocations end; and the permission limit the
// permissions installed and gone.
func (d *Daemon) withQuota(s quota.Server, h turn.EventHandler) turn.EventHandler {
	permCreated, permDeleted := h.OnPermissionCreated, h.OnPermissionDeleted
	h.OnPermissionCreated = func(src, dst net.Addr, proto, user, realm string, relay net.Addr, peer net.IP) {
		d.perms.Created(s, src, peer)
		if permCreated != nil {
			permCreated(src, dst, proto, user, realm, relay, peer)
		}
	}
	h.OnPermissionDeleted = func(src, dst net.Addr, proto, user, realm string, relay net.Addr, peer net.IP) {
		d.perms.Deleted(s, src, peer)
		if permDeleted != nil {
			permDeleted(src, dst, proto, user, realm, relay, peer)
		}
	}
	created, deleted, failed := h.OnAllocationCreated, h.OnAllocationDeleted, h.OnAllocationError
	h.OnAllocationCreated = func(src, dst net.Addr, proto, user, realm string, relay net.Addr, port int) {
		d.quota.Created(s, src, d.auth.Load().userID(user))
		if created != nil {
			created(src, dst, proto, user, realm, relay, port)
		}
	}
	h.OnAllocationDeleted = func(src, dst net.Addr, proto, user, realm string) {
		d.quota.Deleted(s, src)
		// Permissions it held whose hooks replacements dropped go with it.
		d.perms.Forget(s, src)
		if deleted != nil {
			deleted(src, dst, proto, user, realm)
		}
	}
	h.OnAllocationError = func(src, dst net.Addr, proto, msg string) {
		d.quota.Failed(s, src)
		if failed != nil {
			failed(src, dst, proto, msg)
		}
	}
	return h
}

// quotaCheckInterval is how often the quota counts are compared with pion's.
const quotaCheckInterval = time.Minute

// checkQuotaCounts warns of the pion servers for which the quota counts
// more live allocations than the server holds, on two checks in a row with
// the same counts (a hook runs after pion's map changes, so one check may
// catch a deletion half-reported): slots leaked by a sequence of hooks the
// counter does not follow. seen carries the previous check's excess; it
// returns the listeners warned of.
func (d *Daemon) checkQuotaCounts(seen map[quota.Server][2]int) []string {
	d.lmu.Lock()
	defer d.lmu.Unlock()
	var warned []string
	now := map[quota.Server][2]int{}
	for _, ls := range d.listeners {
		for i, srv := range ls.servers {
			qs := ls.quotas[i]
			counts := [2]int{d.quota.Live(qs), srv.AllocationCount()}
			if counts[0] <= counts[1] {
				continue
			}
			if seen[qs] == counts {
				d.log.Warn("the quota counts allocations pion does not hold: their slots stay taken until a restart",
					"listener", ls.l.Name, "counted", counts[0], "pion", counts[1])
				warned = append(warned, ls.l.Name)
			}
			now[qs] = counts
		}
	}
	clear(seen)
	for k, v := range now {
		seen[k] = v
	}
	return warned
}
