package userspace

import (
	"bytes"
	"net"
	"testing"
	"time"

	"github.com/pion/turn/v4"
	"golang.org/x/sys/unix"

	"github.com/l7mp/stunnerd-xdp/internal/udpio"
)

// sendingWith opens a loopback UDP socket that sends with ttl and tos and
// reads with the fields.
func sendingWith(t testing.TB, ttl, tos int) *udpio.Conn {
	t.Helper()
	u := listenUDP(t).(*net.UDPConn)
	rc, err := u.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	_ = rc.Control(func(fd uintptr) {
		if err = unix.SetsockoptInt(int(fd), unix.IPPROTO_IP, unix.IP_TTL, ttl); err == nil {
			err = unix.SetsockoptInt(int(fd), unix.IPPROTO_IP, unix.IP_TOS, tos)
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	c, err := udpio.NewConn(u)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// readWith reads one datagram from c and fails unless it is want with f.
func readWith(t *testing.T, what string, c *udpio.Conn, want []byte, f udpio.Fields) {
	t.Helper()
	_ = c.SetReadDeadline(time.Now().Add(2 * time.Second))
	buf := make([]byte, 1600)
	n, _, got, err := c.ReadFromFields(buf)
	if err != nil {
		t.Fatalf("%s: %v", what, err)
	}
	if !bytes.Equal(buf[:n], want) || got != f {
		t.Errorf("%s: got %x with %+v, want %x with %+v", what, buf[:n], got, want, f)
	}
}

// TestFieldsAcrossPion: over loopback sockets wrapped as the daemon wraps
// them, what pion relays (and the shortcut) leaves with the TTL of the
// datagram it relays less one and its TOS, in both directions; a datagram
// pion writes for another source, or data that is not the datagram the relay
// socket read, goes with the socket's defaults; TTL 1 is dropped.
func TestFieldsAcrossPion(t *testing.T) {
	for _, shortcut := range []bool{true, false} {
		name := "pion"
		if shortcut {
			name = "shortcut"
		}
		t.Run(name, func(t *testing.T) {
			w := newWrapped(t)
			counters, tbl, raw, gen := w.counters, w.tbl, w.raw, w.gen
			h := tbl.EventHandler(turn.EventHandler{})
			lc := w.listenerConn(shortcut, nil)
			client, other := sendingWith(t, 37, 0xB9), sendingWith(t, 5, 0x04)
			peerSock := sendingWith(t, 23, 0x2A)
			clientAddr, peerAddr := client.LocalAddr(), peerSock.LocalAddr()
			relay, relayAddr, err := gen.AllocatePacketConn("udp4", 0)
			if err != nil {
				t.Fatal(err)
			}
			defer relay.Close()
			h.OnAllocationCreated(clientAddr, raw.LocalAddr(), "UDP", "u", "r", relayAddr, 0)
			h.OnChannelCreated(clientAddr, raw.LocalAddr(), "UDP", "u", "r", relayAddr, peerAddr, 0x4000)

			// A write before the read loop read anything takes the defaults.
			if _, err := relay.WriteTo([]byte("first"), peerAddr); err != nil {
				t.Fatal(err)
			}
			readWith(t, "a write before any read", peerSock, []byte("first"), udpio.Fields{TTL: 64, TOS: 0, Valid: true})

			// Client->peer: ChannelData (with the shortcut, followed by a
			// datagram for pion, so that ReadFrom returns).
			data := []byte("client data")
			if _, err := client.WriteTo(chanData(0x4000, len(data), data), raw.LocalAddr()); err != nil {
				t.Fatal(err)
			}
			if shortcut {
				if _, err := client.WriteTo([]byte("x"), raw.LocalAddr()); err != nil {
					t.Fatal(err)
				}
			}
			buf := make([]byte, 1600)
			n, _, err := lc.ReadFrom(buf)
			if err != nil {
				t.Fatal(err)
			}
			if shortcut && n != 1 {
				t.Fatalf("the shortcut handed pion %x", buf[:n])
			}
			if !shortcut {
				// pion's handler writes the data to the relay socket.
				if _, err := relay.WriteTo(buf[4:n], peerAddr); err != nil {
					t.Fatal(err)
				}
			}
			readWith(t, "ChannelData at the peer", peerSock, data, udpio.Fields{TTL: 36, TOS: 0xB9, Valid: true})
			// Another source's datagram is being handled: the relay socket's
			// write is not its own client's.
			if _, err := other.WriteTo([]byte("x"), raw.LocalAddr()); err != nil {
				t.Fatal(err)
			}
			if _, _, err := lc.ReadFrom(buf); err != nil {
				t.Fatal(err)
			}
			if _, err := relay.WriteTo([]byte("stray"), peerAddr); err != nil {
				t.Fatal(err)
			}
			readWith(t, "a write for another source", peerSock, []byte("stray"), udpio.Fields{TTL: 64, TOS: 0, Valid: true})

			// Peer->client: TTL 1 is dropped, the next relayed as pion does.
			expired := sendingWith(t, 1, 0)
			if _, err := expired.WriteTo([]byte("ttl 1"), relayAddr); err != nil {
				t.Fatal(err)
			}
			echo := []byte("peer data")
			if _, err := peerSock.WriteTo(echo, relayAddr); err != nil {
				t.Fatal(err)
			}
			_ = relay.SetReadDeadline(time.Now().Add(2 * time.Second))
			n, src, err := relay.ReadFrom(buf)
			if err != nil || !bytes.Equal(buf[:n], echo) || src.String() != peerAddr.String() {
				t.Fatalf("the relay socket read %q from %v (%v), want %q from %v", buf[:n], src, err, echo, peerAddr)
			}
			if got := counters.TTLExpired.Load(); got != 1 {
				t.Errorf("TTLExpired %d, want 1", got)
			}
			if _, err := lc.WriteTo(chanData(0x4000, n, buf[:n]), clientAddr); err != nil {
				t.Fatal(err)
			}
			readWith(t, "ChannelData at the client", client, chanData(0x4000, len(echo), echo), udpio.Fields{TTL: 22, TOS: 0x2A, Valid: true})
			// Data of another length is not what the relay socket read.
			if _, err := lc.WriteTo(chanData(0x4000, 2, []byte("no")), clientAddr); err != nil {
				t.Fatal(err)
			}
			readWith(t, "other data at the client", client, chanData(0x4000, 2, []byte("no")), udpio.Fields{TTL: 64, TOS: 0, Valid: true})
		})
	}
}
