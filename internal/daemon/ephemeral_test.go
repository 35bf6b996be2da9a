package daemon

import (
	"crypto/hmac"
	"crypto/sha1" //nolint:gosec // the TURN REST API's HMAC
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"syscall"
	"testing"
	"time"

	"github.com/pion/stun/v3"
	"github.com/pion/turn/v4"

	"github.com/l7mp/stunnerd-xdp/internal/config"
	"github.com/l7mp/stunnerd-xdp/internal/loader"
	"github.com/l7mp/stunnerd-xdp/internal/logging"
	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

func TestEphemeralUsername(t *testing.T) {
	for _, c := range []struct {
		name   string
		expiry int64
		user   string
		ok     bool
	}{
		{"1700000000:alice", 1700000000, "alice", true},
		{"alice:1700000000", 1700000000, "alice", true},
		{"1700000000", 1700000000, "1700000000", true},
		{"ns:1700000000:alice", 1700000000, "ns:1700000000:alice", true}, // stunnerd: the whole name
		{"alice:bob", 0, "", false},
		{"alice", 0, "", false},
		{"0:alice", 0, "", false},
	} {
		expiry, user, ok := ephemeralUsername(c.name)
		if expiry != c.expiry || user != c.user || ok != c.ok {
			t.Errorf("%q: %d %q %v, want %d %q %v", c.name, expiry, user, ok, c.expiry, c.user, c.ok)
		}
	}
}

// restPassword is the TURN REST API password of username.
func restPassword(secret, username string) string {
	mac := hmac.New(sha1.New, []byte(secret))
	mac.Write([]byte(username))
	return base64.StdEncoding.EncodeToString(mac.Sum(nil))
}

// The handler's key is the one pion's own TURN REST handler derives, for
// both orders; expired and expiry-less names are refused.
func TestRestAuthHandler(t *testing.T) {
	now := time.Unix(1_700_000_000, 0)
	h := restAuthHandler("s3cret", func() time.Time { return now }, slog.New(slog.NewTextHandler(io.Discard, nil)))
	src := &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 1}
	for _, name := range []string{"1700000060:alice", "alice:1700000060"} {
		key, ok := h(name, "r", src)
		if want := turn.GenerateAuthKey(name, "r", restPassword("s3cret", name)); !ok || string(key) != string(want) {
			t.Errorf("%q: %x %v, want the key of its REST password", name, key, ok)
		}
	}
	for _, name := range []string{"1699999999:alice", "alice:1699999999", "alice"} {
		if _, ok := h(name, "r", src); ok {
			t.Errorf("%q accepted", name)
		}
	}
}

// A pion/turn client allocates with ephemeral credentials written either
// way, as stunnerd lets it (pion's own handler refuses USER:EXPIRY with 401);
// both count against one user-id's quota.
func TestEphemeralBothOrders(t *testing.T) {
	lf, err := logging.New("all:WARN", "text", &testenv.LockedBuffer{})
	if err != nil {
		t.Fatal(err)
	}
	var (
		d      *Daemon
		listen netip.AddrPort
	)
	for try := 1; ; try++ {
		listen = netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), freePort(t))
		d, err = Start(Config{
			Listeners:    []config.ResolvedListener{{Name: "udp", Protocol: config.UDP, Addr: listen}},
			Secret:       "s3cret",
			RelayAddress: netip.MustParseAddr("127.0.0.1"),
			MinRelayPort: 61000, MaxRelayPort: 61999,
			XDPMode:   loader.ModeOff,
			UserQuota: 2,
			Logger:    lf,
		})
		if errors.Is(err, syscall.EADDRINUSE) && try < 5 {
			continue
		}
		if err != nil {
			t.Fatal(err)
		}
		break
	}
	defer d.Close()
	exp := time.Now().Add(time.Hour).Unix()
	for _, name := range []string{fmt.Sprintf("%d:alice", exp), fmt.Sprintf("alice:%d", exp)} {
		if _, err := allocateUser(t, listen, name, restPassword("s3cret", name), false); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
	}
	// alice's third allocation, in either order, is over her quota of 2.
	name := fmt.Sprintf("alice:%d", exp+1)
	_, err = allocateUser(t, listen, name, restPassword("s3cret", name), false)
	wantQuotaReached(t, err, "alice's third allocation")
	name = fmt.Sprintf("%d:bob", exp)
	if _, err := allocateUser(t, listen, name, restPassword("s3cret", name), false); err != nil {
		t.Fatalf("bob: %v", err)
	}
	// A wrong password and an expired name: refused (pion answers a failed
	// authentication with 400, whichever handler says no).
	for _, c := range [][2]string{{fmt.Sprintf("carol:%d", exp), "wrong"}, {fmt.Sprintf("carol:%d", time.Now().Add(-time.Minute).Unix()), ""}} {
		pass := c[1]
		if pass == "" {
			pass = restPassword("s3cret", c[0])
		}
		_, err := allocateUser(t, listen, c[0], pass, false)
		var te *stun.TurnError
		if !errors.As(err, &te) || (te.ErrorCodeAttr.Code != stun.CodeUnauthorized && te.ErrorCodeAttr.Code != stun.CodeBadRequest) {
			t.Errorf("%s: %v, want 400 or 401", c[0], err)
		}
	}
}
