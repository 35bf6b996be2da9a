package daemon

import (
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"os"
	"syscall"
	"time"

	"github.com/pion/turn/v4"
	"golang.org/x/sys/unix"

	"github.com/l7mp/stunnerd-xdp/internal/config"
	"github.com/l7mp/stunnerd-xdp/internal/handover"
	"github.com/l7mp/stunnerd-xdp/internal/loader"
)

// A rolling update with surge runs the old and the new daemon side by side on
// a node. What they share, and how:
//
//   - listener ports: SO_REUSEPORT plus the steering program (internal/handover);
//     a client with an allocation stays with its daemon, new ones go to the
//     newest;
//   - the XDP hook: one program per interface, so the newcomer serves from
//     userspace and retries the attach until the old daemon has detached
//     (xdpRetry);
//   - the health and metrics ports: the newcomer retries the bind until the
//     old daemon is gone; probes use a per-pod unix socket meanwhile.

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

// listenConfig makes the listener sockets: big buffers, SO_REUSEPORT when
// steering or when a listener has several sockets (shared, one per read loop),
// and plain TCP (Go picks MPTCP by default, which the reuseport array does not
// take).
func (d *Daemon) listenConfig(shared bool) net.ListenConfig {
	reuse := d.steer != nil || shared
	buf := d.config().SocketBuffer
	lc := net.ListenConfig{Control: func(_, _ string, c syscall.RawConn) error {
		var serr error
		err := c.Control(func(fd uintptr) {
			// Bigger buffers absorb bursts on the userspace path; FORCE works
			// as root beyond net.core.rmem_max.
			_ = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_RCVBUFFORCE, buf)
			_ = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_SNDBUFFORCE, buf)
			if reuse {
				serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_REUSEPORT, 1)
			}
		})
		if err != nil {
			return err
		}
		return serr
	}}
	lc.SetMultipathTCP(false)
	return lc
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

// xdpRetry re-attaches XDP where it is wanted but not attached: another
// daemon's program still holds the interface during a rolling update, or the
// interface came later, or was deleted and created again. It runs every
// interval and at once on a link event. Sessions are served from userspace
// meanwhile.
func (d *Daemon) xdpRetry(every time.Duration) {
	d.tickOr(every, d.linkEvents, func() bool {
		d.modeMu.Lock()
		defer d.modeMu.Unlock()
		if mode := d.wantMode(); mode != loader.ModeOff && len(d.sw.Missing()) > 0 {
			_, _ = d.sw.Enable(mode) // the switch logs what changed
			d.syncDestinations()
		}
		return false
	})
}

// tick calls f every interval until it returns true or the daemon stops.
func (d *Daemon) tick(every time.Duration, f func() bool) { d.tickOr(every, nil, f) }

// tickOr is tick that also calls f whenever wake fires.
func (d *Daemon) tickOr(every time.Duration, wake <-chan struct{}, f func() bool) {
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-d.stop:
			return
		case <-t.C:
		case <-wake:
		}
		if f() {
			return
		}
	}
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

// handOverXDP gives the XDP hook to a newer daemon on the node once one serves
// our listeners: this daemon's live sessions move to pion/turn in userspace
// (the switch loses nothing), and the newcomer's retry attaches its program
// within XDPRetryInterval, so the sessions of the rest of the drain, all of
// them new ones, run in the kernel. Without a successor (a plain stop) XDP
// stays until exit. Called periodically while draining.
func (d *Daemon) handOverXDP() {
	if d.steer == nil {
		return
	}
	d.modeMu.Lock()
	defer d.modeMu.Unlock()
	if d.handedOver {
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
	d.handedOver = true
	d.want.Store(loader.ModeOff) // and the attach retry stops
	if len(d.sw.Attached()) == 0 {
		return
	}
	d.log.Info("another daemon serves this node: handing XDP over to it, live sessions continue in userspace",
		"allocations", d.AllocationCount())
	if err := d.sw.Disable(); err != nil {
		d.log.Warn("detaching XDP for the successor", "error", err)
	}
}

// serve starts an HTTP server on addr; while the port is taken (the previous
// daemon on this node is still draining) it retries in the background.
func (d *Daemon) serve(addr string, h http.Handler, what string) error {
	if addr == "" {
		return nil
	}
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 5 * time.Second}
	d.https = append(d.https, srv)
	listen := func() error {
		ln, err := net.Listen("tcp", addr)
		if err != nil {
			return err
		}
		go func() { _ = srv.Serve(ln) }()
		d.log.Info(what+" endpoint listening", "addr", ln.Addr().String())
		return nil
	}
	err := listen()
	if err == nil {
		return nil
	}
	if !errors.Is(err, syscall.EADDRINUSE) {
		return fmt.Errorf("%s endpoint on %s: %w", what, addr, err)
	}
	d.log.Warn(what+" endpoint busy, retrying until it is free (another stunnerd-xdp on this node?)", "addr", addr)
	d.wg.Add(1)
	go func() {
		defer d.wg.Done()
		d.tick(time.Second, func() bool { return listen() == nil })
	}()
	return nil
}

// serveUnix serves the health endpoints on a unix socket: it answers for this
// process only, which is what a probe needs while two daemons share the node's
// network namespace (`stunnerd-xdp probe` is its client).
func (d *Daemon) serveUnix(path string, h http.Handler) error {
	if path == "" {
		return nil
	}
	if fi, err := os.Lstat(path); err == nil && fi.Mode()&os.ModeSocket != 0 {
		_ = os.Remove(path) // left by a daemon that was killed
	}
	ln, err := net.Listen("unix", path)
	if err != nil {
		return fmt.Errorf("health socket: %w", err)
	}
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 5 * time.Second}
	d.https = append(d.https, srv)
	go func() { _ = srv.Serve(ln) }()
	d.log.Info("health socket listening", "path", path)
	return nil
}
