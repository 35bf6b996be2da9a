package udpio

import (
	"net"
	"os"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// SendBatch defers datagrams written to Conns and sends them with one
// sendmmsg per socket at Flush: a read loop that relays a recvmmsg batch
// writes what it relays into one SendBatch, then flushes it before it reads
// again. A Conn writes into the batch only when armed (Conn.Defer), for the
// one write that follows; every other write goes out at once, as before.
//
// The data written is not copied: it must stay as it is until Flush. One
// goroutine (the read loop) uses a SendBatch and arms Conns for it.
type SendBatch struct {
	n     int
	ents  [BatchSize]sendEntry
	hdrs  [BatchSize]unix.Mmsghdr
	iovs  [BatchSize]unix.Iovec
	names [BatchSize]unix.RawSockaddrInet6 // big enough for either family
	ctls  [BatchSize][controlSize]byte

	// The sendmmsg of one group, bound once (a method value per call
	// allocates).
	from, to int
	sent     int
	errno    syscall.Errno
	send     func(fd uintptr) bool
}

type sendEntry struct {
	c    *Conn
	addr net.Addr
	tag  int
}

// NewSendBatch returns an empty batch.
func NewSendBatch() *SendBatch {
	b := &SendBatch{}
	b.send = b.sendmmsg
	return b
}

// Len is the number of datagrams waiting in the batch.
func (b *SendBatch) Len() int { return b.n }

// Full reports whether the batch takes no more datagrams.
func (b *SendBatch) Full() bool { return b.n == BatchSize }

// Drop takes the last datagram back out of the batch if its tag is tag, and
// reports whether it did.
func (b *SendBatch) Drop(tag int) bool {
	if b.n == 0 || b.ents[b.n-1].tag != tag {
		return false
	}
	b.n--
	b.ents[b.n] = sendEntry{}
	return true
}

// Defer arms c: its next write (WriteTo, WriteToFields) of a datagram to an
// address it takes (see Takes) goes into b, labelled tag, and reports the
// whole datagram written; Armed then reports false. false: b is full (c is
// not armed).
func (c *Conn) Defer(b *SendBatch, tag int) bool {
	if b.Full() {
		return false
	}
	c.s.mu.Lock()
	c.s.batch, c.s.tag = b, tag
	c.s.mu.Unlock()
	return true
}

// Disarm undoes Defer if no write took it, and reports whether one did (the
// datagram is then in the batch).
func (c *Conn) Disarm() (queued bool) {
	c.s.mu.Lock()
	defer c.s.mu.Unlock()
	queued = c.s.batch == nil
	c.s.batch = nil
	return queued
}

// Takes reports whether a datagram to addr can go into a SendBatch (else a
// write to it goes out at once, through Go's own conversion of the address).
func (c *Conn) Takes(addr net.Addr) bool {
	a, ok := addr.(*net.UDPAddr)
	if !ok {
		return false
	}
	if ip4 := a.IP.To4(); ip4 != nil && c.s.family == unix.AF_INET {
		return true
	}
	return len(a.IP) == net.IPv6len && c.s.family == unix.AF_INET6 && a.Zone == ""
}

// queue adds the datagram s is set up to send (s.p to s.sa, with s.ctl when
// withCtl) to s.batch; s.mu held.
func (s *sender) queue(c *Conn, addr net.Addr, withCtl bool) {
	b := s.batch
	i := b.n
	b.n++
	b.ents[i] = sendEntry{c: c, addr: addr, tag: s.tag}
	copy(unsafe.Slice((*byte)(unsafe.Pointer(&b.names[i])), unix.SizeofSockaddrInet6), unsafe.Slice((*byte)(s.sa), s.salen))
	b.iovs[i] = unix.Iovec{}
	if len(s.p) > 0 {
		b.iovs[i].Base = &s.p[0]
	}
	b.iovs[i].SetLen(len(s.p))
	h := &b.hdrs[i].Hdr
	*h = unix.Msghdr{Name: (*byte)(unsafe.Pointer(&b.names[i])), Namelen: uint32(s.salen), Iov: &b.iovs[i]}
	h.SetIovlen(1)
	if withCtl {
		b.ctls[i] = s.ctl
		h.Control = &b.ctls[i][0]
		h.SetControllen(s.ctllen)
	}
	s.batch = nil
}

// Flush sends the batch: per socket, in the order the datagrams were
// written, with sendmmsg, as many as a call takes, until all are sent or
// one fails. A datagram that fails is reported to failed with its tag and
// the error a write of it alone would have returned, and so is every later
// one of the same socket (with a nil error: not tried, so that a caller
// that writes them again keeps their order). The batch is then empty.
func (b *SendBatch) Flush(failed func(tag int, err error)) {
	if b.n == 0 {
		return
	}
	// Group by socket, keeping the write order within each group (the
	// headers keep pointing at their entry's name, iovec and control).
	var hdrs [BatchSize]unix.Mmsghdr
	var ents [BatchSize]sendEntry
	var placed [BatchSize]bool
	k := 0
	for i := range b.n {
		if placed[i] {
			continue
		}
		for j := i; j < b.n; j++ {
			if !placed[j] && b.ents[j].c == b.ents[i].c {
				hdrs[k], ents[k], placed[j] = b.hdrs[j], b.ents[j], true
				k++
			}
		}
	}
	b.hdrs, b.ents = hdrs, ents
	for start := 0; start < b.n; {
		c := b.ents[start].c
		end := start + 1
		for end < b.n && b.ents[end].c == c {
			end++
		}
		b.flushGroup(c, start, end, failed)
		start = end
	}
	for i := range b.n {
		b.ents[i] = sendEntry{}
	}
	b.n = 0
}

// flushGroup sends entries [start, end), all on c.
func (b *SendBatch) flushGroup(c *Conn, start, end int, failed func(int, error)) {
	for start < end {
		b.from, b.to, b.sent, b.errno = start, end, 0, 0
		err := c.s.rc.Write(b.send)
		if err == nil && b.errno != 0 {
			err = os.NewSyscallError("sendmmsg", b.errno)
		}
		if err != nil {
			failed(b.ents[start].tag, &net.OpError{Op: "write", Net: "udp", Source: c.LocalAddr(), Addr: b.ents[start].addr, Err: err})
			for i := start + 1; i < end; i++ {
				failed(b.ents[i].tag, nil)
			}
			return
		}
		start += b.sent
	}
}

// sendmmsg sends entries [b.from, b.to) without blocking; false (EAGAIN
// before the first is sent) makes the runtime's poller wait until the socket
// is writable. Raw, as sender's sendto.
func (b *SendBatch) sendmmsg(fd uintptr) bool {
	for {
		r, _, errno := unix.RawSyscall6(unix.SYS_SENDMMSG, fd, uintptr(unsafe.Pointer(&b.hdrs[b.from])), uintptr(b.to-b.from), unix.MSG_DONTWAIT, 0, 0)
		switch errno {
		case unix.EINTR:
			continue
		case unix.EAGAIN:
			return false
		}
		b.sent, b.errno = int(r), errno
		if errno == 0 && b.sent == 0 {
			// Never for a non-empty vector; kept from spinning.
			b.errno = unix.EIO
		}
		return true
	}
}
