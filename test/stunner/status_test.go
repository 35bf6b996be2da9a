package stunner

// The status test checks stunnerd-xdp's /status against STUNner's own
// StunnerStatus type (github.com/l7mp/stunner v1.2.1), which stunnerctl
// decodes.

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	stnrv1 "github.com/l7mp/stunner/pkg/apis/v1"
	"github.com/pion/turn/v5"
)

// freePort returns a port nothing listens on now, on 127.0.0.1.
func freePort(t *testing.T, network string) int {
	t.Helper()
	switch network {
	case "udp":
		c, err := net.ListenPacket("udp4", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		return c.LocalAddr().(*net.UDPAddr).Port
	default:
		l, err := net.Listen("tcp4", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer l.Close()
		return l.Addr().(*net.TCPAddr).Port
	}
}

// statusConfig is a STUNner dataplane config as the operator renders it, on loopback.
func statusConfig(turnPort, healthPort, metricsPort int) string {
	return fmt.Sprintf(`version: v1
admin:
  name: stunner/udp-gateway
  loglevel: all:INFO
  metrics_endpoint: "http://127.0.0.1:%d/metrics"
  healthcheck_endpoint: "http://127.0.0.1:%d"
auth:
  type: static
  realm: stunner.l7mp.io
  credentials:
    username: user-1
    password: pass-1
listeners:
  - name: stunner/udp-gateway/udp-listener
    protocol: TURN-UDP
    address: 127.0.0.1
    port: %d
    routes: [stunner/media-plane]
clusters:
  - name: stunner/media-plane
    type: STATIC
    protocol: UDP
    endpoints: [10.200.0.0/24]
`, metricsPort, healthPort, turnPort)
}

// TestStatusDecodesAsStunnerStatus runs the binary (userspace only: no
// privileges needed) on a STUNner config, makes an allocation, and decodes
// /status into STUNner's StunnerStatus: every field but the xdp section must
// survive the round trip through STUNner's type, and stunnerctl's renderings
// must show the listener and the allocation.
func TestStatusDecodesAsStunnerStatus(t *testing.T) {
	dir := t.TempDir()
	bin := filepath.Join(dir, "stunnerd-xdp")
	build := exec.Command("go", "build", "-o", bin, "./cmd/stunnerd-xdp")
	build.Dir = "../.."
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build: %v\n%s", err, out)
	}
	turnPort, healthPort, metricsPort := freePort(t, "udp"), freePort(t, "tcp"), freePort(t, "tcp")
	cfg := filepath.Join(dir, "stunnerd.conf")
	if err := os.WriteFile(cfg, []byte(statusConfig(turnPort, healthPort, metricsPort)), 0o600); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var logs bytes.Buffer
	daemon := exec.CommandContext(ctx, bin, "--xdp-mode=off", "--relay-address=127.0.0.1",
		// Relay ports below the ephemeral range the free TURN port comes from.
		"--min-relay-port=20000", "--max-relay-port=20999", "-c", cfg)
	daemon.Stdout, daemon.Stderr = &logs, &logs
	if err := daemon.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		cancel()
		_ = daemon.Wait()
		if t.Failed() {
			t.Logf("daemon log:\n%s", logs.String())
		}
	}()

	// One allocation, so that allocationCount has something to say.
	conn, err := net.ListenPacket("udp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	server := fmt.Sprintf("127.0.0.1:%d", turnPort)
	client, err := turn.NewClient(&turn.ClientConfig{STUNServerAddr: server, TURNServerAddr: server,
		Username: "user-1", Password: "pass-1", Realm: "stunner.l7mp.io", Conn: conn})
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	if err := client.Listen(); err != nil {
		t.Fatal(err)
	}
	var relay net.PacketConn
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		if relay, err = client.Allocate(); err == nil || time.Now().After(deadline) {
			break
		}
	}
	if err != nil {
		t.Fatalf("allocation: %v", err)
	}
	defer relay.Close()

	resp, err := http.Get(fmt.Sprintf("http://127.0.0.1:%d/status", healthPort))
	if err != nil {
		t.Fatal(err)
	}
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("/status: %d %v", resp.StatusCode, err)
	}

	var st stnrv1.StunnerStatus
	if err := json.Unmarshal(body, &st); err != nil {
		t.Fatalf("/status does not decode as STUNner's StunnerStatus: %v\n%s", err, body)
	}
	// Nothing but the xdp section may be lost in STUNner's type.
	var ours, theirs map[string]any
	if err := json.Unmarshal(body, &ours); err != nil {
		t.Fatal(err)
	}
	if _, ok := ours["xdp"]; !ok {
		t.Errorf("no xdp section in %s", body)
	}
	delete(ours, "xdp")
	back, err := json.Marshal(&st)
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(back, &theirs); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(ours, theirs) {
		t.Errorf("/status loses fields in STUNner's type:\nours:   %v\ntheirs: %v", ours, theirs)
	}

	if st.ApiVersion != "v1" || st.Status != "READY" || st.AllocationCount != 1 {
		t.Errorf("version %q status %q allocations %d, want v1 READY 1", st.ApiVersion, st.Status, st.AllocationCount)
	}
	if st.Admin == nil || st.Admin.Name != "stunner/udp-gateway" || st.Auth == nil || st.Auth.Type != "static" {
		t.Errorf("admin %+v auth %+v", st.Admin, st.Auth)
	}
	if st.Auth != nil && st.Auth.Credentials["password"] == "pass-1" {
		t.Error("/status shows the password")
	}
	if len(st.Listeners) != 1 || st.Listeners[0].ListenerConfig == nil || st.Listeners[0].Name != "stunner/udp-gateway/udp-listener" ||
		st.Listeners[0].Port != turnPort || len(st.Listeners[0].Routes) != 1 {
		t.Errorf("listeners: %s", body)
	}
	if len(st.Clusters) != 1 || st.Clusters[0].ClusterConfig == nil || st.Clusters[0].Name != "stunner/media-plane" ||
		!reflect.DeepEqual(st.Clusters[0].Endpoints, []string{"10.200.0.0/24"}) {
		t.Errorf("clusters: %s", body)
	}
	// What stunnerctl status prints.
	if s := st.String(); !strings.Contains(s, "stunner/udp-gateway/udp-listener") {
		t.Errorf("stunnerctl's rendering misses the listener: %s", s)
	}
	if s := st.Summary(); !strings.Contains(s, "allocs:1") {
		t.Errorf("stunnerctl's summary: %s", s)
	}
}
