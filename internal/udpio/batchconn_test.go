package udpio

import (
	"bytes"
	"errors"
	"net"
	"net/netip"
	"os"
	"reflect"
	"testing"
	"time"
)

func listen(t testing.TB, network, addr string) *net.UDPConn {
	t.Helper()
	c, err := net.ListenUDP(network, mustResolve(t, network, addr))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func mustResolve(t testing.TB, network, addr string) *net.UDPAddr {
	t.Helper()
	a, err := net.ResolveUDPAddr(network, addr)
	if err != nil {
		t.Fatal(err)
	}
	return a
}

func batch(t testing.TB, c *net.UDPConn) *BatchConn {
	t.Helper()
	b, err := NewBatchConn(c)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// TestSameAsUDPConn: what BatchConn and Conn hand out, bytes and source
// address, is what the socket's own ReadFrom returns for the same datagrams
// (BatchConn's IPv4 sources in 16-byte form), for IPv4, IPv6 and IPv4
// sources on a dual-stack socket, including a datagram bigger than the
// reader's buffer.
func TestSameAsUDPConn(t *testing.T) {
	for _, tc := range []struct{ name, network, server, clientNet, client string }{
		{"ipv4", "udp4", "127.0.0.1:0", "udp4", "127.0.0.1:0"},
		{"ipv6", "udp6", "[::1]:0", "udp6", "[::1]:0"},
		{"ipv4 on dual stack", "udp", "[::]:0", "udp4", "127.0.0.1:0"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			plain, batched, single := listen(t, tc.network, tc.server), listen(t, tc.network, tc.server), listen(t, tc.network, tc.server)
			b := batch(t, batched)
			one, err := NewConn(single)
			if err != nil {
				t.Fatal(err)
			}
			client := listen(t, tc.clientNet, tc.client)
			to := func(c *net.UDPConn) *net.UDPAddr {
				a := c.LocalAddr().(*net.UDPAddr)
				if a.IP.IsUnspecified() {
					return &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1), Port: a.Port}
				}
				return a
			}
			sizes := []int{1, 4, 100, 1200, 1600, 1700, 3000}
			for _, size := range sizes {
				p := bytes.Repeat([]byte{byte(size)}, size)
				for _, c := range []*net.UDPConn{plain, batched, single} {
					if _, err := client.WriteToUDP(p, to(c)); err != nil {
						t.Fatal(err)
					}
				}
			}
			for _, size := range sizes {
				want := make([]byte, 1600)
				_ = plain.SetReadDeadline(time.Now().Add(2 * time.Second))
				wn, wa, werr := plain.ReadFrom(want)
				if werr != nil {
					t.Fatalf("%d B: plain %v", size, werr)
				}
				for _, r := range []net.PacketConn{b, one} {
					got := make([]byte, 1600)
					_ = r.SetReadDeadline(time.Now().Add(2 * time.Second))
					gn, ga, gerr := r.ReadFrom(got)
					if gerr != nil {
						t.Fatalf("%d B: %T: %v", size, r, gerr)
					}
					if gn != wn || !bytes.Equal(got[:gn], want[:wn]) {
						t.Errorf("%d B: %T read %d bytes, plain %d", size, r, gn, wn)
					}
					want := wa
					if r == net.PacketConn(b) {
						// BatchConn widens IPv4 sources (see ReadFrom).
						u := wa.(*net.UDPAddr)
						want = &net.UDPAddr{IP: u.IP.To16(), Port: u.Port, Zone: u.Zone}
					}
					if !reflect.DeepEqual(ga, want) || ga.String() != wa.String() {
						t.Errorf("%d B: %T source %#v, want %#v", size, r, ga, want)
					}
				}
			}
		})
	}
}

// TestBatchOrder: a burst queued before the read comes out whole and in order,
// across several recvmmsg batches.
func TestBatchOrder(t *testing.T) {
	server := listen(t, "udp4", "127.0.0.1:0")
	_ = server.SetReadBuffer(1 << 20)
	b := batch(t, server)
	client := listen(t, "udp4", "127.0.0.1:0")
	const n = 3*BatchSize + 5
	for i := range n {
		if _, err := client.WriteToUDP([]byte{byte(i)}, server.LocalAddr().(*net.UDPAddr)); err != nil {
			t.Fatal(err)
		}
	}
	buf := make([]byte, 16)
	_ = b.SetReadDeadline(time.Now().Add(2 * time.Second))
	for i := range n {
		k, _, err := b.ReadFrom(buf)
		if err != nil || k != 1 || buf[0] != byte(i) {
			t.Fatalf("datagram %d: %d bytes %v, %v", i, k, buf[:k], err)
		}
	}
}

// TestCloseAndDeadline: a blocked reader returns when the socket closes
// (net.ErrClosed, which ends pion's read loop) or its deadline passes.
func TestCloseAndDeadline(t *testing.T) {
	one, err := NewConn(listen(t, "udp4", "127.0.0.1:0"))
	if err != nil {
		t.Fatal(err)
	}
	for _, b := range []net.PacketConn{batch(t, listen(t, "udp4", "127.0.0.1:0")), one} {
		closeAndDeadline(t, b)
	}
}

func closeAndDeadline(t *testing.T, b net.PacketConn) {
	_ = b.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
	if _, _, err := b.ReadFrom(make([]byte, 16)); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Errorf("after the deadline: %v", err)
	}
	_ = b.SetReadDeadline(time.Time{})
	done := make(chan error, 1)
	go func() {
		_, _, err := b.ReadFrom(make([]byte, 16))
		done <- err
	}()
	time.Sleep(50 * time.Millisecond)
	b.Close()
	select {
	case err := <-done:
		if !errors.Is(err, net.ErrClosed) {
			t.Errorf("after close: %v", err)
		}
	case <-time.After(2 * time.Second):
		t.Fatal("the reader did not return after close")
	}
}

// TestNoAllocations: reading a datagram from a known source allocates
// nothing; the socket's own ReadFrom allocates its address every time.
func TestNoAllocations(t *testing.T) {
	server := listen(t, "udp4", "127.0.0.1:0")
	b := batch(t, server)
	client := listen(t, "udp4", "127.0.0.1:0")
	to := server.LocalAddr().(*net.UDPAddr).AddrPort()
	p, buf := []byte("channel data"), make([]byte, 1600)
	read := func(r func([]byte) (int, net.Addr, error)) func() {
		return func() {
			if _, err := client.WriteToUDPAddrPort(p, to); err != nil {
				t.Fatal(err)
			}
			if _, _, err := r(buf); err != nil {
				t.Fatal(err)
			}
		}
	}
	plain := testing.AllocsPerRun(200, read(server.ReadFrom))
	batched := testing.AllocsPerRun(200, read(b.ReadFrom))
	one, err := NewConn(listen(t, "udp4", "127.0.0.1:0"))
	if err != nil {
		t.Fatal(err)
	}
	to = one.LocalAddr().(*net.UDPAddr).AddrPort()
	single := testing.AllocsPerRun(200, read(one.ReadFrom))
	t.Logf("allocations per datagram: UDPConn.ReadFrom %.1f, BatchConn.ReadFrom %.1f, Conn.ReadFrom %.1f", plain, batched, single)
	if batched != 0 || single != 0 {
		t.Errorf("BatchConn.ReadFrom: %.1f, Conn.ReadFrom %.1f allocations per datagram, want 0", batched, single)
	}
}

func BenchmarkReadFrom(b *testing.B) {
	for _, mode := range []string{"UDPConn", "BatchConn"} {
		b.Run(mode, func(b *testing.B) {
			server := listen(b, "udp4", "127.0.0.1:0")
			_ = server.SetReadBuffer(4 << 20)
			var r net.PacketConn = server
			if mode == "BatchConn" {
				r = batch(b, server)
			}
			client := listen(b, "udp4", "127.0.0.1:0")
			to := server.LocalAddr().(*net.UDPAddr).AddrPort()
			p, buf := make([]byte, 100), make([]byte, 1600)
			b.ReportAllocs()
			for b.Loop() {
				// Bursts of a batch, as a loaded listener sees them.
				for range BatchSize {
					_, _ = client.WriteToUDPAddrPort(p, to)
				}
				for range BatchSize {
					if _, _, err := r.ReadFrom(buf); err != nil {
						b.Fatal(err)
					}
				}
			}
		})
	}
}

// TestSourcesBounded: the address cache starts over when full, so spoofed
// sources cannot grow it, and still answers right after.
func TestSourcesBounded(t *testing.T) {
	server := listen(t, "udp4", "127.0.0.1:0")
	one, err := NewConn(server)
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 16)
	for i := range relaySources + 10 {
		c := listen(t, "udp4", "127.0.0.1:0")
		if _, err := c.WriteToUDP([]byte{1}, server.LocalAddr().(*net.UDPAddr)); err != nil {
			t.Fatal(err)
		}
		_ = one.SetReadDeadline(time.Now().Add(2 * time.Second))
		_, from, err := one.ReadFrom(buf)
		if err != nil {
			t.Fatal(err)
		}
		if from.String() != c.LocalAddr().String() {
			t.Fatalf("source %d: %v, want %v", i, from, c.LocalAddr())
		}
		if n := len(one.addrs.m); n > relaySources {
			t.Fatalf("%d cached sources, bound %d", n, relaySources)
		}
	}
}

// TestLocalAddr16: BatchConn's local address is the socket's, in the 16-byte
// form whose To16 (pion's five-tuple key, per datagram) allocates nothing;
// so are the sources it reads.
func TestLocalAddr16(t *testing.T) {
	for _, tc := range []struct{ network, addr string }{{"udp4", "127.0.0.1:0"}, {"udp4", "0.0.0.0:0"}, {"udp6", "[::1]:0"}} {
		t.Run(tc.network+" "+tc.addr, func(t *testing.T) {
			u := listen(t, tc.network, tc.addr)
			b := batch(t, u)
			got, want := b.LocalAddr().(*net.UDPAddr), u.LocalAddr().(*net.UDPAddr)
			if !got.IP.Equal(want.IP) || got.Port != want.Port || got.Zone != want.Zone || got.String() != want.String() {
				t.Errorf("LocalAddr %v, socket %v", got, want)
			}
			if n := testing.AllocsPerRun(100, func() { ipSink = b.LocalAddr().(*net.UDPAddr).IP.To16() }); n != 0 {
				t.Errorf("LocalAddr().IP.To16(): %.0f allocations, want 0", n)
			}
			to := want.AddrPort()
			if to.Addr().IsUnspecified() {
				to = netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), to.Port())
			}
			from := "127.0.0.1:0"
			if to.Addr().Is6() {
				from = "[::1]:0"
			}
			client := listen(t, tc.network, from)
			if _, err := client.WriteToUDPAddrPort([]byte{1}, to); err != nil {
				t.Fatal(err)
			}
			_ = b.SetReadDeadline(time.Now().Add(2 * time.Second))
			_, src, err := b.ReadFrom(make([]byte, 16))
			if err != nil {
				t.Fatal(err)
			}
			if src.String() != client.LocalAddr().String() {
				t.Errorf("source %v, want %v", src, client.LocalAddr())
			}
			if n := testing.AllocsPerRun(100, func() { ipSink = src.(*net.UDPAddr).IP.To16() }); n != 0 {
				t.Errorf("source IP.To16(): %.0f allocations, want 0", n)
			}
		})
	}
}

// ipSink keeps To16's result on the heap, as pion's five-tuple keys do.
var ipSink net.IP
