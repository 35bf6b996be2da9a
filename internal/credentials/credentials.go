// Package credentials holds the TURN credentials in force: static long-term
// users and STUNner's ephemeral (TURN REST API) usernames. A reload replaces
// them whole, so that live allocations are not touched; pion/turn asks them
// through Authenticate, the quota through UserID, the revocation of removed
// users through Known.
package credentials

import (
	"crypto/hmac"
	"crypto/sha1" //nolint:gosec // the TURN REST API's HMAC, as STUNner and pion use it
	"encoding/base64"
	"log/slog"
	"net"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/pion/turn/v4"
)

// Set is what a configuration says about who may allocate.
type Set struct {
	// Realm is the realm keys are derived with.
	Realm string
	// Users are static long-term credentials (username -> password).
	Users map[string]string
	// Secret, when set, switches to ephemeral credentials.
	Secret string
}

// Store is the credentials in force; its methods are safe for concurrent use
// and see a Replace whole.
type Store struct {
	cur atomic.Pointer[state]
	// log gets what anyone who can send a datagram can trigger (unknown
	// users, malformed or expired names): rate-limited by the caller.
	log *slog.Logger
}

type state struct {
	realm string
	keys  map[string][]byte // static users
	rest  turn.AuthHandler  // ephemeral credentials
}

// New returns a store holding s; log must be rate-limited.
func New(s Set, log *slog.Logger) *Store {
	st := &Store{log: log}
	st.Replace(s)
	return st
}

// Replace puts s in force for every later request.
func (st *Store) Replace(s Set) {
	n := &state{realm: s.Realm, keys: map[string][]byte{}}
	for u, p := range s.Users {
		n.keys[u] = turn.GenerateAuthKey(u, s.Realm, p)
	}
	if s.Secret != "" {
		// stunnerd's username forms (USER:EXPIRY too).
		n.rest = restAuthHandler(s.Secret, time.Now, st.log)
	}
	st.cur.Store(n)
}

// Authenticate is pion/turn's AuthHandler over the credentials in force.
func (st *Store) Authenticate(username, realm string, src net.Addr) ([]byte, bool) {
	s := st.cur.Load()
	if s.rest != nil {
		return s.rest(username, realm, src)
	}
	key, ok := s.keys[username]
	if !ok {
		st.log.Info("unknown user", "user", username, "client", src.String())
	}
	return key, ok
}

// Known says whether user may still relay: a static user the credentials
// still have. Ephemeral credentials name no users to remove (a new secret
// leaves live allocations, as in STUNner).
func (st *Store) Known(user string) bool {
	s := st.cur.Load()
	if s.rest != nil {
		return true
	}
	_, ok := s.keys[user]
	return ok
}

// UserID is the identity a user quota counts: the username, or for
// ephemeral credentials, EXPIRY:USERID or USERID:EXPIRY, the user-id beside
// the expiry (EphemeralUsername), so that fresh credentials for one user-id
// share its quota (as STUNner's UserQuota does for EXPIRY:USERID).
func (st *Store) UserID(username string) string {
	if st.cur.Load().rest != nil {
		if _, id, ok := EphemeralUsername(username); ok {
			return id
		}
	}
	return username
}

// EphemeralUsername reads a TURN REST API username as stunnerd does
// (pkg/authentication CheckTimeWindowedUsername): the expiry is the first
// ':'-separated field that is a number, anywhere, so EXPIRY:USER and
// USER:EXPIRY both work (pion's handler takes EXPIRY:USER only). user is the
// user-id the quota counts: the other field of a two-field name, else the
// whole name. ok is false for a name without an expiry.
func EphemeralUsername(username string) (expiry int64, user string, ok bool) {
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
		expiry, _, ok := EphemeralUsername(username)
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
