package netns

import (
	"net"
	"strings"
	"testing"
	"time"

	"github.com/pion/turn/v4"

	"github.com/l7mp/stunnerd-xdp/internal/testenv"
)

// Allocate makes a pion/turn allocation from a socket made inside the namespace, so that its
// packets leave from there while pion's goroutines, on other threads, only use it: a UDP socket
// bound to local for network "udp4" or "udp6" (port 0 for any), or a TCP connection to
// cfg.TURNServerAddr for "tcp4" (local unused). It sets cfg.Conn, and STUNServerAddr to the TURN
// server when empty; the rest is testenv.Allocate: the Allocate's outcome, everything closed at
// cleanup, a socket that cannot be made fails the test.
func (n *NS) Allocate(t testing.TB, network, local string, cfg turn.ClientConfig) (net.PacketConn, error) {
	t.Helper()
	if err := n.Do(func() error {
		if strings.HasPrefix(network, "tcp") {
			c, err := net.DialTimeout(network, cfg.TURNServerAddr, 2*time.Second)
			if err == nil {
				cfg.Conn = turn.NewSTUNConn(c)
			}
			return err
		}
		var err error
		cfg.Conn, err = net.ListenPacket(network, local)
		return err
	}); err != nil {
		t.Fatalf("netns %s: client socket for %s: %v", n.Name, cfg.TURNServerAddr, err)
	}
	if cfg.STUNServerAddr == "" {
		cfg.STUNServerAddr = cfg.TURNServerAddr
	}
	return testenv.Allocate(t, &cfg)
}
