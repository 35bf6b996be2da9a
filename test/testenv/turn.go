package testenv

import (
	"net"
	"testing"

	"github.com/pion/turn/v4"
)

// Allocate makes a TURN allocation with pion/turn's client as cfg says (its
// Conn is the client's socket) and returns the Allocate's outcome; the
// client, the allocation and the socket are closed at cleanup. Failures to
// set the client up fail the test.
func Allocate(t testing.TB, cfg *turn.ClientConfig) (net.PacketConn, error) {
	t.Helper()
	_, relay, err := AllocateClient(t, cfg)
	return relay, err
}

// AllocateClient is Allocate that also returns the client, for requests of
// the test's own (a Refresh) on the allocation's 5-tuple.
func AllocateClient(t testing.TB, cfg *turn.ClientConfig) (*turn.Client, net.PacketConn, error) {
	t.Helper()
	t.Cleanup(func() { cfg.Conn.Close() })
	c, err := turn.NewClient(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	if err := c.Listen(); err != nil {
		t.Fatal(err)
	}
	relay, err := c.Allocate()
	if err == nil {
		t.Cleanup(func() { relay.Close() })
	}
	return c, relay, err
}
