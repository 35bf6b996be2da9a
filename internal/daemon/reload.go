package daemon

import (
	"errors"
	"fmt"
	"slices"
)

// ErrNeedsRestart: a reload changed settings only a restart applies (relay
// address and ports, maximum bindings, endpoints, interfaces); the running
// ones are kept and the rest of the reload is applied.
var ErrNeedsRestart = errors.New("changing them needs a restart")

// Reconfigure applies a new configuration to the running daemon without
// dropping the sessions the change does not touch:
//   - credentials change in place; the allocations of a static user the new
//     configuration removes stop relaying at once (their channels leave the
//     maps, their relay sockets drop datagrams) and end when their clients
//     fail to refresh them;
//   - peers the new peer policy (clusters, --allow-peer) or port ranges no
//     longer admit stop relaying at once, on both paths;
//   - a listener whose socket is unchanged keeps running; its peer allowlist
//     and peer port ranges change in place;
//   - added listeners start, removed ones stop (closing their allocations),
//     changed ones (address, port, protocol, certificate) restart;
//   - the XDP program is reloaded over the same maps when the UDP listener
//     ports change, and swapped into its links atomically;
//   - a realm change restarts every listener (pion/turn keys on the realm);
//   - the config's XDP mode goes to the offload manager, where the node
//     label and --xdp-mode outrank it.
//
// Settings that only a restart can change (relay address and ports, maximum
// bindings, metrics and health addresses, interfaces) are kept, with an
// ErrNeedsRestart naming them; everything else is applied.
func (d *Daemon) Reconfigure(next Config) error {
	d.lmu.Lock() // one reload at a time
	defer d.lmu.Unlock()
	cur := d.config()
	next.Logger = cur.Logger
	if err := next.validate(); err != nil {
		return fmt.Errorf("new configuration: %w", err)
	}
	kept := next.keepRunning(cur)
	// What the reload hands on, all of it derived from next here.
	var (
		settings, creds, limits    = next.listenerSettings(), next.credentials(), next.quotaLimits()
		traffic, udpAddrs, program = next.trafficListeners(), next.udpListenerAddrs(), d.program(&next)
		reprogram                  = !slices.Equal(next.udpPorts(), cur.udpPorts())
		restartAll                 = next.Realm != cur.Realm // pion/turn keys on the realm
		mode                       = next.ConfigXDPMode
		modeChanged                = mode != cur.ConfigXDPMode
	)
	d.cfg.Store(&next)
	d.traffic.SetListeners(traffic)
	d.creds.Replace(creds)
	d.quota.SetLimits(limits)
	d.perms.SetLimit(next.MaxPermissions)

	errs := []error{d.listeners.Prune(next.Listeners, restartAll)}
	// Before the new listeners take allocations, which it learns from.
	d.dests.tracker.SetListeners(udpAddrs)
	// Reprogram XDP for the new UDP ports before new listeners take traffic.
	if reprogram {
		if err := d.xdp.Reconfigure(program); err != nil {
			errs = append(errs, fmt.Errorf("reprogram XDP for the new UDP listeners: %w", err))
		}
	}
	// Revokes what the new policy, ranges or users no longer allow: their
	// channels leave the maps, their relay sockets drop their datagrams.
	errs = append(errs, d.listeners.Apply(settings, next.Listeners))
	if modeChanged {
		// Not a config problem: the manager logs it and retries the attach.
		if err := d.xdp.SetConfig(mode); err != nil {
			d.log.Warn("config: XDP mode", "offload_engine", string(mode), "mode", string(d.xdp.Mode()), "error", err)
		}
	}
	if len(kept) > 0 {
		errs = append(errs, fmt.Errorf("%w: kept the running %v", ErrNeedsRestart, kept))
	}
	if err := errors.Join(errs...); err != nil {
		d.log.Warn("configuration reloaded with problems", "error", err)
		return err
	}
	d.log.Info("configuration reloaded", "listeners", len(next.Listeners))
	return nil
}
