package status

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/l7mp/stunnerd-xdp/internal/config"
	"github.com/l7mp/stunnerd-xdp/internal/metrics"
)

// TestNewKeepsSecretsOut: /status carries the configuration as stunnerd's
// does, but no password, shared secret or TLS key (the health port answers
// whoever reaches the node); the username stays, as stunnerctl shows it.
func TestNewKeepsSecretsOut(t *testing.T) {
	health := "http://0.0.0.0:8086"
	src := &config.Stunner{
		APIVersion: "v1",
		Admin:      config.Admin{Name: "ns/gw", HealthCheckEndpoint: &health},
		Auth:       config.Auth{Type: "static", Realm: "r", Credentials: map[string]string{"username": "u", "password": "p4ss", "secret": "s3cret"}},
		Listeners:  []config.Listener{{Name: "ns/gw/tls", Protocol: "TURN-TLS", Port: 443, Cert: "Q0VSVA==", Key: "S0VZ"}},
		Clusters:   []config.Cluster{{Name: "ns/media", Endpoints: []string{"10.0.0.0/8"}}},
	}
	st := New(Input{Version: "v1", Source: src, Offload: OffloadString("XDP", nil), Allocations: 2})
	b, err := json.Marshal(st)
	if err != nil {
		t.Fatal(err)
	}
	for _, secret := range []string{"p4ss", "s3cret", "S0VZ"} {
		if strings.Contains(string(b), secret) {
			t.Errorf("/status shows %q: %s", secret, b)
		}
	}
	if st.Auth.Credentials["username"] != "u" || st.Listeners[0].Cert != "Q0VSVA==" || st.Admin.HealthCheckEndpoint != health {
		t.Errorf("/status lost what it may show: %s", b)
	}
	if src.Auth.Credentials["password"] != "p4ss" || src.Listeners[0].Key != "S0VZ" {
		t.Error("New modified the running configuration")
	}
	if st.Status != Ready || st.AllocationCount != 2 || st.Admin.OffloadStatus != "XDP[all]" {
		t.Errorf("status %q allocations %d offload %q", st.Status, st.AllocationCount, st.Admin.OffloadStatus)
	}
}

// TestNewReportsKernelStats: a listener's and a cluster's stats are what the
// kernel path relayed for them (STUNner's offload stats), not userspace's.
func TestNewReportsKernelStats(t *testing.T) {
	src := &config.Stunner{Listeners: []config.Listener{{Name: "l"}}, Clusters: []config.Cluster{{Name: "c"}}}
	tot := metrics.Totals{
		Listeners:       map[string]metrics.Stats{"l": {Rx: metrics.Dir{Packets: 100, Bytes: 1000}}},
		KernelListeners: map[string]metrics.Stats{"l": {Rx: metrics.Dir{Packets: 60, Bytes: 600}, Tx: metrics.Dir{Packets: 5, Bytes: 50}}},
		KernelClusters:  map[string]metrics.Stats{"c": {Tx: metrics.Dir{Packets: 60, Bytes: 360}}},
	}
	st := New(Input{Source: src, Traffic: tot, Draining: true})
	l, c := st.Listeners[0].Stats, st.Clusters[0].Stats
	if l.Rx.Pkts != 60 || l.Rx.Bytes != 600 || l.Tx.Pkts != 5 || c.Tx.Pkts != 60 || c.Tx.Bytes != 360 || c.Rx.Pkts != 0 {
		t.Errorf("listener %+v cluster %+v", l, c)
	}
	if st.Status != Terminating {
		t.Errorf("draining: status %q", st.Status)
	}
}

// TestWaiting: before the first config, /status is STUNner's zero-config
// status, NOT-READY, with no credentials.
func TestWaiting(t *testing.T) {
	st := Waiting("ns/gw")
	b, err := json.Marshal(st)
	if err != nil {
		t.Fatal(err)
	}
	if st.Status != NotReady || st.Admin.Name != "ns/gw" || st.Version != "v1" || st.Auth.Type != "static" ||
		len(st.Listeners) != 0 || len(st.Clusters) != 0 || strings.Contains(string(b), "dummy") {
		t.Errorf("%s", b)
	}
}
