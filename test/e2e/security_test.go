package e2e

import (
	"errors"
	"fmt"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/pion/stun/v3"
	"github.com/pion/turn/v4"

	"github.com/l7mp/stunnerd-xdp/internal/config"
	"github.com/l7mp/stunnerd-xdp/internal/loader"
	"github.com/l7mp/stunnerd-xdp/test/netns"
)

// TestMetadataPeerRefused: a client asks for a permission to the cloud
// metadata address; pion/turn refuses it with an error response, so nothing
// reaches the maps and neither path relays anything to it.
func TestMetadataPeerRefused(t *testing.T) {
	inRig(t, false, func(t *testing.T, r rig) {
		d := startDaemon(t, loader.ModeNative, r.serverIfaces, nil)
		conn, err := net.ListenPacket("udp4", "10.100.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		c, err := turn.NewClient(&turn.ClientConfig{
			TURNServerAddr: listenAddr.String(), STUNServerAddr: listenAddr.String(),
			Username: user, Password: password, Realm: config.DefaultRealm, Conn: conn,
		})
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		if err := c.Listen(); err != nil {
			t.Fatal(err)
		}
		relay, err := c.Allocate()
		if err != nil {
			t.Fatal(err)
		}
		defer relay.Close()
		metadata := &net.UDPAddr{IP: net.IPv4(169, 254, 169, 254), Port: 80}
		err = c.CreatePermission(metadata)
		// The daemon answers 403 (turnguard; pion/turn alone answers without
		// an error code); its client returns no TurnError to test for: the
		// text is all there is.
		if err == nil || !strings.Contains(err.Error(), "error 403") {
			t.Fatalf("CreatePermission to %v: %v, want a 403", metadata, err)
		}
		// Sending makes pion's client ask for the permission (and then a
		// channel) again; each time it is refused.
		for i := 0; i < 5; i++ {
			_, _ = relay.WriteTo([]byte("metadata, please"), metadata)
		}
		time.Sleep(500 * time.Millisecond)
		p := snapshot(t, d)
		if p.offloadSize != 0 || p.userC2P != 0 || p.xdp.ClientToPeerPackets != 0 {
			t.Fatalf("something was relayed or offloaded towards %v: %v, %d bindings", metadata, p, p.offloadSize)
		}
		if _, ch := d.Mirror().Counts(); ch != 0 {
			t.Fatalf("pion holds %d channels", ch)
		}
		// An allowed peer on the same allocation still works.
		peer := &net.UDPAddr{IP: net.ParseIP(peerAddr), Port: 5001}
		if err := c.CreatePermission(peer); err != nil {
			t.Fatalf("CreatePermission to the rig's peer: %v", err)
		}
	})
}

// TestCrashRestart: kill -9 during traffic detaches the program; a restarted
// daemon starts from clean maps and serves new allocations at once.
func TestCrashRestart(t *testing.T) {
	r := parentRig(t)
	startEcho(t, r.Peer, echoPeer)
	p := startBinary(t, r)
	relay, err := allocateFrom(t, r.Client)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan int, 1)
	go func() {
		_, n, _ := echoSession(t, relay, 1000, 3*time.Second)
		done <- n
	}()
	if err := netns.Eventually(10*time.Second, 50*time.Millisecond, func() error {
		if st := status(t, r.Server); st.XDP.Offloaded != 1 {
			return fmt.Errorf("%+v", st)
		}
		return nil
	}); err != nil {
		t.Fatalf("before the crash: %v", err)
	}
	_ = p.Kill()
	_ = p.Wait(5 * time.Second)
	for _, i := range r.ServerIfaces() {
		if xdpAttached(t, r.Server, i) {
			t.Fatalf("XDP still attached to %s after kill -9", i)
		}
	}
	echoed := <-done
	t.Logf("%d echoes before and after the crash (the old allocation died with the daemon)", echoed)

	start := time.Now() // the binary is built already: the clock measures the restart
	p2 := startBinary(t, r)
	if st := status(t, r.Server); st.AllocationCount != 0 || st.XDP.Offloaded != 0 || st.XDP.Channels != 0 {
		t.Fatalf("restarted daemon does not start clean: %+v", st)
	}
	relay2, err := allocateFrom(t, r.Client)
	if err != nil {
		t.Fatalf("new allocation after restart: %v", err)
	}
	sent, received, _ := echoSession(t, relay2, 500, 2*time.Second)
	t.Logf("after restart (%v to first allocation): %d sent, %d echoed; %s", time.Since(start).Round(time.Millisecond), sent, received, fmt.Sprint(status(t, r.Server)))
	if float64(received) < 0.99*float64(sent) {
		t.Fatalf("after restart %d of %d echoes", received, sent)
	}
	if st := status(t, r.Server); st.XDP.Offloaded != 1 {
		t.Fatalf("the new allocation's channel is not in the maps: %+v", st)
	}
	_ = p2.Stop()
}

// turnErrorCode is the code of a TURN error response pion/turn's client
// returned; 0 for any other error and for none.
func turnErrorCode(err error) stun.ErrorCode {
	var te *stun.TurnError
	if errors.As(err, &te) {
		return te.ErrorCodeAttr.Code
	}
	return 0
}
