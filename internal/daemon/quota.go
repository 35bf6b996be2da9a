package daemon

import (
	"time"

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

// quotaCheckInterval is how often the quota counts are compared with pion's.
const quotaCheckInterval = time.Minute
