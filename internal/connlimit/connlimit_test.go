package connlimit

import (
	"encoding/binary"
	"errors"
	"io"
	"net"
	"testing"
	"time"
)

// serve accepts on a limited loopback listener and hands the accepted
// connections to the test.
func serve(t *testing.T, lim Limits) (*Limiter, string, <-chan net.Conn) {
	t.Helper()
	l, err := New(lim)
	if err != nil {
		t.Fatal(err)
	}
	raw, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ln := l.Listener(raw, nil, nil)
	t.Cleanup(func() { ln.Close() })
	conns := make(chan net.Conn, 16)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			t.Cleanup(func() { c.Close() })
			conns <- c
		}
	}()
	return l, raw.Addr().String(), conns
}

func dial(t *testing.T, addr string) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp4", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func stunFrame(body int) []byte {
	b := make([]byte, 20+body)
	binary.BigEndian.PutUint16(b[0:], 0x0001)
	binary.BigEndian.PutUint16(b[2:], uint16(body))
	binary.BigEndian.PutUint32(b[4:], 0x2112a442)
	for i := 20; i < len(b); i++ {
		b[i] = byte(i)
	}
	return b
}

func channelData(n int) []byte {
	b := make([]byte, 4+(n+3)&^3)
	binary.BigEndian.PutUint16(b[0:], 0x4001)
	binary.BigEndian.PutUint16(b[2:], uint16(n))
	for i := 4; i < 4+n; i++ {
		b[i] = 0xaa
	}
	return b
}

// TestFrames: frames trickled a byte at a time and frames sent together both
// come out one whole frame per Read; an oversized frame is skipped and what
// follows it is delivered.
func TestFrames(t *testing.T) {
	l, addr, conns := serve(t, Limits{MaxFrame: DefaultMaxFrame, FrameTimeout: 5 * time.Second})
	c := dial(t, addr)
	s := <-conns
	want := [][]byte{stunFrame(8), channelData(5), stunFrame(100)}
	go func() {
		for _, b := range want[0] {
			_, _ = c.Write([]byte{b})
			time.Sleep(time.Millisecond)
		}
		_, _ = c.Write(append(append(append([]byte(nil), want[1]...), stunFrame(3000)...), want[2]...))
	}()
	buf := make([]byte, 1600)
	for i, w := range want {
		n, err := s.Read(buf)
		if err != nil {
			t.Fatal(err)
		}
		if string(buf[:n]) != string(w) {
			t.Fatalf("read %d: %d bytes %x, want %d bytes %x", i, n, buf[:n], len(w), w)
		}
	}
	if got := l.Stats().OversizedFrames; got != 1 {
		t.Fatalf("%d oversized frames counted, want 1", got)
	}
	// A short Read gets the frame in pieces, in order.
	go func() { _, _ = c.Write(stunFrame(40)) }()
	var got []byte
	for len(got) < 60 {
		n, err := s.Read(buf[:7])
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, buf[:n]...)
	}
	if string(got) != string(stunFrame(40)) {
		t.Fatalf("pieces %x", got)
	}
	// Bytes that are neither STUN nor ChannelData end the connection, as
	// pion's own framing does.
	go func() { _, _ = c.Write([]byte("\x80 not TURN, not padded to anything")) }()
	if _, err := s.Read(buf); !errors.Is(err, ErrInvalidFrame) {
		t.Fatalf("junk: %v, want ErrInvalidFrame", err)
	}
}

// TestSlowFrameAndIdle: the slow-body attack (a header announcing 0xFFE8
// bytes, then a byte at a time) is cut at FrameTimeout; a silent connection
// at IdleTimeout.
func TestSlowFrameAndIdle(t *testing.T) {
	l, addr, conns := serve(t, Limits{MaxFrame: DefaultMaxFrame, FrameTimeout: 300 * time.Millisecond, IdleTimeout: 300 * time.Millisecond})
	slow := dial(t, addr)
	s := <-conns
	stop := make(chan struct{})
	defer close(stop)
	go func() {
		h := stunFrame(0)
		binary.BigEndian.PutUint16(h[2:], 0xffe8)
		_, _ = slow.Write(h)
		for {
			select {
			case <-stop:
				return
			case <-time.After(5 * time.Millisecond):
				if _, err := slow.Write([]byte{1}); err != nil {
					return
				}
			}
		}
	}()
	start := time.Now()
	if _, err := s.Read(make([]byte, 1600)); !errors.Is(err, ErrSlowFrame) {
		t.Fatalf("slow body: %v, want ErrSlowFrame", err)
	}
	if d := time.Since(start); d > 2*time.Second {
		t.Fatalf("slow body cut after %v", d)
	}
	dial(t, addr)
	idle := <-conns
	if _, err := idle.Read(make([]byte, 1600)); !errors.Is(err, ErrIdle) {
		t.Fatalf("idle: %v, want ErrIdle", err)
	}
	if st := l.Stats(); st.FrameTimeouts != 1 || st.IdleTimeouts != 1 {
		t.Fatalf("%+v", st)
	}
}

// TestCaps: connections over the per-source and total caps are closed at
// accept; a closed connection gives its slot back.
func TestCaps(t *testing.T) {
	l, addr, conns := serve(t, Limits{MaxFrame: DefaultMaxFrame, MaxConns: 3, MaxConnsPerSource: 2})
	dial(t, addr)
	dial(t, addr)
	sa, _ := <-conns, <-conns
	refused, err := net.Dial("tcp4", addr) // a third from 127.0.0.1
	if err == nil {
		defer refused.Close()
		_ = refused.SetReadDeadline(time.Now().Add(2 * time.Second))
		_, err = refused.Read(make([]byte, 1))
	}
	if err == nil || !errors.Is(err, io.EOF) && !isReset(err) {
		t.Fatalf("a connection over the per-source cap: %v, want it closed", err)
	}
	// Another source fills the total.
	other, err := net.DialTCP("tcp4", &net.TCPAddr{IP: net.IPv4(127, 0, 0, 2)}, mustTCPAddr(t, addr))
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	<-conns
	// The reset may come before the dial returns.
	fourth, err := net.DialTCP("tcp4", &net.TCPAddr{IP: net.IPv4(127, 0, 0, 3)}, mustTCPAddr(t, addr))
	if err == nil {
		defer fourth.Close()
		_ = fourth.SetReadDeadline(time.Now().Add(2 * time.Second))
		_, err = fourth.Read(make([]byte, 1))
	}
	if err == nil || !errors.Is(err, io.EOF) && !isReset(err) {
		t.Fatalf("a connection over the total cap: %v, want it closed", err)
	}
	if st := l.Stats(); st.Open != 3 || st.RefusedSource != 1 || st.RefusedTotal != 1 {
		t.Fatalf("%+v", st)
	}
	sa.Close()
	dial(t, addr)
	select {
	case <-conns:
	case <-time.After(2 * time.Second):
		t.Fatal("the freed slot was not given to a new connection")
	}
}

func isReset(err error) bool {
	var op *net.OpError
	return errors.As(err, &op) && !op.Timeout()
}

func mustTCPAddr(t *testing.T, s string) *net.TCPAddr {
	a, err := net.ResolveTCPAddr("tcp4", s)
	if err != nil {
		t.Fatal(err)
	}
	return a
}
