package udpio

import (
	"net"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// setFields makes every datagram c sends carry ttl and tos (IPv4 options, and
// the IPv6 ones on an IPv6 socket).
func setFields(t *testing.T, c *net.UDPConn, v6 bool, ttl, tos int) {
	t.Helper()
	rc, err := c.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var serr error
	if err := rc.Control(func(fd uintptr) {
		if v6 {
			if serr = unix.SetsockoptInt(int(fd), unix.IPPROTO_IPV6, unix.IPV6_UNICAST_HOPS, ttl); serr != nil {
				return
			}
			serr = unix.SetsockoptInt(int(fd), unix.IPPROTO_IPV6, unix.IPV6_TCLASS, tos)
			return
		}
		if serr = unix.SetsockoptInt(int(fd), unix.IPPROTO_IP, unix.IP_TTL, ttl); serr != nil {
			return
		}
		serr = unix.SetsockoptInt(int(fd), unix.IPPROTO_IP, unix.IP_TOS, tos)
	}); err != nil {
		t.Fatal(err)
	}
	if serr != nil {
		t.Fatal(serr)
	}
}

type fieldsReader interface {
	net.PacketConn
	ReadFromFields([]byte) (int, net.Addr, Fields, error)
	WriteToFields([]byte, net.Addr, Fields) (int, error)
}

// TestFields: BatchConn and Conn report the TTL (hop limit) and TOS (traffic
// class, DSCP and ECN) every datagram arrived with, and send with the ones
// they are given, for IPv4, IPv6 and IPv4 on a dual-stack socket; a write
// without fields takes the socket's defaults.
func TestFields(t *testing.T) {
	for _, tc := range []struct {
		name, network, server, clientNet, client string
		v6                                       bool
	}{
		{"ipv4", "udp4", "127.0.0.1:0", "udp4", "127.0.0.1:0", false},
		{"ipv6", "udp6", "[::1]:0", "udp6", "[::1]:0", true},
		{"ipv4 on dual stack", "udp", "[::]:0", "udp4", "127.0.0.1:0", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sb, sc := listen(t, tc.network, tc.server), listen(t, tc.network, tc.server)
			b := batch(t, sb)
			one, err := NewConn(sc)
			if err != nil {
				t.Fatal(err)
			}
			client := listen(t, tc.clientNet, tc.client)
			// The client reads what the servers send with the fields too.
			cr, err := NewConn(client)
			if err != nil {
				t.Fatal(err)
			}
			setFields(t, client, tc.v6, 37, 0xB9)
			to := func(c *net.UDPConn) *net.UDPAddr {
				a := c.LocalAddr().(*net.UDPAddr)
				if a.IP.IsUnspecified() {
					return &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1), Port: a.Port}
				}
				return a
			}
			for _, srv := range []struct {
				name string
				c    fieldsReader
				sock *net.UDPConn
			}{{"BatchConn", b, sb}, {"Conn", one, sc}} {
				if _, err := client.WriteToUDP([]byte("in"), to(srv.sock)); err != nil {
					t.Fatal(err)
				}
				_ = srv.c.SetReadDeadline(time.Now().Add(2 * time.Second))
				buf := make([]byte, 100)
				n, from, f, err := srv.c.ReadFromFields(buf)
				if err != nil {
					t.Fatalf("%s: %v", srv.name, err)
				}
				if want := (Fields{TTL: 37, TOS: 0xB9, Valid: true}); f != want || string(buf[:n]) != "in" {
					t.Errorf("%s read %q with %+v, want %q with %+v", srv.name, buf[:n], f, "in", want)
				}
				for _, w := range []struct {
					f, want Fields
				}{
					{Fields{TTL: 9, TOS: 0x2A, Valid: true}, Fields{TTL: 9, TOS: 0x2A, Valid: true}},
					{Fields{TTL: 255, TOS: 0x03, Valid: true}, Fields{TTL: 255, TOS: 0x03, Valid: true}},
					// The socket's own: TTL (hop limit) 64, TOS 0.
					{Fields{}, Fields{TTL: 64, TOS: 0, Valid: true}},
				} {
					if _, err := srv.c.WriteToFields([]byte("out"), from, w.f); err != nil {
						t.Fatalf("%s: write with %+v: %v", srv.name, w.f, err)
					}
					_ = cr.SetReadDeadline(time.Now().Add(2 * time.Second))
					n, _, got, err := cr.ReadFromFields(buf)
					if err != nil {
						t.Fatalf("%s: %v", srv.name, err)
					}
					if got != w.want || string(buf[:n]) != "out" {
						t.Errorf("%s wrote with %+v: the client read %q with %+v, want %q with %+v", srv.name, w.f, buf[:n], got, "out", w.want)
					}
				}
			}
		})
	}
}

// TestForwarded: a relay sends TTL-1 and the TOS byte as it came, and drops a
// datagram whose TTL would reach 0.
func TestForwarded(t *testing.T) {
	for _, tc := range []struct {
		in, out Fields
		ok      bool
	}{
		{Fields{TTL: 64, TOS: 0xB9, Valid: true}, Fields{TTL: 63, TOS: 0xB9, Valid: true}, true},
		{Fields{TTL: 2, TOS: 3, Valid: true}, Fields{TTL: 1, TOS: 3, Valid: true}, true},
		{Fields{TTL: 1, TOS: 3, Valid: true}, Fields{}, false},
		{Fields{TTL: 0, Valid: true}, Fields{}, false},
		{Fields{}, Fields{}, true},
	} {
		out, ok := tc.in.Forwarded()
		if out != tc.out || ok != tc.ok {
			t.Errorf("%+v forwarded: %+v, %v; want %+v, %v", tc.in, out, ok, tc.out, tc.ok)
		}
		if UnpackFields(tc.in.Pack()) != tc.in && tc.in.Valid {
			t.Errorf("%+v packed and unpacked: %+v", tc.in, UnpackFields(tc.in.Pack()))
		}
	}
}
