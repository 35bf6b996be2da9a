package e2e

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/pion/turn/v4"

	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// stunnerConfig is a STUNner dataplane config as the STUNner operator renders
// it: ephemeral credentials, a UDP and a TCP listener, a cluster as the peer
// allowlist. extra adds listeners.
func stunnerConfig(secret, extra string) string {
	return fmt.Sprintf(`version: v1
admin:
  name: e2e
  loglevel: all:INFO
  metrics_endpoint: "http://10.100.0.1:8080/metrics"
  healthcheck_endpoint: "http://10.100.0.1:8086"
auth:
  type: ephemeral
  realm: stunner.l7mp.io
  credentials:
    secret: %s
listeners:
  - name: udp-listener
    protocol: TURN-UDP
    address: 10.100.0.1
    port: 3478
    routes: [media-plane]
  - name: tcp-listener
    protocol: TURN-TCP
    address: 10.100.0.1
    port: 3479
    routes: [media-plane]
%sclusters:
  - name: media-plane
    type: STATIC
    endpoints: [10.200.0.0/24]
`, secret, extra)
}

func writeConfig(t *testing.T, path, content string) {
	t.Helper()
	// Write and rename, as a ConfigMap update swaps files.
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

func restCredentials(t *testing.T, secret string) (string, string) {
	t.Helper()
	u, p, err := turn.GenerateLongTermTURNRESTCredentials(secret, "alice", time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	return u, p
}

// TestSTUNnerConfigAndReload runs the binary on a STUNner config with -w:
// ephemeral (TURN REST API) credentials on UDP (XDP) and TCP (userspace)
// listeners, the cluster as the peer allowlist, then reloads the file twice
// (new secret and a new UDP listener; then a broken file) while a session on
// the untouched listener keeps flowing.
func TestSTUNnerConfigAndReload(t *testing.T) {
	r := parentRig(t)
	cfgPath := filepath.Join(t.TempDir(), "stunnerd.conf")
	writeConfig(t, cfgPath, stunnerConfig("first-secret", ""))
	p := runBinary(t, r, nil, "--log-format=json", "--relay-address=10.200.0.1", "--xdp-mode=native",
		"--steering-dir="+testenv.BPFFS(t), "-c", cfgPath, "-w")
	startEcho(t, r.Peer, echoPeer)

	// Ephemeral credentials from the shared secret, over UDP: relayed by XDP.
	u, pw := restCredentials(t, "first-secret")
	relay, err := allocateWith(t, r.Client, "10.100.0.1:3478", u, pw, false)
	if err != nil {
		t.Fatalf("UDP allocation with ephemeral credentials: %v", err)
	}
	if _, err := allocateWith(t, r.Client, "10.100.0.1:3478", "alice", "wrong", false); err == nil {
		t.Fatal("allocation with a wrong password succeeded")
	}
	// The same over TCP: pion/turn serves it in userspace.
	tcpRelay, err := allocateWith(t, r.Client, "10.100.0.1:3479", u, pw, true)
	if err != nil {
		t.Fatalf("TCP allocation: %v", err)
	}
	if sent, got, _ := echoSession(t, tcpRelay, 200, time.Second); got < sent*99/100 {
		t.Fatalf("TCP listener: %d of %d echoes\n%s", got, sent, p.Stderr())
	}
	// The cluster is the allowlist: a peer outside it is refused.
	if _, err := relay.WriteTo([]byte("x"), mustUDPAddr("198.51.100.1:5000")); err == nil {
		time.Sleep(200 * time.Millisecond)
	}
	if st := status(t, r.Server); st.XDP.Channels > 1 {
		t.Fatalf("a peer outside the cluster got a channel: %+v", st)
	}

	// A session on the UDP listener runs across both reloads.
	type result struct{ sent, received int }
	done := make(chan result, 1)
	go func() {
		s, n, _ := echoSession(t, relay, 1000, 6*time.Second)
		done <- result{s, n}
	}()
	time.Sleep(1500 * time.Millisecond)
	writeConfig(t, cfgPath, stunnerConfig("second-secret", `  - name: udp-listener-2
    protocol: TURN-UDP
    address: 10.100.0.1
    port: 3480
    routes: [media-plane]
`))
	// The reload swaps the credentials before it opens the new listener.
	if err := r.Server.WaitUDPBound(3480, 5*time.Second, p); err != nil {
		t.Fatalf("no reload: %v\n%s", err, p.Stderr())
	}
	u2, pw2 := restCredentials(t, "second-secret")
	relay2, err := allocateWith(t, r.Client, "10.100.0.1:3480", u2, pw2, false)
	if err != nil {
		t.Fatalf("allocation on the new listener with the new secret: %v", err)
	}
	if _, err := allocateWith(t, r.Client, "10.100.0.1:3478", u, pw, false); err == nil {
		t.Error("the old secret still works after the reload")
	}
	before := scrape(t, r.Server).get(t, relayed("xdp", "client_to_peer"))
	if sent, got, _ := echoSession(t, relay2, 500, time.Second); got < sent*99/100 {
		t.Fatalf("new listener: %d of %d echoes", got, sent)
	}
	if after := scrape(t, r.Server).get(t, relayed("xdp", "client_to_peer")); after-before < 400 {
		t.Errorf("the new UDP listener is not relayed by XDP: xdp client->peer grew by %v", after-before)
	}

	// A broken file is refused and changes nothing.
	writeConfig(t, cfgPath, "version: v1\nlisteners: [")
	if !p.WaitOutput(`"msg":"config reload"`, 5*time.Second) {
		t.Errorf("a broken config was not reported:\n%s", p.Stderr())
	}
	res := <-done
	t.Logf("session on the untouched listener across two reloads: %d sent, %d echoed", res.sent, res.received)
	if float64(res.received) < 0.99*float64(res.sent) {
		t.Errorf("session across the reloads: %d of %d echoes", res.received, res.sent)
	}
	if st := status(t, r.Server); st.AllocationCount != 3 || st.Status != "READY" {
		t.Errorf("after the reloads: %+v", st)
	}
	if strings.Contains(p.Stderr(), `"level":"ERROR"`) && !strings.Contains(p.Stderr(), "config reload") {
		t.Errorf("errors in the log:\n%s", p.Stderr())
	}
}
