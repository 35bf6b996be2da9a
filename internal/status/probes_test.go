package status

import (
	"net/http/httptest"
	"testing"
)

// TestProbeBodies: the bodies stunnerd v1.2.1 writes (its
// internal/object/admin.go), byte for byte where it is ready or live; a
// not-ready answer adds its reason beside stunnerd's two fields.
func TestProbeBodies(t *testing.T) {
	for _, c := range []struct {
		name, body string
		code       int
		write      func(*httptest.ResponseRecorder)
	}{
		{"live", "{}\n", 200, func(w *httptest.ResponseRecorder) { WriteLive(w) }},
		{"ready", `{"status":200,"message":"READY"}` + "\n", 200, func(w *httptest.ResponseRecorder) { WriteReady(w, "") }},
		{"not ready", `{"status":503,"message":"stunnerd not ready","reason":"terminating"}` + "\n", 503,
			func(w *httptest.ResponseRecorder) { WriteReady(w, "terminating") }},
	} {
		w := httptest.NewRecorder()
		c.write(w)
		if w.Code != c.code || w.Body.String() != c.body {
			t.Errorf("%s: %d %q, want %d %q", c.name, w.Code, w.Body.String(), c.code, c.body)
		}
		if ct := w.Header().Get("Content-Type"); ct != "application/json; charset=utf-8" {
			t.Errorf("%s: Content-Type %q", c.name, ct)
		}
	}
}
