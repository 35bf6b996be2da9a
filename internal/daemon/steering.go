package daemon

import (
	"time"

	"github.com/l7mp/stunnerd-xdp/internal/steering"
)

// openSteering joins the node's steering maps. Without them the listeners are
// bound exclusively, as before: everything works except a hitless overlap.
func (d *Daemon) openSteering() {
	if d.config().SteeringDir == "" {
		return
	}
	dir, err := steering.DirFor(d.config().SteeringDir)
	if err == nil {
		d.steer, err = steering.Open(dir)
	}
	if err != nil {
		d.log.Warn("no listener handover: a second daemon on this node cannot bind the TURN ports, so rolling updates are not hitless", "error", err)
		return
	}
	d.log.Info("listener handover on: sessions stay with their daemon, new ones go to the newest", "dir", dir)
}

// steerAssertInterval is how often the daemon re-takes the new flows of its
// listeners where nobody newer holds them (steering.Steering.Assert): the
// longest a node's new clients may be spread by the kernel's hash, some to a
// draining daemon, after the daemon holding them retired or died.
const steerAssertInterval = time.Second

// assertSteering runs Assert every steerAssertInterval until the daemon
// stops.
func (d *Daemon) assertSteering() {
	if d.steer == nil {
		return
	}
	log := d.config().Logger.Slog("steering")
	var failing bool
	d.wg.Add(1)
	go func() {
		defer d.wg.Done()
		d.tick(steerAssertInterval, func() bool {
			err := d.steer.Assert()
			if err != nil && !failing {
				log.Warn("cannot re-take the new flows of the listeners; retrying", "error", err)
			} else if err == nil && failing {
				log.Info("the listeners take the new flows again")
			}
			failing = err != nil
			return false
		})
	}()
}

// retire, at the start of a drain, stops new flows coming to this daemon's
// listeners (it refuses them anyway) so that a successor's registration shows.
func (d *Daemon) retire() {
	if d.steer == nil {
		return
	}
	if err := d.steer.Retire(); err != nil {
		d.log.Warn("steering", "error", err)
	}
}

func (d *Daemon) closeSteering() {
	if d.steer == nil {
		return
	}
	if err := d.steer.Close(); err != nil {
		d.log.Warn("closing the listener steering", "error", err)
	}
}
