package daemon

import (
	"time"
)

// A rolling update with surge runs the old and the new daemon side by side on
// a node. What they share, and how:
//
//   - listener ports: SO_REUSEPORT plus the steering program (internal/steering);
//     a client with an allocation stays with its daemon, new ones go to the
//     newest;
//   - the XDP hook: one program per interface, so the newcomer's TC engine
//     relays its sessions there (loader.Engines, ModeTC) and it retries the
//     XDP attach until the old daemon has detached (attachretry.go);
//   - the health and metrics ports: the newcomer retries the bind until the
//     old daemon is gone (internal/endpoints); probes use a per-pod unix socket
//     meanwhile (Endpoints.ServeUnix).

// After SIGTERM a daemon is in one of three states (internal/steering's
// package comment has the steering side):
//
//   - draining, alone: no newer daemon serves the node (a plain stop, or
//     the successor has not started yet): new allocations are refused, XDP
//     stays until exit;
//   - draining for a successor: a newer daemon takes the new flows; this one
//     hands XDP over to it (HandOver) and relays its own sessions until they
//     end with its TC engine behind the newcomer's XDP program (in
//     userspace without a TC engine);
//   - standing in: the successor it drained for is dead (killed, crashed)
//     and no newer daemon lives on the node: the node must not be left without
//     service, so this daemon takes new allocations again, is ready, takes
//     the new flows back (Unretire) and XDP (TakeBack), and exits only when
//     the grace period ends. A successor that starts again (its container
//     restarts) puts it back to draining for it.
//
// A successor that is alive but draining itself (both pods deleted, a node
// drain) is not stood in for. The successor is looked at every
// successorCheck; it counts as gone after successorGoneChecks looks in a row
// found no live socket of a newer daemon.
const (
	successorCheck      = time.Second
	successorGoneChecks = 2
)

// followSuccessor moves between the states above. Called periodically while
// stopping, from one goroutine.
func (d *Daemon) followSuccessor() {
	if d.steer == nil {
		return
	}
	ok, err := d.steer.Successor()
	if err != nil {
		d.log.Warn("cannot tell whether another daemon serves this node; staying as we are", "error", err)
		return
	}
	switch {
	case ok:
		d.successorGone = 0
		if !d.draining.Load() {
			d.draining.Store(true)
			d.log.Info("a newer daemon serves this node again: draining for it", "allocations", d.AllocationCount())
			d.retire()
		}
		d.handOverXDP()
	case d.xdp.HandedOver(): // even with XDP off: it marks the drain for a successor
		// A successor that drains too (its pod deleted as well, as in a
		// node drain) is alive: both go. Only a dead one is stood in for.
		newer, err := d.steer.Newer()
		if err != nil {
			d.log.Warn("cannot tell whether a newer daemon lives on this node; staying as we are", "error", err)
			return
		}
		if newer {
			d.successorGone = 0
			return
		}
		if d.successorGone++; d.successorGone < successorGoneChecks {
			return
		}
		d.standIn()
	}
}

// standIn serves new allocations again: the successor is gone.
func (d *Daemon) standIn() {
	d.successorGone = 0
	d.draining.Store(false)
	d.log.Warn("the newer daemon on this node is gone: taking new allocations and XDP back until one serves again",
		"allocations", d.AllocationCount())
	if err := d.steer.Unretire(); err != nil {
		d.log.Warn("steering: taking the new flows back", "error", err)
	}
	if _, err := d.xdp.TakeBack(); err != nil {
		d.log.Warn("XDP not attached after taking it back; retrying", "error", err)
	}
}

// handOverXDP gives the XDP hook to a newer daemon on the node once one serves
// our listeners: this daemon's live sessions stay in the kernel with its TC
// engine (offload.Yielder; without one they move to pion/turn in userspace,
// the mirror losing nothing), and the newcomer's retry attaches its program
// within XDPRetryInterval, so the sessions of the rest of the drain, all of
// them new ones, run on XDP. Without a successor (a plain stop) XDP stays
// until exit.
func (d *Daemon) handOverXDP() {
	if d.xdp.HandedOver() {
		return
	}
	wasAttached, err := d.xdp.HandOver()
	switch {
	case wasAttached && len(d.xdp.Attached()) > 0:
		d.log.Info("another daemon serves this node: XDP handed over to it, live sessions continue in the kernel with the TC engine",
			"allocations", d.AllocationCount())
	case wasAttached:
		d.log.Info("another daemon serves this node: XDP handed over to it, live sessions continue in userspace",
			"allocations", d.AllocationCount())
	}
	if err != nil {
		d.log.Warn("detaching XDP for the successor", "error", err)
	}
}

// Drain starts a graceful shutdown: new allocations are refused, existing ones
// keep relaying on whichever path they are, /ready fails (unless
// ForceReady) and /status says TERMINATING. The returned channel closes when the
// last allocation is gone while draining (not while standing in for a dead
// successor); the caller decides how long to wait for it.
func (d *Daemon) Drain() <-chan struct{} {
	if d.stopping.CompareAndSwap(false, true) {
		d.draining.Store(true)
		d.log.Info("draining: new allocations are refused, live ones keep relaying",
			"allocations", d.AllocationCount())
		d.retire()
		d.wg.Add(1)
		go func() {
			defer d.wg.Done()
			d.followSuccessor()
			const every = 100 * time.Millisecond
			t := time.NewTicker(every)
			defer t.Stop()
			for i := 1; ; i++ {
				if i%int(successorCheck/every) == 0 {
					d.followSuccessor() // a successor may start, or die, after the drain began
				}
				if d.draining.Load() && d.AllocationCount() == 0 {
					close(d.drained)
					return
				}
				select {
				case <-d.stop:
					return
				case <-t.C:
				}
			}
		}()
	}
	return d.drained
}

// Draining reports whether the daemon refuses new allocations: Drain was
// called and it does not stand in for a dead successor.
func (d *Daemon) Draining() bool { return d.draining.Load() }
