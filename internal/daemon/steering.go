package daemon

import (
	"net"
	"net/netip"
	"syscall"
	"time"

	"github.com/pion/turn/v4"

	"github.com/l7mp/stunnerd-xdp/internal/config"
	"github.com/l7mp/stunnerd-xdp/internal/handover"
)

// openSteering joins the node's steering maps. Without them the listeners are
// bound exclusively, as before: everything works except a hitless overlap.
func (d *Daemon) openSteering() {
	if d.config().HandoverDir == "" {
		return
	}
	dir, err := handover.DirFor(d.config().HandoverDir)
	if err == nil {
		d.steer, err = handover.Open(dir)
	}
	if err != nil {
		d.log.Warn("no listener handover: a second daemon on this node cannot bind the TURN ports, so rolling updates are not hitless", "error", err)
		return
	}
	d.log.Info("listener handover on: sessions stay with their daemon, new ones go to the newest", "dir", dir)
}

// steerAssertInterval is how often the daemon re-takes the new flows of its
// listeners where nobody newer holds them (handover.Steering.Assert): the
// longest a node's new clients may be spread by the kernel's hash, some to a
// draining daemon, after the daemon holding them retired or died.
const steerAssertInterval = time.Second

// assertSteering runs Assert every steerAssertInterval until the daemon
// stops.
func (d *Daemon) assertSteering() {
	if d.steer == nil {
		return
	}
	log := d.config().Logger.Slog("handover")
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

// steerSockets registers a listener's sockets for steering (a no-op without
// it).
func (d *Daemon) steerSockets(ls *listenerServer, cs ...syscall.Conn) error {
	if d.steer == nil {
		return nil
	}
	rcs := make([]syscall.RawConn, len(cs))
	for i, c := range cs {
		var err error
		if rcs[i], err = c.SyscallConn(); err != nil {
			return err
		}
	}
	ls.group = handover.Group{Protocol: handover.UDP, Addr: ls.l.Addr}
	if ls.l.Protocol != config.UDP {
		ls.group.Protocol = handover.TCP
	}
	slots, err := d.steer.RegisterSet(rcs, ls.group)
	if err != nil {
		return err
	}
	ls.slots, ls.steered = slots, true
	return nil
}

// unsteer stops new flows going to the listener's sockets.
func (d *Daemon) unsteer(ls *listenerServer) {
	if !ls.steered {
		return
	}
	for _, slot := range ls.slots {
		if err := d.steer.Unregister(slot); err != nil {
			d.log.Warn("steering", "listener", ls.l.Name, "error", err)
		}
	}
}

// withFlows adds the steering of allocations to the hooks of the pion/turn
// server of the listener's i-th socket: the entry is written before pion
// answers the Allocate, so the client's next packet already comes to this
// daemon's socket that holds the allocation.
func (d *Daemon) withFlows(ls *listenerServer, i int, h turn.EventHandler) turn.EventHandler {
	if !ls.steered || ls.group.Protocol != handover.UDP {
		return h
	}
	log := d.config().Logger.Slog("handover")
	slot := ls.slots[i]
	return onAllocations(h, func(c netip.AddrPort) {
		if err := d.steer.AddFlow(ls.group, c, slot); err != nil {
			log.Warn("allocation not steered: it breaks if a second daemon starts on this node while it lives", "error", err)
		}
	}, func(c netip.AddrPort) {
		if err := d.steer.RemoveFlow(ls.group, c, slot); err != nil {
			log.Warn("steering", "error", err)
		}
	})
}

// onAllocations runs created and deleted with the client's address before
// h's own allocation hooks.
func onAllocations(h turn.EventHandler, created, deleted func(client netip.AddrPort)) turn.EventHandler {
	nextCreated, nextDeleted := h.OnAllocationCreated, h.OnAllocationDeleted
	h.OnAllocationCreated = func(src, dst net.Addr, proto, user, realm string, relay net.Addr, port int) {
		if c, ok := udpAddrPort(src); ok {
			created(c)
		}
		if nextCreated != nil {
			nextCreated(src, dst, proto, user, realm, relay, port)
		}
	}
	h.OnAllocationDeleted = func(src, dst net.Addr, proto, user, realm string) {
		if c, ok := udpAddrPort(src); ok {
			deleted(c)
		}
		if nextDeleted != nil {
			nextDeleted(src, dst, proto, user, realm)
		}
	}
	return h
}

func udpAddrPort(a net.Addr) (netip.AddrPort, bool) {
	u, ok := a.(*net.UDPAddr)
	if !ok {
		return netip.AddrPort{}, false
	}
	return u.AddrPort(), true
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
