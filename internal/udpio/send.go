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

// WriteConn is a UDP socket whose WriteTo is a raw sendto (see sender); pion
// writes the datagrams it relays to peers on such relay sockets.
type WriteConn struct {
	*net.UDPConn
	s *sender
}

// NewWriteConn wraps a UDP socket.
func NewWriteConn(pc net.PacketConn) (*WriteConn, error) {
	u, ok := pc.(*net.UDPConn)
	if !ok {
		return nil, ErrNotUDP
	}
	s, err := newSender(u)
	if err != nil {
		return nil, err
	}
	return &WriteConn{UDPConn: u, s: s}, nil
}

// WriteTo implements net.PacketConn.
func (c *WriteConn) WriteTo(p []byte, addr net.Addr) (int, error) {
	if n, ok, err := c.s.writeTo(c.UDPConn, p, addr); ok {
		return n, err
	}
	return c.UDPConn.WriteTo(p, addr)
}
