package udpio

import (
	"net"
	"os"
	"sync"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// sender writes datagrams with a raw sendto. A UDP send on these
// non-blocking sockets never waits (EAGAIN goes back to the runtime's poller),
// but to a local receiver, such as a veth peer, it delivers inline, in
// softirq, for several microseconds. Through Go's syscall.Syscall the
// thread's P sits in the syscall state meanwhile, the runtime's monitor
// keeps waking every 20 µs to take such Ps back, and hands them to another
// thread: a context switch per packet or two on a loaded relay. A raw system
// call keeps the P, as an event loop in C would.
type sender struct {
	rc     syscall.RawConn
	family int // AF_INET or AF_INET6: the socket's

	mu    sync.Mutex
	p     []byte
	sa4   unix.RawSockaddrInet4
	sa6   unix.RawSockaddrInet6
	sa    unsafe.Pointer
	salen uintptr
	n     int
	errno syscall.Errno
	send  func(fd uintptr) bool // s.sendto, bound once
}

func newSender(c *net.UDPConn) (*sender, error) {
	rc, err := c.SyscallConn()
	if err != nil {
		return nil, err
	}
	s := &sender{rc: rc, family: unix.AF_INET}
	var serr error
	if err := rc.Control(func(fd uintptr) { s.family, serr = unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_DOMAIN) }); err != nil {
		return nil, err
	}
	if serr != nil {
		return nil, os.NewSyscallError("getsockopt", serr)
	}
	s.send = s.sendto
	return s, nil
}

func (s *sender) sendto(fd uintptr) bool {
	var p unsafe.Pointer
	if len(s.p) > 0 {
		p = unsafe.Pointer(&s.p[0])
	}
	for {
		r, _, errno := unix.RawSyscall6(unix.SYS_SENDTO, fd, uintptr(p), uintptr(len(s.p)), unix.MSG_DONTWAIT, uintptr(s.sa), s.salen)
		switch errno {
		case unix.EINTR:
			continue
		case unix.EAGAIN:
			return false
		}
		s.n, s.errno = int(r), errno
		return true
	}
}

// writeTo sends p to a, or reports false when a is not an address it takes
// (the caller then uses Go's own WriteTo, which also reports the errors).
func (s *sender) writeTo(c *net.UDPConn, p []byte, addr net.Addr) (int, bool, error) {
	a, ok := addr.(*net.UDPAddr)
	if !ok {
		return 0, false, nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	port := uint16(a.Port)
	if ip4 := a.IP.To4(); ip4 != nil && s.family == unix.AF_INET {
		s.sa4 = unix.RawSockaddrInet4{Family: unix.AF_INET, Port: port<<8 | port>>8}
		copy(s.sa4.Addr[:], ip4)
		s.sa, s.salen = unsafe.Pointer(&s.sa4), unix.SizeofSockaddrInet4
	} else if len(a.IP) == net.IPv6len && s.family == unix.AF_INET6 && a.Zone == "" {
		s.sa6 = unix.RawSockaddrInet6{Family: unix.AF_INET6, Port: port<<8 | port>>8}
		copy(s.sa6.Addr[:], a.IP)
		s.sa, s.salen = unsafe.Pointer(&s.sa6), unix.SizeofSockaddrInet6
	} else {
		return 0, false, nil // a zone, a 4-byte IP on an IPv6 socket, ...: Go's conversion
	}
	s.p = p
	err := s.rc.Write(s.send)
	s.p = nil
	if err == nil && s.errno != 0 {
		err = os.NewSyscallError("sendto", s.errno)
	}
	if err != nil {
		return 0, true, &net.OpError{Op: "write", Net: "udp", Source: c.LocalAddr(), Addr: a, Err: err}
	}
	return s.n, true, nil
}

// Conn is a UDP socket read and written with raw non-blocking recvfrom and
// sendto (see sender), with no allocation per datagram: pion reads what peers
// send to a relay socket and writes what it relays to them on such sockets.
// Unlike BatchConn it reads straight into the caller's buffer, one datagram
// per call, so that the many relay sockets cost no buffer of their own.
type Conn struct {
	*net.UDPConn
	s *sender

	mu    sync.Mutex // ReadFrom
	rc    syscall.RawConn
	p     []byte
	name  unix.RawSockaddrInet6
	n     int
	errno syscall.Errno
	recv  func(fd uintptr) bool // c.recvfrom, bound once
	addrs sources
}

// NewConn wraps a UDP socket.
func NewConn(pc net.PacketConn) (*Conn, error) {
	u, ok := pc.(*net.UDPConn)
	if !ok {
		return nil, ErrNotUDP
	}
	s, err := newSender(u)
	if err != nil {
		return nil, err
	}
	c := &Conn{UDPConn: u, s: s, rc: s.rc, addrs: newSources(relaySources, false)}
	c.recv = c.recvfrom
	return c, nil
}

func (c *Conn) recvfrom(fd uintptr) bool {
	var p unsafe.Pointer
	if len(c.p) > 0 {
		p = unsafe.Pointer(&c.p[0])
	}
	for {
		namelen := uint32(unix.SizeofSockaddrInet6)
		r, _, errno := unix.RawSyscall6(unix.SYS_RECVFROM, fd, uintptr(p), uintptr(len(c.p)), unix.MSG_DONTWAIT,
			uintptr(unsafe.Pointer(&c.name)), uintptr(unsafe.Pointer(&namelen)))
		switch errno {
		case unix.EINTR:
			continue
		case unix.EAGAIN:
			return false
		}
		c.n, c.errno = int(r), errno
		return true
	}
}

// ReadFrom implements net.PacketConn.
func (c *Conn) ReadFrom(p []byte) (int, net.Addr, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.p = p
	err := c.rc.Read(c.recv)
	c.p = nil
	if err == nil && c.errno != 0 {
		err = os.NewSyscallError("recvfrom", c.errno)
	}
	if err != nil {
		return 0, nil, &net.OpError{Op: "read", Net: "udp", Source: c.LocalAddr(), Err: err}
	}
	return c.n, c.addrs.get(&c.name), nil
}

// WriteTo implements net.PacketConn.
func (c *Conn) WriteTo(p []byte, addr net.Addr) (int, error) {
	if n, ok, err := c.s.writeTo(c.UDPConn, p, addr); ok {
		return n, err
	}
	return c.UDPConn.WriteTo(p, addr)
}
