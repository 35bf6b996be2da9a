package netns

import (
	"fmt"
	"net"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/pion/turn/v4"

	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// Allocate makes a pion/turn allocation from a socket made inside the namespace, so that its
// packets leave from there while pion's goroutines, on other threads, only use it: a UDP socket
// bound to local for network "udp4" or "udp6" (port 0 for any), or a TCP connection to
// cfg.TURNServerAddr for "tcp4" (local unused). It sets cfg.Conn (the caller may read the
// client's address there), and STUNServerAddr to the TURN server when empty; the rest is
// testenv.Allocate: the Allocate's outcome, everything closed at cleanup, a socket that cannot be
// made fails the test.
func (n *NS) Allocate(t testing.TB, network, local string, cfg *turn.ClientConfig) (net.PacketConn, error) {
	t.Helper()
	if err := n.Do(func() error {
		if strings.HasPrefix(network, "tcp") {
			c, err := net.DialTimeout(network, cfg.TURNServerAddr, testenv.Timeout(2*time.Second))
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
	return testenv.Allocate(t, cfg)
}

// TurncatPort is where StartTurncat's turncat listens, on 127.0.0.1.
const TurncatPort = 5000

// StartTurncat runs STUNner's turncat (Binary(Turncat)) in the namespace, tunnelling
// udp://127.0.0.1:5000 through the TURN server of turnURI (turn://user:pass@host:port) to
// peer (host:port), as STUNner's simple-tunnel guide does, and waits until it listens; it
// allocates on the first datagram.
func (n *NS) StartTurncat(t testing.TB, turnURI, peer string) *Proc {
	t.Helper()
	p := n.Start(t, RequireBinary(t, Turncat), "--log=all:WARN", fmt.Sprintf("udp://127.0.0.1:%d", TurncatPort), turnURI, "udp://"+peer)
	if err := n.WaitUDPBound(TurncatPort, 5*time.Second, p); err != nil {
		t.Fatalf("turncat: %v", err)
	}
	return p
}

// TurncatRmem is net.core.rmem_default while turncat runs (RaiseRmemDefault). turncat has no
// flag for its socket buffers, and with the default 208 KiB its loopback socket holds about 13 ms
// of a 20,000 packet/s stream: on a shared two-core VM stalls that long happen every few runs
// and show up as loss at the iperf server that no relay caused.
const TurncatRmem = "4194304"

// RaiseRmemDefault sets net.core.rmem_default, which is global rather than per namespace, to
// TurncatRmem; it returns the old value and the function that restores it.
func RaiseRmemDefault() (old string, restore func(), err error) {
	const knob = "/proc/sys/net/core/rmem_default"
	b, err := os.ReadFile(knob)
	if err == nil {
		err = os.WriteFile(knob, []byte(TurncatRmem), 0)
	}
	if err != nil {
		return "", nil, err
	}
	return strings.TrimSpace(string(b)), func() { _ = os.WriteFile(knob, b, 0) }, nil
}
