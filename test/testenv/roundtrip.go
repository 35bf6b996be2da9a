package testenv

import (
	"net"
	"testing"
	"time"
)

// RoundTrip relays a datagram from the client through relay to peer and the
// answer back. pion/turn v4's client STUNConn waits for more after a frame
// under 9 bytes (consumeSingleTURNFrame): payloads of 9 bytes or more.
func RoundTrip(t testing.TB, relay, peer net.PacketConn) {
	t.Helper()
	if _, err := relay.WriteTo([]byte("ping-ping"), peer.LocalAddr()); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 64)
	_ = peer.SetReadDeadline(time.Now().Add(Timeout(5 * time.Second)))
	n, from, err := peer.ReadFrom(buf)
	if err != nil || string(buf[:n]) != "ping-ping" {
		t.Fatalf("at the peer: %q, %v", buf[:n], err)
	}
	if _, err := peer.WriteTo([]byte("pong-pong"), from); err != nil {
		t.Fatal(err)
	}
	_ = relay.SetReadDeadline(time.Now().Add(Timeout(5 * time.Second)))
	if n, _, err = relay.ReadFrom(buf); err != nil || string(buf[:n]) != "pong-pong" {
		t.Fatalf("back at the client: %q, %v", buf[:n], err)
	}
}
