package e2e

import (
	"fmt"
	"net/netip"
	"testing"
	"time"

	"github.com/l7mp/stunnerd-xdp/internal/config"
	"github.com/l7mp/stunnerd-xdp/internal/daemon"
	"github.com/l7mp/stunnerd-xdp/internal/loader"
)

// TestReloadRevokes: a reload that removes a peer's range from the cluster,
// or removes the session's user, stops the session's traffic within a
// second, in the kernel and in userspace alike: the channel leaves the maps
// and the relay socket drops what pion still relays on the permission it
// cannot take back. A reload that keeps both leaves the session alone.
func TestReloadRevokes(t *testing.T) {
	for _, mode := range []loader.Mode{loader.ModeNative, loader.ModeOff} {
		for _, what := range []string{"peer range", "user"} {
			t.Run(string(mode)+"/"+what, func(t *testing.T) {
				inRig(t, false, func(t *testing.T, r rig) { testReloadRevokes(t, r, mode, what) })
			})
		}
	}
}

func testReloadRevokes(t *testing.T, r rig, mode loader.Mode, what string) {
	var cfg daemon.Config
	d := startDaemon(t, mode, r.serverIfaces, func(c *daemon.Config) {
		c.AllowPeers = nil
		c.Users = map[string]string{user: password, "other": "pw"}
		c.Listeners = []config.ResolvedListener{{Name: "udp", Protocol: config.UDP, Addr: listenAddr,
			AllowPeers: []netip.Prefix{netip.MustParsePrefix("10.200.0.0/24")}, Allowlist: true}}
		cfg = *c
	})
	startEcho(t, r.peer, echoPeer)
	relay, err := allocateFrom(t, r.client)
	if err != nil {
		t.Fatal(err)
	}
	s := &taggedSession{}
	done := make(chan struct{})
	go func() {
		defer close(done)
		s.run(t, relay, sessionTags.Add(1), 200, 6*time.Second)
	}()
	// echoes waits for n echoes in all (200 a second).
	echoes := func(n int64, what string) {
		waitFor(t, fmt.Sprintf("%s: %d echoes", what, n), 10*time.Second, func() bool { return s.received.Load() >= n })
	}
	echoes(200, "before any reload")
	// An unrelated change first: nothing is revoked, a second more of echoes
	// comes.
	same := cfg
	same.Users = map[string]string{user: password}
	if err := d.Reconfigure(same); err != nil {
		t.Fatal(err)
	}
	echoes(s.received.Load()+200, "after the unrelated reload")
	if kept := s.received.Load(); time.Since(time.Unix(0, s.last.Load())) > 100*time.Millisecond {
		t.Fatalf("before the revoking reload: %d echoes, the last %v ago", kept, time.Since(time.Unix(0, s.last.Load())))
	}
	if p := snapshot(t, d); mode != loader.ModeOff && p.offloadSize != 1 {
		t.Fatalf("before the revoking reload: %d bindings in the maps, want 1", p.offloadSize)
	}
	next := cfg
	switch what {
	case "peer range":
		next.Users = map[string]string{user: password}
		next.Listeners = []config.ResolvedListener{{Name: "udp", Protocol: config.UDP, Addr: listenAddr,
			AllowPeers: []netip.Prefix{netip.MustParsePrefix("10.201.0.0/24")}, Allowlist: true}}
	case "user":
		next.Users = map[string]string{"other": "pw"}
	}
	reloaded, sentBefore := time.Now(), s.sent.Load()
	if err := d.Reconfigure(next); err != nil {
		t.Fatal(err)
	}
	<-done
	// Unless the session ran on well past the reload, no echo after it proves nothing.
	if after := s.sent.Load() - sentBefore; after < 200 {
		t.Fatalf("the session sent %d datagrams after the revoking reload, want 200 or more", after)
	}
	last := time.Unix(0, s.last.Load())
	t.Logf("%s: %d sent, %d echoed, the last %v after the reload", what, s.sent.Load(), s.received.Load(), last.Sub(reloaded))
	if last.Sub(reloaded) > time.Second {
		t.Errorf("echoes kept coming %v after the reload that revoked them", last.Sub(reloaded))
	}
	p := snapshot(t, d)
	if p.offloadSize != 0 {
		t.Errorf("%d bindings left in the maps after the reload", p.offloadSize)
	}
	if mode == loader.ModeOff && p.xdp.ClientToPeerPackets != 0 {
		t.Errorf("off, yet XDP relayed %d", p.xdp.ClientToPeerPackets)
	}
}
