package daemon

import (
	"time"
)

// A rolling update with surge runs the old and the new daemon side by side on
// a node. What they share, and how:
//
//   - listener ports: SO_REUSEPORT plus the steering program (internal/handover);
//     a client with an allocation stays with its daemon, new ones go to the
//     newest;
//   - the XDP hook: one program per interface, so the newcomer serves from
//     userspace and retries the attach until the old daemon has detached
//     (attachretry.go);
//   - the health and metrics ports: the newcomer retries the bind until the
//     old daemon is gone (httpserve.go); probes use a per-pod unix socket meanwhile
//     (healthsocket.go).

// handOverXDP gives the XDP hook to a newer daemon on the node once one serves
// our listeners: this daemon's live sessions move to pion/turn in userspace
// (the mirror loses nothing), and the newcomer's retry attaches its program
// within XDPRetryInterval, so the sessions of the rest of the drain, all of
// them new ones, run in the kernel. Without a successor (a plain stop) XDP
// stays until exit. Called periodically while draining.
func (d *Daemon) handOverXDP() {
	if d.steer == nil || d.xdp.HandedOver() {
		return
	}
	ok, err := d.steer.Successor()
	if err != nil {
		d.log.Warn("cannot tell whether another daemon serves this node; keeping XDP", "error", err)
		return
	}
	if !ok {
		return
	}
	wasAttached, err := d.xdp.HandOver()
	if wasAttached {
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
// last allocation is gone; the caller decides how long to wait for it.
func (d *Daemon) Drain() <-chan struct{} {
	if d.draining.CompareAndSwap(false, true) {
		d.log.Info("draining: new allocations are refused, live ones keep relaying",
			"allocations", d.AllocationCount())
		d.retire()
		d.handOverXDP()
		d.wg.Add(1)
		go func() {
			defer d.wg.Done()
			t := time.NewTicker(100 * time.Millisecond)
			defer t.Stop()
			for i := 0; ; i++ {
				if i%10 == 9 {
					d.handOverXDP() // a successor may start after the drain began
				}
				if d.AllocationCount() == 0 {
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

// Draining reports whether Drain was called.
func (d *Daemon) Draining() bool { return d.draining.Load() }
