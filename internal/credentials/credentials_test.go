package credentials

import (
	"crypto/hmac"
	"crypto/sha1" //nolint:gosec // the TURN REST API's HMAC
	"encoding/base64"
	"io"
	"log/slog"
	"net"
	"testing"
	"time"

	"github.com/pion/turn/v4"
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
		expiry, user, ok := EphemeralUsername(c.name)
		if expiry != c.expiry || user != c.user || ok != c.ok {
			t.Errorf("%q: %d %q %v, want %d %q %v", c.name, expiry, user, ok, c.expiry, c.user, c.ok)
		}
	}
}

// RestPassword is the TURN REST API password of username.
func restPassword(secret, username string) string {
	mac := hmac.New(sha1.New, []byte(secret))
	mac.Write([]byte(username))
	return base64.StdEncoding.EncodeToString(mac.Sum(nil))
}

var discard = slog.New(slog.NewTextHandler(io.Discard, nil))

// The handler's key is the one pion's own TURN REST handler derives, for
// both orders; expired and expiry-less names are refused.
func TestRestAuthHandler(t *testing.T) {
	now := time.Unix(1_700_000_000, 0)
	h := restAuthHandler("s3cret", func() time.Time { return now }, discard)
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

// A Replace takes effect for the next request: a removed user is unknown and
// refused, a new one authenticates; with a secret every user is known.
func TestReplace(t *testing.T) {
	st := New(Set{Realm: "r", Users: map[string]string{"alice": "a"}}, discard)
	src := &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 1}
	if key, ok := st.Authenticate("alice", "r", src); !ok || string(key) != string(turn.GenerateAuthKey("alice", "r", "a")) {
		t.Fatalf("alice: %x %v", key, ok)
	}
	st.Replace(Set{Realm: "r", Users: map[string]string{"bob": "b"}})
	if _, ok := st.Authenticate("alice", "r", src); ok || st.Known("alice") {
		t.Error("alice still authenticates after her removal")
	}
	if !st.Known("bob") || st.UserID("bob") != "bob" {
		t.Error("bob unknown")
	}
	st.Replace(Set{Realm: "r", Secret: "s"})
	if !st.Known("anyone") || st.UserID("alice:1700000000") != "alice" {
		t.Error("ephemeral: users are known, and counted by user-id")
	}
}
