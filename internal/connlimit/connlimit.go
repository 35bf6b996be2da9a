// Package connlimit bounds what clients can hold on a listener.
//
// Limiter.Listener is for the TURN-over-TCP and TURN-over-TLS listeners:
// connections (in total and per source), time (the TLS handshake, a frame in
// assembly, an idle connection) and memory (a frame in assembly is at most
// Limits.MaxFrame bytes; larger ones are discarded as they arrive, as pion/turn
// would discard them whole). ShedListener is for the HTTP endpoints: a bounded
// number of connections where a newcomer displaces an idle one.
//
// Why it exists: pion/turn v4 starts a goroutine per accepted connection with
// no deadline, and its STUNConn reassembles a frame by appending every read to
// a buffer and calling itself again, so a header announcing 0xFFE8 bytes
// followed by one byte a millisecond grows the buffer and the goroutine's
// stack (one frame per read) for a minute; 30 such connections took the
// daemon past 250 MiB. The Conn here reads the stream itself and hands pion
// one whole frame per Read, so pion's reassembly never recurses nor grows.
//
// Memory a connection can pin in the process, whatever the client sends:
// its read buffer (bufSize), pion's read buffer (1,600 bytes) and frame
// copy, two goroutine stacks, and for TLS crypto/tls's record buffers (a
// record is at most 16 KiB plus overhead) and, during the handshake, one
// handshake message (crypto/tls bounds it at 64 KiB). Measured and
// documented in docs/operations.md, "Quotas and abuse resistance".
package connlimit

import (
	"context"
	"crypto/tls"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"sync"
	"sync/atomic"
	"time"
)

// Limits are what one client may hold. A zero field means no limit.
type Limits struct {
	// MaxConns bounds the open connections of every listener sharing the
	// Limiter; a connection over it is closed at once.
	MaxConns int
	// MaxConnsPerSource bounds the open connections from one client IP
	// address (IPv6: one /64, what one host usually holds).
	MaxConnsPerSource int
	// HandshakeTimeout bounds a TLS handshake.
	HandshakeTimeout time.Duration
	// IdleTimeout closes a connection that delivered no whole frame for
	// this long (pion then deletes its allocation).
	IdleTimeout time.Duration
	// FrameTimeout bounds the time from a frame's first byte to its last.
	FrameTimeout time.Duration
	// MaxFrame is the largest frame delivered; a larger one is read and
	// discarded as it arrives, never buffered. pion's read loop discards a
	// frame that fills its 1,600-byte buffer, so DefaultMaxFrame drops
	// exactly what pion drops.
	MaxFrame int
}

// Defaults: docs/operations.md ("Quotas and abuse resistance") says why each.
const (
	DefaultMaxConns          = 4096
	DefaultMaxConnsPerSource = 64
	DefaultHandshakeTimeout  = 10 * time.Second
	DefaultIdleTimeout       = 15 * time.Minute
	DefaultFrameTimeout      = 10 * time.Second
	DefaultMaxFrame          = 1599
)

// Defaults returns the default limits.
func Defaults() Limits {
	return Limits{MaxConns: DefaultMaxConns, MaxConnsPerSource: DefaultMaxConnsPerSource, HandshakeTimeout: DefaultHandshakeTimeout,
		IdleTimeout: DefaultIdleTimeout, FrameTimeout: DefaultFrameTimeout, MaxFrame: DefaultMaxFrame}
}

// Validate says whether l is usable.
func (l Limits) Validate() error {
	if l.MaxConns < 0 || l.MaxConnsPerSource < 0 || l.HandshakeTimeout < 0 || l.IdleTimeout < 0 || l.FrameTimeout < 0 {
		return fmt.Errorf("%w: negative connection limit or timeout", ErrLimits)
	}
	if l.MaxFrame < minFrame || l.MaxFrame > maxFrame {
		return fmt.Errorf("%w: largest frame %d bytes, want %d to %d", ErrLimits, l.MaxFrame, minFrame, maxFrame)
	}
	return nil
}

const (
	stunHeader = 20
	chanHeader = 4
	// minFrame fits a STUN header and a short attribute; maxFrame is the
	// largest frame the 16-bit length fields can announce.
	minFrame = 548
	maxFrame = stunHeader + 0xffff
)

// Errors a Conn's Read returns, for callers to branch on.
var (
	ErrLimits           = errors.New("invalid connection limits")
	ErrInvalidFrame     = errors.New("neither a STUN message nor ChannelData")
	ErrIdle             = errors.New("connection idle")
	ErrSlowFrame        = errors.New("frame not complete in time")
	ErrHandshakeTimeout = errors.New("TLS handshake not complete in time")
)

// Stats are a Limiter's counts.
type Stats struct {
	Open                                           int
	RefusedTotal, RefusedSource                    uint64
	HandshakeTimeouts, IdleTimeouts, FrameTimeouts uint64
	OversizedFrames                                uint64
}

// Limiter counts the connections of the listeners it wraps.
type Limiter struct {
	lim       Limits
	mu        sync.Mutex
	open      int
	perSource map[netip.Prefix]int

	refusedTotal, refusedSource                    atomic.Uint64
	handshakeTimeouts, idleTimeouts, frameTimeouts atomic.Uint64
	oversized                                      atomic.Uint64
}

// New returns a Limiter enforcing l, which must be valid.
func New(l Limits) (*Limiter, error) {
	if err := l.Validate(); err != nil {
		return nil, err
	}
	return &Limiter{lim: l, perSource: map[netip.Prefix]int{}}, nil
}

// Limits returns the limits l enforces.
func (l *Limiter) Limits() Limits { return l.lim }

// Stats returns the counts.
func (l *Limiter) Stats() Stats {
	l.mu.Lock()
	open := l.open
	l.mu.Unlock()
	return Stats{Open: open, RefusedTotal: l.refusedTotal.Load(), RefusedSource: l.refusedSource.Load(),
		HandshakeTimeouts: l.handshakeTimeouts.Load(), IdleTimeouts: l.idleTimeouts.Load(), FrameTimeouts: l.frameTimeouts.Load(),
		OversizedFrames: l.oversized.Load()}
}

// source is what MaxConnsPerSource counts: the address, or an IPv6 /64.
func source(a net.Addr) netip.Prefix {
	var ip netip.Addr
	switch ta := a.(type) {
	case *net.TCPAddr:
		ip, _ = netip.AddrFromSlice(ta.IP)
	case *net.UDPAddr: // a DTLS client
		ip, _ = netip.AddrFromSlice(ta.IP)
	}
	ip = ip.Unmap()
	bits := 32
	if ip.Is6() {
		bits = 64
	}
	p, _ := ip.Prefix(bits)
	return p
}

func (l *Limiter) admit(src netip.Prefix) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.lim.MaxConns > 0 && l.open >= l.lim.MaxConns {
		l.refusedTotal.Add(1)
		return false
	}
	if l.lim.MaxConnsPerSource > 0 && l.perSource[src] >= l.lim.MaxConnsPerSource {
		l.refusedSource.Add(1)
		return false
	}
	l.open++
	l.perSource[src]++
	return true
}

func (l *Limiter) release(src netip.Prefix) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.open--
	if l.perSource[src]--; l.perSource[src] <= 0 {
		delete(l.perSource, src)
	}
}

// Filter sees each whole frame before pion does; it returns false when it
// has dealt with the frame itself (answered it on c), and pion must not see it.
type Filter func(c net.Conn, frame []byte) bool

// Listener wraps ln: connections over the limits are closed at accept, the
// others are served (after a TLS handshake with tlsConf when it is not nil)
// frame by frame through filter (nil: every frame goes to pion).
func (l *Limiter) Listener(ln net.Listener, tlsConf *tls.Config, filter Filter) net.Listener {
	return &listener{Listener: ln, l: l, tls: tlsConf, filter: filter}
}

type listener struct {
	net.Listener
	l      *Limiter
	tls    *tls.Config
	filter Filter
}

// Accept returns the next connection within the limits. It never returns a
// refused connection nor a transient error (out of file descriptors): pion
// stops serving the listener at the first error Accept returns.
func (ln *listener) Accept() (net.Conn, error) {
	for {
		c, err := accept(ln.Listener)
		if err != nil {
			return nil, err
		}
		src := source(c.RemoteAddr())
		if !ln.l.admit(src) {
			if tc, ok := c.(*net.TCPConn); ok {
				_ = tc.SetLinger(0) // a reset: no TIME_WAIT kept for a refused client
			}
			c.Close()
			continue
		}
		conn := &Conn{Conn: c, l: ln.l, src: src, filter: ln.filter, last: time.Now()}
		if ln.tls != nil {
			tc := tls.Server(c, ln.tls)
			conn.hs, conn.Conn = tc, tc
		} else if h, ok := c.(handshaker); ok {
			conn.hs = h // a DTLS connection: its handshake is still to come
		}
		return conn, nil
	}
}

// accept returns ln's next connection, or the error that closed ln. Other
// errors (EMFILE, ENFILE, ECONNABORTED) are waited out, as net/http does:
// pion's accept loop, and http.Server's after a while, end at an error.
func accept(ln net.Listener) (net.Conn, error) {
	backoff := 5 * time.Millisecond
	for {
		c, err := ln.Accept()
		if err == nil || errors.Is(err, net.ErrClosed) {
			return c, err
		}
		time.Sleep(backoff)
		backoff = min(2*backoff, time.Second)
	}
}

// handshaker is a connection with a handshake of its own (tls.Conn,
// dtls.Conn), bounded by Limits.HandshakeTimeout.
type handshaker interface {
	HandshakeContext(ctx context.Context) error
}

// Conn is a connection within the limits. Its Read returns one whole frame
// (STUN message or ChannelData with its padding) per call when p can hold it;
// it is read by one goroutine at a time, as pion does.
type Conn struct {
	net.Conn
	l         *Limiter
	src       netip.Prefix
	hs        handshaker // the (D)TLS handshake to make before the first frame
	filter    Filter
	closeOnce sync.Once

	shook      bool
	buf        []byte
	r, w       int       // buf[r:w] is received and not yet delivered
	out        []byte    // the rest of a frame a short Read left
	last       time.Time // when the last whole frame (or the connection) came
	frameStart time.Time // when the first byte of buf[r:w] came
	deadline   time.Time // the read deadline set
}

// Close closes the connection and gives its slots back.
func (c *Conn) Close() error {
	err := c.Conn.Close()
	c.closeOnce.Do(func() { c.l.release(c.src) })
	return err
}

// bufSize holds a frame of MaxFrame bytes and a few small ones after it.
func (c *Conn) bufSize() int { return max(4096, c.l.lim.MaxFrame) }

// Read implements net.Conn.
func (c *Conn) Read(p []byte) (int, error) {
	if len(c.out) > 0 {
		n := copy(p, c.out)
		c.out = c.out[n:]
		return n, nil
	}
	if c.hs != nil && !c.shook {
		if err := c.handshake(); err != nil {
			return 0, err
		}
	}
	for {
		f, err := c.next()
		if err != nil {
			return 0, err
		}
		if c.filter != nil && !c.filter(c, f) {
			continue
		}
		n := copy(p, f)
		c.out = f[n:]
		return n, nil
	}
}

func (c *Conn) handshake() error {
	ctx := context.Background()
	if t := c.l.lim.HandshakeTimeout; t > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, t)
		defer cancel()
	}
	if err := c.hs.HandshakeContext(ctx); err != nil {
		if ctx.Err() != nil {
			c.l.handshakeTimeouts.Add(1)
			return fmt.Errorf("%w: %w", ErrHandshakeTimeout, err)
		}
		return err
	}
	c.shook = true
	c.last = time.Now()
	return nil
}

// frameSize is the size of the frame b starts with, as pion's STUNConn
// reckons it (ChannelData padded to 4 bytes over a stream); 0 when b is too
// short to tell.
func frameSize(b []byte) (int, error) {
	if len(b) < chanHeader {
		return 0, nil
	}
	if n := binary.BigEndian.Uint16(b); n >= 0x4000 && n <= 0x7fff {
		// pion's channel numbers (RFC 5766's range). pion's STUNConn checks
		// a STUN magic cookie first, which ChannelData carrying one at
		// bytes 4-8 would match only when its read happened to hold 20
		// bytes: here ChannelData is ChannelData whatever the reads.
		return chanHeader + (int(binary.BigEndian.Uint16(b[2:]))+3)&^3, nil
	}
	if len(b) < stunHeader {
		if b[0]&0xc0 != 0 {
			return 0, ErrInvalidFrame
		}
		return 0, nil
	}
	if binary.BigEndian.Uint32(b[4:]) != 0x2112a442 {
		return 0, ErrInvalidFrame
	}
	return stunHeader + int(binary.BigEndian.Uint16(b[2:])), nil
}

// next returns the next whole frame, valid until the next call.
func (c *Conn) next() ([]byte, error) {
	if c.buf == nil {
		c.buf = make([]byte, c.bufSize())
	}
	for {
		size, err := frameSize(c.buf[c.r:c.w])
		if err != nil {
			return nil, err
		}
		if size > c.l.lim.MaxFrame {
			c.l.oversized.Add(1)
			if err := c.discard(size); err != nil {
				return nil, err
			}
			continue
		}
		if size > 0 && c.w-c.r >= size {
			f := c.buf[c.r : c.r+size]
			c.r += size
			now := time.Now()
			c.last, c.frameStart = now, now
			return f, nil
		}
		if err := c.fill(); err != nil {
			return nil, err
		}
	}
}

// fill reads more of the stream into buf, under the deadline that applies.
func (c *Conn) fill() error {
	if c.r == c.w {
		c.r, c.w = 0, 0
	} else if c.w == len(c.buf) {
		c.w = copy(c.buf, c.buf[c.r:c.w])
		c.r = 0
	}
	started := c.w > c.r
	if err := c.setDeadline(started); err != nil {
		return err
	}
	n, err := c.Conn.Read(c.buf[c.w:])
	if n > 0 && !started {
		c.frameStart = time.Now()
	}
	c.w += n
	if err != nil && n == 0 {
		return c.timeout(err, started)
	}
	return nil
}

// discard drops a frame of size bytes (larger than MaxFrame) as it arrives.
func (c *Conn) discard(size int) error {
	for {
		k := min(size, c.w-c.r)
		c.r += k
		if size -= k; size == 0 {
			c.last, c.frameStart = time.Now(), time.Now()
			return nil
		}
		c.r, c.w = 0, 0
		if err := c.setDeadline(true); err != nil {
			return err
		}
		n, err := c.Conn.Read(c.buf)
		c.w = n
		if err != nil && n == 0 {
			return c.timeout(err, true)
		}
	}
}

func (c *Conn) setDeadline(started bool) error {
	var d time.Time
	switch {
	case started && c.l.lim.FrameTimeout > 0:
		d = c.frameStart.Add(c.l.lim.FrameTimeout)
	case !started && c.l.lim.IdleTimeout > 0:
		d = c.last.Add(c.l.lim.IdleTimeout)
	}
	if d.Equal(c.deadline) {
		return nil
	}
	c.deadline = d
	return c.Conn.SetReadDeadline(d)
}

// timeout names a read deadline's expiry after the limit that set it.
func (c *Conn) timeout(err error, started bool) error {
	// A DTLS connection's deadline error is its own net.Error, not
	// os.ErrDeadlineExceeded.
	var ne net.Error
	if !errors.Is(err, os.ErrDeadlineExceeded) && (!errors.As(err, &ne) || !ne.Timeout()) {
		return err
	}
	if started {
		c.l.frameTimeouts.Add(1)
		return fmt.Errorf("%w (%v): %w", ErrSlowFrame, c.l.lim.FrameTimeout, err)
	}
	c.l.idleTimeouts.Add(1)
	return fmt.Errorf("%w (%v): %w", ErrIdle, c.l.lim.IdleTimeout, err)
}
