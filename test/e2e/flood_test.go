package e2e

import (
	"fmt"
	"math/rand/v2"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/pion/stun/v3"

	"github.com/l7mp/stunnerd-xdp/internal/config"
	"github.com/l7mp/stunnerd-xdp/test/netns"
	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// TestJunkFloodLogsBounded: at the default log level, a stranger's 20,000
// datagrams to a live relay port (from an address without a permission:
// pion logs each at INFO) and 20,000 bogus STUN requests to the listener
// (10,000 Allocates from unknown users with a valid nonce, each an INFO line,
// and 10,000 undecodable ones) add at most 100 log lines, while a session
// keeps relaying through the same daemon.
func TestJunkFloodLogsBounded(t *testing.T) {
	r := parentRig(t)
	// A second peer-side address: the session's permission covers the peer's
	// IP (10.200.0.2), so junk from it would be relayed, not refused.
	r.Peer.IP(t, "addr", "add", "10.200.0.3/24", "dev", r.PeerIf.Name)
	// The policy admits it (a peer the policy refuses is dropped by the
	// relay socket before pion, silently): its junk reaches pion's
	// permission check, which logs it.
	p := startBinary(t, r, "--log=all:INFO", "--allow-peer=10.200.0.3/32") // the default level, said explicitly
	startEcho(t, r.Peer, echoPeer)
	relay, err := allocateFrom(t, r.Client)
	if err != nil {
		t.Fatal(err)
	}
	relayPort := relay.LocalAddr().(*net.UDPAddr).Port
	type result struct{ sent, received int }
	done := make(chan result, 1)
	go func() {
		s, n, _ := echoSession(t, relay, 500, 6*time.Second)
		done <- result{s, n}
	}()
	// The floods start once the session's channel is bound and offloaded.
	if err := netns.Eventually(10*time.Second, 20*time.Millisecond, func() error {
		if st := status(t, r.Server); st.XDP.Channels != 1 || st.XDP.Offloaded != 1 {
			return fmt.Errorf("%+v", st)
		}
		return nil
	}); err != nil {
		t.Fatalf("the session's channel: %v", err)
	}
	before := strings.Count(p.Stderr(), "\n")

	const junk = 20000
	if err := r.Peer.Do(func() error {
		c, err := net.ListenPacket("udp4", "10.200.0.3:0")
		if err != nil {
			return err
		}
		defer c.Close()
		to := &net.UDPAddr{IP: net.ParseIP("10.200.0.1"), Port: relayPort}
		return paced(junk, func(i int) error {
			_, err := c.WriteTo(fmt.Appendf(nil, "junk %d", i), to)
			return err
		})
	}); err != nil {
		t.Fatal(err)
	}
	if err := r.Client.Do(func() error { return bogusSTUN(junk) }); err != nil {
		t.Fatal(err)
	}
	res := <-done
	time.Sleep(500 * time.Millisecond) // the daemon's last lines
	out := p.Stderr()
	lines := strings.Split(out, "\n")
	added := lines[before : len(lines)-1]
	count := func(s string) (n int) {
		for _, l := range added {
			if strings.Contains(l, s) {
				n++
			}
		}
		return n
	}
	permission, unknown := count("No Permission or Channel exists"), count("unknown user")
	t.Logf("%d log lines during the floods (%d about datagrams without permission, %d about unknown users); session %d of %d echoes",
		len(added), permission, unknown, res.received, res.sent)
	// The floods reached what logs them: else this test proves nothing.
	if permission == 0 || unknown == 0 {
		t.Errorf("the floods did not reach pion's relay socket or the authentication:\n%s", strings.Join(added, "\n"))
	}
	if len(added) > 100 {
		t.Errorf("%d log lines, want at most 100; the first ones:\n%s", len(added), strings.Join(added[:20], "\n"))
	}
	if res.received < res.sent*99/100 {
		t.Errorf("the session lost echoes during the floods: %d of %d", res.received, res.sent)
	}
}

// paced calls send n times, in bursts of 200 with a pause after each, so the
// daemon's sockets see the flood rather than the sender's buffer overflowing.
func paced(n int, send func(i int) error) error {
	for i := range n {
		if err := send(i); err != nil {
			return err
		}
		if i%200 == 199 {
			time.Sleep(5 * time.Millisecond)
		}
	}
	return nil
}

// bogusSTUN sends n bogus requests to the listener from a fresh socket: half
// Allocates from unknown users with the nonce a first unauthenticated
// Allocate got (so that they reach the credential check), half STUN-looking
// bytes that do not decode.
func bogusSTUN(n int) error {
	c, err := net.ListenPacket("udp4", "10.100.0.2:0")
	if err != nil {
		return err
	}
	defer c.Close()
	to := net.UDPAddrFromAddrPort(listenAddr)
	req := stun.MustBuild(stun.TransactionID, stun.NewType(stun.MethodAllocate, stun.ClassRequest), stun.Fingerprint)
	if _, err := c.WriteTo(req.Raw, to); err != nil {
		return err
	}
	_ = c.SetReadDeadline(time.Now().Add(testenv.Timeout(2 * time.Second)))
	buf := make([]byte, 1500)
	m, _, err := c.ReadFrom(buf)
	if err != nil {
		return fmt.Errorf("no answer to an unauthenticated Allocate: %w", err)
	}
	res := &stun.Message{Raw: buf[:m]}
	if err := res.Decode(); err != nil {
		return err
	}
	var nonce stun.Nonce
	if err := nonce.GetFrom(res); err != nil {
		return fmt.Errorf("the 401 has no nonce: %w", err)
	}
	return paced(n, func(i int) error {
		var raw []byte
		if i%2 == 0 {
			user := fmt.Sprint("mallory", i)
			m := stun.MustBuild(stun.TransactionID, stun.NewType(stun.MethodAllocate, stun.ClassRequest),
				stun.NewUsername(user), stun.NewRealm(config.DefaultRealm), nonce,
				stun.NewLongTermIntegrity(user, config.DefaultRealm, "guess"), stun.Fingerprint)
			raw = m.Raw
		} else {
			raw = make([]byte, 20+rand.IntN(60))
			for j := range raw {
				raw[j] = byte(rand.Uint32())
			}
			raw[0] &= 0x3f // looks like STUN (the top two bits zero)
		}
		_, err := c.WriteTo(raw, to)
		return err
	})
}
