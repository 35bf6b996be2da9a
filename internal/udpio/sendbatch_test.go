package udpio

import (
	"errors"
	"fmt"
	"net"
	"testing"
	"time"
)

// TestSendBatch: datagrams written to armed Conns wait in the batch and go
// out at Flush, each socket's in the order written, with their fields; a
// write not armed goes out at once; a socket whose send fails has its first
// datagram reported with the error and its later ones as not tried, while
// the other sockets' go out; Drop takes the last one back; nothing allocates.
func TestSendBatch(t *testing.T) {
	a, err := NewConn(listen(t, "udp4", "127.0.0.1:0"))
	if err != nil {
		t.Fatal(err)
	}
	b, err := NewConn(listen(t, "udp4", "127.0.0.1:0"))
	if err != nil {
		t.Fatal(err)
	}
	peer, err := NewConn(listen(t, "udp4", "127.0.0.1:0"))
	if err != nil {
		t.Fatal(err)
	}
	to := peer.LocalAddr().(*net.UDPAddr)
	bad := &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 0} // sendmmsg: EINVAL
	if !a.Takes(to) || a.Takes(&net.UDPAddr{IP: net.IPv6loopback, Port: 1}) {
		t.Fatal("Takes: an IPv4 socket takes IPv4 destinations only")
	}
	read := func() (string, int, Fields) {
		t.Helper()
		buf := make([]byte, 64)
		_ = peer.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
		n, from, f, err := peer.ReadFromFields(buf)
		if err != nil {
			return "", 0, Fields{}
		}
		return string(buf[:n]), from.(*net.UDPAddr).Port, f
	}
	sb := NewSendBatch()
	write := func(c *Conn, p string, addr net.Addr, f Fields, tag int) {
		t.Helper()
		if !c.Defer(sb, tag) {
			t.Fatal("Defer: full")
		}
		if n, err := c.WriteToFields([]byte(p), addr, f); n != len(p) || err != nil {
			t.Fatalf("write %q: %d, %v", p, n, err)
		}
		if !c.Disarm() {
			t.Fatalf("write %q: not in the batch", p)
		}
	}
	f := Fields{Valid: true, TTL: 17, TOS: 0x28}
	write(a, "a1", to, f, 0)
	write(b, "b1", to, Fields{}, 1)
	write(a, "a2", to, Fields{}, 2)
	write(b, "b2", to, f, 3)
	write(a, "a3", to, f, 4)
	write(a, "dropped", to, f, 5)
	if !sb.Drop(5) || sb.Drop(5) || sb.Len() != 5 {
		t.Fatalf("Drop: %d left", sb.Len())
	}
	// Armed, but not written: Disarm says so, and the next write goes out at once.
	a.Defer(sb, 9)
	if a.Disarm() {
		t.Fatal("Disarm: a write took the batch")
	}
	if _, err := a.WriteTo([]byte("now"), to); err != nil {
		t.Fatal(err)
	}
	if p, _, _ := read(); p != "now" {
		t.Fatalf("the peer read %q first, want the unarmed write", p)
	}
	if p, _, _ := read(); p != "" {
		t.Fatalf("the peer read %q before Flush", p)
	}
	sb.Flush(func(tag int, err error) { t.Errorf("tag %d failed: %v", tag, err) })
	if sb.Len() != 0 {
		t.Fatal("Flush left datagrams in the batch")
	}
	got := map[int][]string{}
	for range 5 {
		p, port, pf := read()
		got[port] = append(got[port], fmt.Sprintf("%s ttl %d tos %#x", p, pf.TTL, pf.TOS))
	}
	pa, pb := a.LocalAddr().(*net.UDPAddr).Port, b.LocalAddr().(*net.UDPAddr).Port
	want := map[int][]string{
		pa: {"a1 ttl 17 tos 0x28", "a2 ttl 64 tos 0x0", "a3 ttl 17 tos 0x28"},
		pb: {"b1 ttl 64 tos 0x0", "b2 ttl 17 tos 0x28"},
	}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("the peer read %v, want %v", got, want)
	}

	// A failed send: a's second datagram fails, its third is not tried; b's go.
	write(a, "a1", to, Fields{}, 0)
	write(b, "b1", to, Fields{}, 1)
	write(a, "a2", bad, Fields{}, 2)
	write(b, "b2", to, Fields{}, 3)
	write(a, "a3", to, Fields{}, 4)
	failed := map[int]error{}
	sb.Flush(func(tag int, err error) { failed[tag] = err })
	var op *net.OpError
	if len(failed) != 2 || !errors.As(failed[2], &op) || op.Addr != bad || failed[4] != nil {
		t.Errorf("failed %v, want tag 2 with its error and tag 4 untried", failed)
	}
	var order []string
	for range 3 {
		p, _, _ := read()
		order = append(order, p)
	}
	if p, _, _ := read(); p != "" || fmt.Sprint(order) != fmt.Sprint([]string{"a1", "b1", "b2"}) {
		t.Errorf("the peer read %v then %q, want a1 b1 b2", order, p)
	}

	// A closed socket's datagrams fail with the error its WriteTo returns.
	c, err := NewConn(listen(t, "udp4", "127.0.0.1:0"))
	if err != nil {
		t.Fatal(err)
	}
	write(c, "c1", to, Fields{}, 0)
	c.Close()
	clear(failed)
	sb.Flush(func(tag int, err error) { failed[tag] = err })
	if !errors.Is(failed[0], net.ErrClosed) {
		t.Errorf("closed socket: %v", failed)
	}

	// No allocation per datagram, and a full batch takes no more.
	p := []byte("x")
	fail := func(int, error) {}
	if n := testing.AllocsPerRun(50, func() {
		for i := range BatchSize {
			a.Defer(sb, i)
			_, _ = a.WriteToFields(p, to, f)
			a.Disarm()
		}
		if a.Defer(sb, BatchSize) {
			t.Fatal("Defer on a full batch")
		}
		sb.Flush(fail)
	}); n != 0 {
		t.Errorf("%.1f allocations per batch", n)
	}
}
