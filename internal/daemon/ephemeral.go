package daemon

import (
	"crypto/hmac"
	"crypto/sha1" //nolint:gosec // the TURN REST API's HMAC, as STUNner and pion use it
	"encoding/base64"
	"log/slog"
	"net"
	"strconv"
	"strings"
	"time"

	"github.com/pion/turn/v4"
)

// ephemeralUsername reads a TURN REST API username as stunnerd does
// (pkg/authentication CheckTimeWindowedUsername): the expiry is the first
// ':'-separated field that is a number, anywhere, so EXPIRY:USER and
// USER:EXPIRY both work (pion's handler takes EXPIRY:USER only). user is the
// user-id the quota counts: the other field of a two-field name, else the
// whole name. ok is false for a name without an expiry.
func ephemeralUsername(username string) (expiry int64, user string, ok bool) {
	parts := strings.Split(username, ":")
	at := -1
	for i, p := range parts {
		if t, err := strconv.ParseInt(p, 10, 64); err == nil {
			expiry, at = t, i
			break
		}
	}
	if at < 0 || expiry == 0 {
		return 0, "", false
	}
	user = username
	if len(parts) == 2 {
		// stunnerd takes the user-id from EXPIRY:USER only and counts
		// USER:EXPIRY under the whole name, which changes with every
		// credential; here both orders count under USER.
		user = parts[1-at]
	}
	return expiry, user, true
}

// restAuthHandler is the TURN REST API (ephemeral) AuthHandler over secret:
// the password is base64(HMAC-SHA1(secret, username)), valid until the
// username's expiry; log (rate-limited) gets each refusal.
func restAuthHandler(secret string, now func() time.Time, log *slog.Logger) turn.AuthHandler {
	return func(username, realm string, src net.Addr) ([]byte, bool) {
		expiry, _, ok := ephemeralUsername(username)
		switch {
		case !ok:
			log.Info("ephemeral credential without an expiry", "user", username, "client", src.String())
			return nil, false
		case expiry < now().Unix():
			log.Info("ephemeral credential expired", "user", username, "client", src.String())
			return nil, false
		}
		mac := hmac.New(sha1.New, []byte(secret))
		mac.Write([]byte(username))
		pass := base64.StdEncoding.EncodeToString(mac.Sum(nil))
		return turn.GenerateAuthKey(username, realm, pass), true
	}
}
