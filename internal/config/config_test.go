package config

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/base64"
	"encoding/pem"
	"math/big"
	"net/netip"
	"strings"
	"testing"
	"time"
)

const full = `
version: v1
admin:
  name: stunnerd-xdp
  loglevel: all:INFO,turn:DEBUG
  metrics_endpoint: "http://:8080/metrics"
  healthcheck_endpoint: "http://0.0.0.0:8086"
  offload_engine: Auto
  offload_interfaces: [eth0]
auth:
  type: ephemeral
  realm: example.org
  credentials:
    secret: s3cret
listeners:
  - name: udp-listener
    protocol: TURN-UDP
    public_address: 203.0.113.7
    public_port: 3478
    address: $TEST_STUNNER_ADDR
    port: 3478
    routes: [media-plane]
  - name: tcp-listener
    protocol: TURN-TCP
    address: 0.0.0.0
    port: 3479
    routes: [media-plane, other]
clusters:
  - name: media-plane
    type: STATIC
    endpoints: [10.0.0.0/8, 192.0.2.1]
  - name: other
    endpoints: ["fd00::/8"]
`

func TestParseFull(t *testing.T) {
	t.Setenv("TEST_STUNNER_ADDR", "10.1.2.3")
	r, err := Parse([]byte(full))
	if err != nil {
		t.Fatal(err)
	}
	if r.LogLevel != "all:INFO,turn:DEBUG" || r.MetricsAddr != ":8080" || r.HealthAddr != "0.0.0.0:8086" ||
		r.XDPMode != "auto" || len(r.Interfaces) != 1 {
		t.Errorf("admin: %+v", r)
	}
	if r.Auth.Type != AuthEphemeral || r.Auth.Secret != "s3cret" || r.Auth.Realm != "example.org" {
		t.Errorf("auth: %+v", r.Auth)
	}
	if len(r.Listeners) != 2 {
		t.Fatalf("%d listeners", len(r.Listeners))
	}
	tcp, udp := r.Listeners[0], r.Listeners[1] // sorted by name
	if udp.Protocol != UDP || udp.Addr != netip.MustParseAddrPort("10.1.2.3:3478") || len(udp.AllowPeers) != 2 ||
		udp.AllowPeers[1] != netip.MustParsePrefix("192.0.2.1/32") {
		t.Errorf("udp listener: %+v", udp)
	}
	if tcp.Protocol != TCP || tcp.Addr.Port() != 3479 || len(tcp.AllowPeers) != 3 {
		t.Errorf("tcp listener: %+v", tcp)
	}
}

func TestParseJSONAndDefaults(t *testing.T) {
	r, err := Parse([]byte(`{"version":"v1","auth":{"credentials":{"username":"u","password":"p"}},"listeners":[{"name":"l"}]}`))
	if err != nil {
		t.Fatal(err)
	}
	l := r.Listeners[0]
	if r.Auth.Type != AuthStatic || r.Auth.Realm != DefaultRealm || l.Protocol != UDP ||
		l.Addr != netip.MustParseAddrPort("0.0.0.0:3478") || len(l.AllowPeers) != 0 ||
		r.MetricsAddr != "" || r.HealthAddr != DefaultHealthAddr || r.LogLevel != "all:INFO" {
		t.Errorf("defaults: %+v %+v", r, l)
	}
	// An empty healthcheck_endpoint turns health off, as in STUNner.
	r, err = Parse([]byte(`{"version":"v1","admin":{"healthcheck_endpoint":""},"auth":{"credentials":{"username":"u","password":"p"}},"listeners":[{"name":"l"}]}`))
	if err != nil || r.HealthAddr != "" {
		t.Errorf("empty healthcheck endpoint: %v %q", err, r.HealthAddr)
	}
}

func selfSigned(t *testing.T) (string, string) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "turn.test"},
		NotBefore: time.Now(), NotAfter: time.Now().Add(time.Hour)}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	kb, _ := x509.MarshalECPrivateKey(key)
	c := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
	k := pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kb})
	return base64.StdEncoding.EncodeToString(c), base64.StdEncoding.EncodeToString(k)
}

func TestTLSListener(t *testing.T) {
	cert, key := selfSigned(t)
	for _, p := range []Protocol{TLS, DTLS} {
		r, err := Parse([]byte(`{"version":"v1","auth":{"credentials":{"username":"u","password":"p"}},
		"listeners":[{"name":"tls","protocol":"` + string(p) + `","port":5349,"cert":"` + cert + `","key":"` + key + `"}]}`))
		if err != nil {
			t.Fatal(err)
		}
		if r.Listeners[0].Protocol != p || r.Listeners[0].Cert == nil {
			t.Fatalf("%+v", r.Listeners[0])
		}
		_, err = Parse([]byte(`{"version":"v1","auth":{"credentials":{"username":"u","password":"p"}},
		"listeners":[{"name":"tls","protocol":"` + string(p) + `","port":5349}]}`))
		if err == nil || !strings.Contains(err.Error(), string(p)+" listener needs cert and key") {
			t.Errorf("%s without a certificate: %v", p, err)
		}
	}
}

func TestErrors(t *testing.T) {
	auth := `"auth":{"credentials":{"username":"u","password":"p"}}`
	l := `"listeners":[{"name":"l"}]`
	for _, c := range []struct{ name, doc, want string }{
		{"not yaml", `version: [`, "decode"},
		{"version", `{"version":"v2",` + auth + `,` + l + `}`, "version"},
		{"no credentials", `{"version":"v1","auth":{"credentials":{"username":"u"}},` + l + `}`, "password"},
		{"no secret", `{"version":"v1","auth":{"type":"ephemeral","credentials":{}},` + l + `}`, "secret"},
		{"auth none", `{"version":"v1","auth":{"type":"none","credentials":{}},` + l + `}`, "open relay"},
		{"auth type", `{"version":"v1","auth":{"type":"oauth","credentials":{}},` + l + `}`, "unknown type"},
		{"protocol", `{"version":"v1",` + auth + `,"listeners":[{"name":"d","protocol":"SCTP"}]}`, "unknown protocol"},
		{"unnamed listener", `{"version":"v1",` + auth + `,"listeners":[{"port":3478}]}`, "missing name"},
		{"duplicate listener", `{"version":"v1",` + auth + `,"listeners":[{"name":"a"},{"name":"a","port":3479}]}`, "twice"},
		{"address", `{"version":"v1",` + auth + `,"listeners":[{"name":"a","address":"$NO_SUCH_VAR_X"}]}`, "expands to nothing"},
		{"bad address", `{"version":"v1",` + auth + `,"listeners":[{"name":"a","address":"10.0.0"}]}`, "not an IP"},
		{"port", `{"version":"v1",` + auth + `,"listeners":[{"name":"a","port":70000}]}`, "port"},
		{"tls without cert", `{"version":"v1",` + auth + `,"listeners":[{"name":"a","protocol":"TLS"}]}`, "cert and key"},
		{"cert on udp", `{"version":"v1",` + auth + `,"listeners":[{"name":"a","cert":"eA=="}]}`, "TURN-TLS"},
		{"strict dns address", `{"version":"v1",` + auth + `,` + l + `,"clusters":[{"name":"c","type":"STRICT_DNS","endpoints":["10.0.0.1"]}]}`, "want a DNS name"},
		{"cluster type", `{"version":"v1",` + auth + `,` + l + `,"clusters":[{"name":"c","type":"EDS"}]}`, "unknown type"},
		{"cluster protocol", `{"version":"v1",` + auth + `,` + l + `,"clusters":[{"name":"c","protocol":"SCTP"}]}`, "unknown protocol"},
		{"port range order", `{"version":"v1",` + auth + `,` + l + `,"clusters":[{"name":"c","endpoints":["10.0.0.1:<6000-5000>"]}]}`, "port range"},
		{"port range zero", `{"version":"v1",` + auth + `,` + l + `,"clusters":[{"name":"c","endpoints":["10.0.0.1:<0-5000>"]}]}`, "port range"},
		{"port range big", `{"version":"v1",` + auth + `,` + l + `,"clusters":[{"name":"c","endpoints":["10.0.0.1:<1-70000>"]}]}`, "port range"},
		{"nine udp ports", `{"version":"v1",` + auth + `,"listeners":[{"name":"a1","port":4001},{"name":"a2","port":4002},{"name":"a3","port":4003},` +
			`{"name":"a4","port":4004},{"name":"a5","port":4005},{"name":"a6","port":4006},{"name":"a7","port":4007},{"name":"a8","port":4008},` +
			`{"name":"a9","port":4009}]}`, "MAX_LISTENER_PORTS"},
		{"metrics port", `{"version":"v1","admin":{"metrics_endpoint":"http://:x/metrics"},` + auth + `,` + l + `}`, "http://"},
		{"endpoint", `{"version":"v1",` + auth + `,` + l + `,"clusters":[{"name":"c","endpoints":["peer.svc"]}]}`, "neither an address"},
		{"host bits", `{"version":"v1",` + auth + `,` + l + `,"clusters":[{"name":"c","endpoints":["10.0.0.1/8"]}]}`, "host bits"},
		{"metrics path", `{"version":"v1","admin":{"metrics_endpoint":"http://:8080/stats"},` + auth + `,` + l + `}`, "path"},
		{"metrics scheme", `{"version":"v1","admin":{"metrics_endpoint":"https://:8080/metrics"},` + auth + `,` + l + `}`, "http://"},
	} {
		t.Run(c.name, func(t *testing.T) {
			_, err := Parse([]byte(c.doc))
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("error %v, want one containing %q", err, c.want)
			}
		})
	}
}
