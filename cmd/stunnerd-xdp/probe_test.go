package main

import (
	"bytes"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"testing"

	"github.com/l7mp/stunnerd-xdp/internal/status"
)

// TestProbe runs the probe command against a health server on a unix socket:
// 200 is exit 0 with the body on stdout, anything else exit 1, no server exit
// 1, bad arguments exit 2.
func TestProbe(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "health.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/live", func(w http.ResponseWriter, _ *http.Request) { status.WriteLive(w) })
	mux.HandleFunc("/ready", func(w http.ResponseWriter, _ *http.Request) { status.WriteReady(w, "terminating") })
	srv := &http.Server{Handler: mux}
	go func() { _ = srv.Serve(ln) }()
	defer srv.Close()

	for _, c := range []struct {
		args   []string
		code   int
		stdout string
		stderr string
	}{
		{args: []string{"--health-socket=" + sock, "live"}, code: 0, stdout: `{}`},
		{args: []string{"--health-socket=" + sock, "ready"}, code: 1, stdout: `"terminating"`, stderr: "503"},
		{args: []string{"--health-socket=" + filepath.Join(t.TempDir(), "none.sock"), "live"}, code: 1, stderr: "no such file"},
		{args: []string{"--health-socket=" + sock}, code: 2, stderr: "want one of live, ready or status"},
		{args: []string{"--health-socket=" + sock, "metrics"}, code: 2, stderr: "want one of"},
	} {
		var stdout, stderr bytes.Buffer
		if code := probe(c.args, &stdout, &stderr); code != c.code {
			t.Errorf("probe %v: exit %d, want %d (stderr %q)", c.args, code, c.code, stderr.String())
		}
		if !strings.Contains(stdout.String(), c.stdout) || !strings.Contains(stderr.String(), c.stderr) {
			t.Errorf("probe %v: stdout %q stderr %q, want %q and %q", c.args, stdout.String(), stderr.String(), c.stdout, c.stderr)
		}
	}
}
