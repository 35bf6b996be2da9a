package listener

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"sync"
	"syscall"

	"github.com/pion/dtls/v3"
	"github.com/pion/turn/v4"
	"golang.org/x/sys/unix"

	"github.com/l7mp/stunnerd-xdp/internal/config"
	"github.com/l7mp/stunnerd-xdp/internal/steering"
	"github.com/l7mp/stunnerd-xdp/internal/udpio"
)

// listenConfig makes the listener sockets: big buffers, SO_REUSEPORT when
// steering or when a listener has several sockets (shared, one per read loop),
// and plain TCP (Go picks MPTCP by default, which the reuseport array does not
// take).
func (s *Set) listenConfig(st Settings, shared bool) net.ListenConfig {
	reuse := s.deps.Steering != nil || shared
	buf := st.SocketBuffer
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

// listenUDP opens the sockets of a UDP listener, one per read loop, and
// registers them for steering.
func (s *Set) listenUDP(st Settings, ls *Listener, lc net.ListenConfig, network, addr string) ([]net.PacketConn, error) {
	conns := make([]net.PacketConn, st.ReadLoops)
	closeAll := func() {
		for _, c := range conns {
			if c != nil {
				c.Close()
			}
		}
	}
	if len(conns) > 1 && s.deps.Steering == nil {
		// Sockets bound with SO_REUSEPORT let any later one of the same user
		// join them, and a second daemon would take a share of the clients:
		// without the steering the port stays exclusive, as with one socket.
		// A bind without SO_REUSEPORT fails while anyone holds the port.
		excl := s.listenConfig(st, false)
		probe, err := excl.ListenPacket(context.Background(), network, addr)
		if err != nil {
			return nil, fmt.Errorf("listen on udp %v: %w", addr, err)
		}
		probe.Close()
	}
	scs := make([]syscall.Conn, len(conns))
	for i := range conns {
		c, err := lc.ListenPacket(context.Background(), network, addr)
		if err != nil {
			closeAll()
			return nil, fmt.Errorf("listen on udp %v (socket %d of %d): %w", addr, i+1, len(conns), err)
		}
		scs[i] = c.(*net.UDPConn)
		// pion reads one datagram per call; the socket underneath is read a
		// batch per recvmmsg, with no allocation per datagram.
		if conns[i], err = udpio.NewBatchConn(c); err != nil {
			c.Close()
			closeAll()
			return nil, err
		}
	}
	if err := s.steerSockets(ls, scs...); err != nil {
		closeAll()
		return nil, err
	}
	return conns, nil
}

// listenConns opens the socket of a listener whose clients are connections
// (TCP, TLS, DTLS) and registers it for steering. A DTLS listener's
// connections are its clients' UDP flows, each kept on this daemon's socket
// by the steering for its life.
func (s *Set) listenConns(ls *Listener, lc net.ListenConfig, tcp, udp string) (net.Listener, error) {
	l := ls.l
	if l.Protocol != config.DTLS {
		ln, err := lc.Listen(context.Background(), tcp, l.Addr.String())
		if err != nil {
			return nil, fmt.Errorf("listen on tcp %v: %w", l.Addr, err)
		}
		if err := s.steerSockets(ls, ln.(*net.TCPListener)); err != nil {
			ln.Close()
			return nil, err
		}
		return ln, nil
	}
	// pion/dtls binds the socket itself: its RawConn is taken in Control,
	// before the bind, to register it for steering after.
	var raw syscall.RawConn
	control := lc.Control
	lc.Control = func(network, address string, c syscall.RawConn) error {
		raw = c
		return control(network, address, c)
	}
	ln, err := dtls.ListenWithOptions(udp, net.UDPAddrFromAddrPort(l.Addr),
		dtls.WithCertificates(*l.Cert), dtls.WithListenConfig(lc),
		dtls.WithExtendedMasterSecret(dtls.RequireExtendedMasterSecret))
	if err != nil {
		return nil, fmt.Errorf("listen on dtls %v: %w", l.Addr, err)
	}
	if err := s.steerSockets(ls, rawConn{raw}); err != nil {
		ln.Close()
		return nil, err
	}
	if !ls.steered {
		return ln, nil
	}
	return &steeredListener{Listener: ln, s: s, ls: ls, log: s.deps.Logger.Slog("steering")}, nil
}

// rawConn is a socket known by its RawConn only.
type rawConn struct{ rc syscall.RawConn }

func (c rawConn) SyscallConn() (syscall.RawConn, error) { return c.rc, nil }

// steeredListener keeps each connection's client flow on this daemon's
// socket while the connection lives (a DTLS session a newer daemon on the
// node must not take over).
type steeredListener struct {
	net.Listener
	s   *Set
	ls  *Listener
	log *slog.Logger
}

func (l *steeredListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	client, ok := udpAddrPort(c.RemoteAddr())
	// Behind the gate, as the allocations' steering hooks: the maps close
	// with the daemon, while pion closes its connections after that.
	if !ok || !l.s.gate.enter() {
		return c, nil
	}
	defer l.s.gate.exit()
	if err := l.s.deps.Steering.AddFlow(l.ls.group, client, l.ls.slots[0]); err != nil {
		l.log.Warn("connection not steered: it breaks if a second daemon starts on this node while it lives", "error", err)
		return c, nil
	}
	return &steeredConn{Conn: c, l: l, client: client}, nil
}

type steeredConn struct {
	net.Conn
	l      *steeredListener
	client netip.AddrPort
	once   sync.Once
}

func (c *steeredConn) Close() error {
	c.once.Do(func() {
		if !c.l.s.gate.enter() {
			return // the daemon closed the steering
		}
		defer c.l.s.gate.exit()
		if err := c.l.s.deps.Steering.RemoveFlow(c.l.ls.group, c.client, c.l.ls.slots[0]); err != nil {
			c.l.log.Warn("steering", "error", err)
		}
	})
	return c.Conn.Close()
}

// steerSockets registers a listener's sockets for steering (a no-op without
// it).
func (s *Set) steerSockets(ls *Listener, cs ...syscall.Conn) error {
	if s.deps.Steering == nil {
		return nil
	}
	rcs := make([]syscall.RawConn, len(cs))
	for i, c := range cs {
		var err error
		if rcs[i], err = c.SyscallConn(); err != nil {
			return err
		}
	}
	ls.group = steering.Group{Protocol: steering.UDP, Addr: ls.l.Addr}
	if ls.l.Protocol == config.TCP || ls.l.Protocol == config.TLS {
		ls.group.Protocol = steering.TCP
	}
	slots, err := s.deps.Steering.RegisterSet(rcs, ls.group)
	if err != nil {
		return err
	}
	ls.slots, ls.steered = slots, true
	return nil
}

// unsteer stops new flows going to the listener's sockets.
func (s *Set) unsteer(ls *Listener) {
	if !ls.steered {
		return
	}
	for _, slot := range ls.slots {
		if err := s.deps.Steering.Unregister(slot); err != nil {
			s.log.Warn("steering", "listener", ls.l.Name, "error", err)
		}
	}
}

// flowHooks adds the steering of allocations to the hooks of the pion/turn
// server of the listener's i-th socket: the entry is written before pion
// answers the Allocate, so the client's next packet already comes to this
// daemon's socket that holds the allocation.
func (s *Set) flowHooks(ls *Listener, i int) stage {
	if !ls.steered || ls.group.Protocol != steering.UDP {
		return func(h turn.EventHandler) turn.EventHandler { return h }
	}
	log := s.deps.Logger.Slog("steering")
	slot := ls.slots[i]
	return func(h turn.EventHandler) turn.EventHandler {
		return onAllocations(h, func(c netip.AddrPort) {
			if err := s.deps.Steering.AddFlow(ls.group, c, slot); err != nil {
				log.Warn("allocation not steered: it breaks if a second daemon starts on this node while it lives", "error", err)
			}
		}, func(c netip.AddrPort) {
			if err := s.deps.Steering.RemoveFlow(ls.group, c, slot); err != nil {
				log.Warn("steering", "error", err)
			}
		})
	}
}

// allocationHooks records a UDP listener's allocations in the daemon's
// allocation table, which the listener shield reads, before pion answers the
// Allocate: the client's first ChannelData finds its allocation there. The
// table owns what a failed write means (it stops being complete).
func (s *Set) allocationHooks(ls *Listener) stage {
	t := s.deps.Allocations
	if t == nil || ls.l.Protocol != config.UDP {
		return func(h turn.EventHandler) turn.EventHandler { return h }
	}
	addr, log := ls.l.Addr, s.deps.Logger.Slog("shield")
	return func(h turn.EventHandler) turn.EventHandler {
		return onAllocations(h, func(c netip.AddrPort) {
			if err := t.Add(addr, c); err != nil {
				log.Warn("allocation not in the shield's table: the shield passes ChannelData of every client while it lives", "error", err)
			}
		}, func(c netip.AddrPort) {
			if err := t.Remove(addr, c); err != nil {
				log.Warn("shield table", "error", err)
			}
		})
	}
}

// destinationHooks reports a UDP listener's allocations to the tracker,
// which learns from conntrack the VIP a client came through. The tracker
// only queues them: pion/turn calls its hooks under its locks.
func (s *Set) destinationHooks(ls *Listener) stage {
	// The socket address is fixed for the listener's life (a new address
	// restarts it); a reload rewrites the rest of ls.l under the hooks.
	addr := ls.l.Addr
	return func(h turn.EventHandler) turn.EventHandler {
		return onAllocations(h,
			func(c netip.AddrPort) { s.deps.Destinations.AllocationCreated(c, addr) },
			func(c netip.AddrPort) { s.deps.Destinations.AllocationDeleted(c, addr) })
	}
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
