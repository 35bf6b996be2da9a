// Package udpio reads a UDP socket in batches (recvmmsg) under the one
// datagram per call net.PacketConn interface pion/turn's read loop uses, with
// no allocation per datagram.
package udpio

import (
	"encoding/binary"
	"errors"
	"net"
	"net/netip"
	"os"
	"strconv"
	"sync"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

const (
	// BatchSize is the most datagrams one recvmmsg returns.
	BatchSize = 32
	// slotSize holds any datagram pion/turn accepts (its inbound MTU is
	// 1600): a bigger one is cut here as in pion's own buffer, and pion drops
	// it for filling the buffer, as it would anyway.
	slotSize = 2048
	// listenerSources and relaySources bound the caches of source addresses
	// (a full cache starts over): a listener hears many clients, a relay
	// socket a few peers, and spoofed sources must not grow either without
	// bound. An entry is about 160 B and a miss costs one allocation, so a
	// listener socket keeps 2,048 (about 330 KB; a listener has up to 64
	// sockets, one per read loop).
	listenerSources = 1 << 11
	relaySources    = 64
	// zoneNames bounds the cache of interface names of link-local sources.
	zoneNames = 16
)

// ErrNotUDP: the connection is not a *net.UDPConn.
var ErrNotUDP = errors.New("udpio: not a UDP socket")

// BatchConn is a UDP socket whose ReadFrom hands out the datagrams of one
// recvmmsg call at a time; every other method is the socket's own. It
// returns the same *net.UDPAddr for every datagram of one source, so callers
// must not modify the addresses (pion/turn never does). ReadFrom is meant
// for one reader (pion/turn's read loop) and serialises several.
type BatchConn struct {
	*net.UDPConn
	rc syscall.RawConn
	s  *sender // WriteTo

	mu    sync.Mutex
	hdrs  [BatchSize]unix.Mmsghdr
	iovs  [BatchSize]unix.Iovec
	names [BatchSize]unix.RawSockaddrInet6 // big enough for either family
	ctls  [BatchSize][controlSize]byte     // each datagram's TTL and TOS
	buf   []byte                           // BatchSize slots of slotSize
	n     int                              // datagrams in the batch
	next  int                              // the next one ReadFrom hands out
	errno syscall.Errno
	recv  func(fd uintptr) bool // c.recvmmsg, bound once: a method value per call allocates
	addrs sources
	local *net.UDPAddr // LocalAddr
}

// sources makes the *net.UDPAddr of a datagram's source once per source.
type sources struct {
	m   map[addrKey]*net.UDPAddr
	max int
	// wide: IPv4 sources in 16-byte form (see BatchConn.ReadFrom).
	wide bool
	// zones caches the names of scope ids: looking one up is a netlink dump,
	// which a stranger on the link must not trigger per datagram.
	zones map[uint32]string
}

func newSources(limit int, wide bool) sources {
	return sources{m: map[addrKey]*net.UDPAddr{}, max: limit, wide: wide, zones: map[uint32]string{}}
}

// addrKey tells apart what Go's own ReadFrom would return differently: an
// IPv4 source on an IPv4 socket (a 4-byte IP) and the same source mapped on
// an IPv6 socket (16 bytes), and link-local sources on different interfaces.
type addrKey struct {
	ap    netip.AddrPort
	scope uint32
}

// NewBatchConn wraps a UDP socket.
func NewBatchConn(pc net.PacketConn) (*BatchConn, error) {
	u, ok := pc.(*net.UDPConn)
	if !ok {
		return nil, ErrNotUDP
	}
	rc, err := u.SyscallConn()
	if err != nil {
		return nil, err
	}
	s, err := newSender(u)
	if err != nil {
		return nil, err
	}
	if err := enableFields(rc, s.family); err != nil {
		return nil, err
	}
	c := &BatchConn{UDPConn: u, rc: rc, s: s, buf: make([]byte, BatchSize*slotSize), addrs: newSources(listenerSources, true)}
	for i := range c.hdrs {
		c.hdrs[i].Hdr.Control = &c.ctls[i][0]
		c.iovs[i].Base = &c.buf[i*slotSize]
		c.iovs[i].SetLen(slotSize)
		c.hdrs[i].Hdr.Name = (*byte)(unsafe.Pointer(&c.names[i]))
		c.hdrs[i].Hdr.Iov = &c.iovs[i]
		c.hdrs[i].Hdr.SetIovlen(1)
	}
	c.recv = c.recvmmsg
	if la, ok := u.LocalAddr().(*net.UDPAddr); ok {
		c.local = &net.UDPAddr{IP: la.IP.To16(), Port: la.Port, Zone: la.Zone}
	}
	return c, nil
}

// LocalAddr is the socket's address with its IP in 16-byte form: pion/turn
// keys every datagram's five-tuple with the local IP's To16(), which
// allocates for a 4-byte IP (net.UDPConn's on an IPv4 socket). The address is
// the same (String, Equal and netip's Unmap agree); callers must not modify it.
func (c *BatchConn) LocalAddr() net.Addr {
	if c.local == nil {
		return c.UDPConn.LocalAddr()
	}
	return c.local
}

// recvmmsg fills the batch without blocking; false (EAGAIN) makes the
// runtime's poller wait until the socket is readable.
func (c *BatchConn) recvmmsg(fd uintptr) bool {
	for i := range c.hdrs {
		c.hdrs[i].Hdr.Namelen = unix.SizeofSockaddrInet6
		c.hdrs[i].Hdr.SetControllen(controlSize)
		c.hdrs[i].Hdr.Flags = 0
	}
	// Raw, as sender's sendto: MSG_DONTWAIT never blocks.
	r, _, errno := unix.RawSyscall6(unix.SYS_RECVMMSG, fd, uintptr(unsafe.Pointer(&c.hdrs[0])), BatchSize, unix.MSG_DONTWAIT, 0, 0)
	if errno == unix.EAGAIN {
		return false
	}
	if errno == unix.EINTR {
		return c.recvmmsg(fd)
	}
	c.n, c.next, c.errno = int(r), 0, errno
	if errno != 0 {
		c.n = 0
	}
	return true
}

// WriteTo implements net.PacketConn with a raw sendto (see sender).
func (c *BatchConn) WriteTo(p []byte, addr net.Addr) (int, error) {
	return c.WriteToFields(p, addr, Fields{})
}

// WriteToFields is WriteTo with the datagram's TTL and TOS set to f (unknown:
// the socket's own).
func (c *BatchConn) WriteToFields(p []byte, addr net.Addr, f Fields) (int, error) {
	if n, ok, err := c.s.writeTo(c.UDPConn, p, addr, f); ok {
		return n, err
	}
	return c.UDPConn.WriteTo(p, addr)
}

// Buffered is the number of datagrams of the last recvmmsg that ReadFrom has
// not handed out yet: while it is above 0, ReadFrom returns without a system
// call, let alone a wait.
func (c *BatchConn) Buffered() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n - c.next
}

// ReadFrom implements net.PacketConn. Sources come as Go's own ReadFrom
// gives them, except that an IPv4 source on an IPv4 socket has its IP in
// 16-byte form, as on a dual-stack socket: pion/turn keys every datagram's
// five-tuple with SrcAddr.IP.To16(), which allocates for a 4-byte IP. The
// address is the same (String, Equal and netip's Unmap agree).
func (c *BatchConn) ReadFrom(p []byte) (int, net.Addr, error) {
	n, a, _, err := c.ReadFromFields(p)
	return n, a, err
}

// ReadFromFields is ReadFrom that also returns the datagram's TTL and TOS.
func (c *BatchConn) ReadFromFields(p []byte) (int, net.Addr, Fields, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for c.next >= c.n {
		if err := c.rc.Read(c.recv); err != nil {
			return 0, nil, Fields{}, &net.OpError{Op: "read", Net: "udp", Source: c.LocalAddr(), Err: err}
		}
		if c.errno != 0 {
			return 0, nil, Fields{}, &net.OpError{Op: "read", Net: "udp", Source: c.LocalAddr(), Err: os.NewSyscallError("recvmmsg", c.errno)}
		}
	}
	i := c.next
	c.next++
	size := min(int(c.hdrs[i].Len), slotSize)
	n := copy(p, c.buf[i*slotSize:i*slotSize+size])
	f := parseFields(c.ctls[i][:min(int(c.hdrs[i].Hdr.Controllen), controlSize)])
	return n, c.addrs.get(&c.names[i]), f, nil
}

// get is the datagram's source as Go's UDPConn.ReadFrom would return it
// (with a 16-byte IP when wide), made once per source. Not safe for
// concurrent use.
func (m sources) get(sa *unix.RawSockaddrInet6) *net.UDPAddr {
	var k addrKey
	port := binary.BigEndian.Uint16((*[2]byte)(unsafe.Pointer(&sa.Port))[:])
	if sa.Family == unix.AF_INET {
		sa4 := (*unix.RawSockaddrInet4)(unsafe.Pointer(sa))
		k.ap = netip.AddrPortFrom(netip.AddrFrom4(sa4.Addr), port)
	} else {
		k.ap = netip.AddrPortFrom(netip.AddrFrom16(sa.Addr), port)
		k.scope = sa.Scope_id
	}
	if a, ok := m.m[k]; ok {
		return a
	}
	if len(m.m) >= m.max {
		clear(m.m)
	}
	ip := net.IP(k.ap.Addr().AsSlice())
	if m.wide {
		ip = ip.To16()
	}
	a := &net.UDPAddr{IP: ip, Port: int(port), Zone: m.zone(k.scope)}
	m.m[k] = a
	return a
}

// zone is zoneName, cached.
func (m sources) zone(scope uint32) string {
	if scope == 0 {
		return ""
	}
	if z, ok := m.zones[scope]; ok {
		return z
	}
	if len(m.zones) >= zoneNames {
		clear(m.zones)
	}
	z := zoneName(scope)
	m.zones[scope] = z
	return z
}

// zoneName is the zone Go's net package gives a scope id.
func zoneName(scope uint32) string {
	if scope == 0 {
		return ""
	}
	if ifi, err := net.InterfaceByIndex(int(scope)); err == nil {
		return ifi.Name
	}
	return strconv.Itoa(int(scope))
}
