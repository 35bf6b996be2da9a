package daemon

import (
	"crypto/hmac"
	"crypto/sha1" //nolint:gosec // the TURN REST API's HMAC
	"encoding/base64"
	"errors"
	"fmt"
	"net/netip"
	"syscall"
	"testing"
	"time"

	"github.com/pion/stun/v3"

	"github.com/l7mp/stunnerd-xdp/internal/config"
	"github.com/l7mp/stunnerd-xdp/internal/loader"
	"github.com/l7mp/stunnerd-xdp/internal/logging"
	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// restPassword is the TURN REST API password of username.
func restPassword(secret, username string) string {
	mac := hmac.New(sha1.New, []byte(secret))
	mac.Write([]byte(username))
	return base64.StdEncoding.EncodeToString(mac.Sum(nil))
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
