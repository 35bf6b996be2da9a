package daemon

import (
	"crypto/tls"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/pion/turn/v4"

	"github.com/l7mp/stunnerd-xdp/internal/config"
	"github.com/l7mp/stunnerd-xdp/internal/connlimit"
	"github.com/l7mp/stunnerd-xdp/internal/loader"
	"github.com/l7mp/stunnerd-xdp/internal/logging"
	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// A TURN-TLS listener behind connlimit serves a pion/turn client (the TLS
// handshake runs in the connection's first Read), and its connection counts
// toward the limits; an idle TLS connection is closed at the idle timeout.
func TestTLSListenerThroughLimits(t *testing.T) {
	cert, _, _ := testenv.SelfSigned(t)
	lf, err := logging.New("all:WARN", "text", &testenv.LockedBuffer{})
	if err != nil {
		t.Fatal(err)
	}
	listen := netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), freePort(t))
	lim := connlimit.Defaults()
	lim.IdleTimeout = 500 * time.Millisecond
	d, err := Start(Config{
		Listeners:    []config.ResolvedListener{{Name: "tls", Protocol: config.TLS, Addr: listen, Cert: &cert}},
		Users:        map[string]string{"alice": "a"},
		RelayAddress: netip.MustParseAddr("127.0.0.1"),
		MinRelayPort: 62000, MaxRelayPort: 62099,
		XDPMode:    loader.ModeOff,
		ConnLimits: lim,
		Logger:     lf,
	})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	tc, err := tls.Dial("tcp4", listen.String(), &tls.Config{InsecureSkipVerify: true})
	if err != nil {
		t.Fatal(err)
	}
	relay, err := testenv.Allocate(t, &turn.ClientConfig{TURNServerAddr: listen.String(), STUNServerAddr: listen.String(),
		Username: "alice", Password: "a", Realm: config.DefaultRealm, Conn: turn.NewSTUNConn(tc)})
	if err != nil {
		t.Fatalf("allocation over TLS: %v", err)
	}
	defer relay.Close()
	if open := d.Guards().Conns.Open; open != 1 {
		t.Fatalf("%d connections counted, want 1", open)
	}
	idle, err := tls.Dial("tcp4", listen.String(), &tls.Config{InsecureSkipVerify: true})
	if err != nil {
		t.Fatal(err)
	}
	defer idle.Close()
	_ = idle.SetReadDeadline(time.Now().Add(3 * time.Second))
	if _, err := idle.Read(make([]byte, 1)); err == nil || isTimeout(err) {
		t.Fatalf("an idle TLS connection: %v, want it closed", err)
	}
	if got := d.Guards().Conns.IdleTimeouts; got < 1 {
		t.Fatalf("%d idle timeouts counted", got)
	}
}

func isTimeout(err error) bool {
	ne, ok := err.(net.Error)
	return ok && ne.Timeout()
}
