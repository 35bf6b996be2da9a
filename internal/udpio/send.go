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
	// A send with fields is a sendmsg with control messages.
	ctl     [controlSize]byte
	ctllen  int
	iov     unix.Iovec
	msg     unix.Msghdr
	sendMsg func(fd uintptr) bool // s.sendmsg, bound once
	// batch, when armed (Conn.Defer), takes the next write, labelled tag.
	batch *SendBatch
	tag   int
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
	s.send, s.sendMsg = s.sendto, s.sendmsg
	return s, nil
}

// sendmsg is sendto with the control messages in s.ctl.
func (s *sender) sendmsg(fd uintptr) bool {
	return msgCall(unix.SYS_SENDMSG, fd, &s.msg, &s.iov, s.p, (*byte)(s.sa), uint32(s.salen), s.ctl[:s.ctllen], &s.n, &s.errno)
}

// msgCall makes a raw non-blocking sendmsg or recvmsg (sysno) of one buffer p
// with the address name and control messages ctl, in msg and iov (which must
// outlive the call, as the caller's fields do), and stores its result in n and
// errno; false: EAGAIN (see sender.sendto).
func msgCall(sysno, fd uintptr, msg *unix.Msghdr, iov *unix.Iovec, p []byte, name *byte, namelen uint32, ctl []byte, n *int, errno *syscall.Errno) bool {
	*iov = unix.Iovec{}
	if len(p) > 0 {
		iov.Base = &p[0]
	}
	iov.SetLen(len(p))
	for {
		*msg = unix.Msghdr{Name: name, Namelen: namelen, Iov: iov, Control: &ctl[0]}
		msg.SetIovlen(1)
		msg.SetControllen(len(ctl))
		r, _, e := unix.RawSyscall(sysno, fd, uintptr(unsafe.Pointer(msg)), unix.MSG_DONTWAIT)
		switch e {
		case unix.EINTR:
			continue
		case unix.EAGAIN:
			return false
		}
		*n, *errno = int(r), e
		return true
	}
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

// writeTo sends p to a with the fields f (unknown: the socket's own), or
// reports false when a is not an address it takes (the caller then uses Go's
// own WriteTo, which also reports the errors, and f is lost).
func (s *sender) writeTo(c *net.UDPConn, p []byte, addr net.Addr, f Fields) (int, bool, error) {
	return s.writeToOrQueue(nil, c, p, addr, f)
}

// writeToOrQueue is writeTo that, for conn (nil: none) armed with a batch,
// queues the datagram there instead of sending it.
func (s *sender) writeToOrQueue(conn *Conn, c *net.UDPConn, p []byte, addr net.Addr, f Fields) (int, bool, error) {
	a, ok := addr.(*net.UDPAddr)
	if !ok {
		return 0, false, nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	port := uint16(a.Port)
	v6 := a.IP.To4() == nil
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
	send := s.send
	if f.Valid {
		s.ctllen = putFields(&s.ctl, v6, f)
		send = s.sendMsg
	}
	if conn != nil && s.batch != nil {
		s.queue(conn, addr, f.Valid)
		s.p = nil
		return len(p), true, nil
	}
	err := s.rc.Write(send)
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
	ctl   [controlSize]byte
	iov   unix.Iovec
	msg   unix.Msghdr
	n     int
	errno syscall.Errno
	recv  func(fd uintptr) bool // c.recvmsg, bound once
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
	if err := enableFields(s.rc, s.family); err != nil {
		return nil, err
	}
	c := &Conn{UDPConn: u, s: s, rc: s.rc, addrs: newSources(relaySources, false)}
	c.recv = c.recvmsg
	return c, nil
}

// recvmsg is recvfrom that also takes the datagram's control messages.
func (c *Conn) recvmsg(fd uintptr) bool {
	return msgCall(unix.SYS_RECVMSG, fd, &c.msg, &c.iov, c.p, (*byte)(unsafe.Pointer(&c.name)), unix.SizeofSockaddrInet6, c.ctl[:], &c.n, &c.errno)
}

// ReadFrom implements net.PacketConn.
func (c *Conn) ReadFrom(p []byte) (int, net.Addr, error) {
	n, a, _, err := c.ReadFromFields(p)
	return n, a, err
}

// ReadFromFields is ReadFrom that also returns the datagram's TTL and TOS.
func (c *Conn) ReadFromFields(p []byte) (int, net.Addr, Fields, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.p = p
	err := c.rc.Read(c.recv)
	c.p = nil
	if err == nil && c.errno != 0 {
		err = os.NewSyscallError("recvmsg", c.errno)
	}
	if err != nil {
		return 0, nil, Fields{}, &net.OpError{Op: "read", Net: "udp", Source: c.LocalAddr(), Err: err}
	}
	f := parseFields(c.ctl[:min(int(c.msg.Controllen), controlSize)])
	return c.n, c.addrs.get(&c.name), f, nil
}

// WriteTo implements net.PacketConn.
func (c *Conn) WriteTo(p []byte, addr net.Addr) (int, error) {
	return c.WriteToFields(p, addr, Fields{})
}

// WriteToFields is WriteTo with the datagram's TTL and TOS set to f (unknown:
// the socket's own).
func (c *Conn) WriteToFields(p []byte, addr net.Addr, f Fields) (int, error) {
	if n, ok, err := c.s.writeToOrQueue(c, c.UDPConn, p, addr, f); ok {
		return n, err
	}
	return c.UDPConn.WriteTo(p, addr)
}
