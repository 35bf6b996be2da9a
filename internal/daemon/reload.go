package daemon

import (
	"errors"
	"fmt"
	"slices"

	"github.com/l7mp/stunnerd-xdp/internal/config"
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
	d.lmu.Lock() // one reload at a time, and the listeners with it
	defer d.lmu.Unlock()
	cur := *d.config()
	next.Logger = cur.Logger
	if err := next.validate(); err != nil {
		return fmt.Errorf("new configuration: %w", err)
	}
	var kept []string
	if next.RelayAddress != cur.RelayAddress {
		kept = append(kept, "relay address")
	}
	if next.MinRelayPort != cur.MinRelayPort || next.MaxRelayPort != cur.MaxRelayPort {
		kept = append(kept, "relay port range")
	}
	if next.MaxBindings != cur.MaxBindings {
		kept = append(kept, "max bindings")
	}
	if next.MetricsAddr != cur.MetricsAddr || next.HealthAddr != cur.HealthAddr {
		kept = append(kept, "metrics and health endpoints")
	}
	if len(next.Interfaces) > 0 && !slices.Equal(next.Interfaces, cur.Interfaces) {
		kept = append(kept, "XDP interfaces")
	}
	// What the daemon keeps from the running configuration.
	next.RelayAddress, next.MinRelayPort, next.MaxRelayPort = cur.RelayAddress, cur.MinRelayPort, cur.MaxRelayPort
	next.MaxBindings, next.MetricsAddr, next.HealthAddr, next.Interfaces = cur.MaxBindings, cur.MetricsAddr, cur.HealthAddr, cur.Interfaces
	next.SocketBuffer, next.ReconcileInterval, next.ChannelBindTimeout = cur.SocketBuffer, cur.ReconcileInterval, cur.ChannelBindTimeout
	next.PodAddr, next.PprofAddr = cur.PodAddr, cur.PprofAddr
	// The command line does not change under a running process.
	next.XDPMode, next.RateLimit = cur.XDPMode, cur.RateLimit

	realmChanged := next.Realm != cur.Realm
	d.cfg.Store(&next)
	d.traffic.SetListeners(next.trafficListeners())
	d.auth.Store(newAuthState(next, next.Logger))
	d.quota.SetLimits(next.quotaLimits())
	d.perms.SetLimit(next.MaxPermissions)

	var errs []error
	want := map[string]config.ResolvedListener{}
	for _, l := range next.Listeners {
		want[l.Name] = l
	}
	for name, ls := range d.listeners {
		if l, ok := want[name]; !ok || realmChanged || !ls.l.SameSocket(l) {
			errs = append(errs, d.stopListener(name))
		}
	}
	// Before the new listeners take allocations, which it learns from.
	d.dests.tracker.SetListeners(next.udpListenerAddrs())
	// Reprogram XDP for the new UDP ports before new listeners take traffic.
	if !slices.Equal(next.udpPorts(), cur.udpPorts()) {
		if err := d.xdp.Reconfigure(next.loaderConfig()); err != nil {
			errs = append(errs, fmt.Errorf("reprogram XDP for the new UDP listeners: %w", err))
		}
	}
	for _, l := range next.Listeners {
		if ls, ok := d.listeners[l.Name]; ok {
			// Revokes what the new policy, ranges or users no longer
			// allow: its channels leave the maps, its relay sockets drop
			// its datagrams (portState).
			ls.l = l
			ls.policy.Store(d.policyFor(l))
			d.setPeerPorts(&ls.ports, l.PeerPorts)
			continue
		}
		if err := d.startListener(l); err != nil {
			errs = append(errs, err)
		}
	}
	if next.ConfigXDPMode != cur.ConfigXDPMode {
		// Not a config problem: the manager logs it and retries the attach.
		if err := d.setConfigModeLocked(next.ConfigXDPMode); err != nil {
			d.log.Warn("config: XDP mode", "offload_engine", string(next.ConfigXDPMode), "mode", string(d.xdp.Mode()), "error", err)
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

// recheckPeers re-reads every listener's peer policy (the learned cluster
// networks changed): peers it refuses now are revoked as a reload revokes
// them. A fresh policy value makes the relay sockets' cached verdicts miss.
func (d *Daemon) recheckPeers() {
	d.lmu.Lock()
	defer d.lmu.Unlock()
	for _, ls := range d.listeners {
		ls.policy.Store(d.policyFor(ls.l))
		d.setPeerPorts(&ls.ports, ls.l.PeerPorts)
	}
}
