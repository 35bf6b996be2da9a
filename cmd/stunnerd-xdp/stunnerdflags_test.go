package main

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/big"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/gorilla/websocket"

	"github.com/l7mp/stunnerd-xdp/internal/status"
)

// The operator's and stunnerd's whole flag set parses: the Kubernetes client
// flags (cli-runtime) are accepted and named as ignored, never with their
// values; -c k8s with a discovery address given is that address, as in
// stunnerd; with none it is still refused with the reason.
func TestStunnerdFlagsAccepted(t *testing.T) {
	t.Setenv("STUNNER_CONFIG_ORIGIN", "")
	t.Setenv("CDS_SERVER_ADDR", "")
	t.Setenv("CDS_SERVER_PORT", "")
	o, _, err := parseFlags([]string{"-w", "-c", "k8s", "--kubeconfig", "/dev/null", "--context", "kind", "-n", "stunner",
		"--password", "hunter2", "--insecure-skip-tls-verify", "--as-group", "g1", "--as-group", "g2",
		"--cds-server-address", "10.96.0.10", "--cds-server-namespace", "stunner-system", "--cds-server-port", "13479"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if o.configOrigin != "10.96.0.10:13479" {
		t.Errorf("-c k8s with --cds-server-address: origin %q", o.configOrigin)
	}
	for _, f := range []string{"--password", "--as-group", "--namespace", "--context", "--insecure-skip-tls-verify"} {
		if !slices.Contains(o.ignoredK8s, f) {
			t.Errorf("ignored flags %q: no %s", o.ignoredK8s, f)
		}
	}
	var log bytes.Buffer
	warnStunnerdFlags(o, slog.New(slog.NewTextHandler(&log, nil)))
	if !strings.Contains(log.String(), "--context") || strings.Contains(log.String(), "hunter2") {
		t.Errorf("warning: %s", log.String())
	}
	// The environment the cdsclient reads.
	t.Setenv("CDS_SERVER_ADDR", "cds.stunner-system.svc")
	t.Setenv("CDS_SERVER_PORT", "13480")
	if o, _, err = parseFlags([]string{"-c", "k8s"}, io.Discard); err != nil || o.configOrigin != "cds.stunner-system.svc:13480" {
		t.Errorf("-c k8s with $CDS_SERVER_ADDR: %q %v", o.configOrigin, err)
	}
	t.Setenv("CDS_SERVER_ADDR", "")
	if o, _, err = parseFlags([]string{"-c", "k8s"}, io.Discard); err != nil {
		t.Fatal(err)
	} else if _, err := parseOrigin(o.configOrigin); !errors.Is(err, errK8sOrigin) {
		t.Errorf("-c k8s without an address: %v", err)
	}
	// No URI and no origin: stunnerd's default origin, with and without -w.
	for _, args := range [][]string{{}, {"-w"}} {
		o, _, err := parseFlags(args, io.Discard)
		if err != nil || o.configOrigin != ":13478" || !o.defaultOrigin {
			t.Errorf("%v: origin %q, %v", args, o.configOrigin, err)
		}
	}
	if _, _, err := parseFlags([]string{"-c", "https://cds:1", "--cds-cert", "c.pem"}, io.Discard); err == nil {
		t.Error("--cds-cert without --cds-key accepted")
	}
}

// Credentials in a TURN URI or a config URL never reach a log line or an
// error, on any failing start.
func TestCredentialsNotEchoed(t *testing.T) {
	t.Setenv("STUNNER_CONFIG_ORIGIN", "")
	secrets := []string{"s3cretpw", "hunter2", "tok3n", "alice", "bob"}
	check := func(what, out string) {
		t.Helper()
		for _, s := range secrets {
			if strings.Contains(out, s) {
				t.Errorf("%s: the output shows %q:\n%s", what, s, out)
			}
		}
	}
	port := freeTCPPort(t)
	for _, args := range [][]string{
		{"turn://alice:s3cretpw@example.com:3478"},
		{"turn://alice:s3cretpw@10.0.0.1:0"},
		{"turns://alice:s3cretpw@10.0.0.1:3478?transport=udp"},
		{"stun://alice:s3cretpw@10.0.0.1:3478"},
		{"turn://alice:s3cretpw@10.0.0.1:3478?x=%zz"},
		{"-c", "http://bob:hunter2@[::1"},
		{"-c", "ftp://bob:hunter2@cds:1"},
		{"-c", fmt.Sprintf("http://bob:hunter2@127.0.0.1:%d/?token=tok3n", port), "--health-addr="},
		{"--health-addr=", "--password", "hunter2", "-c", fmt.Sprintf("http://127.0.0.1:%d", port)},
	} {
		var out bytes.Buffer
		if code := run(args, &out); code == 0 {
			t.Errorf("%v: exit 0", args)
		}
		if out.Len() == 0 {
			t.Errorf("%v: no output", args)
		}
		check(strings.Join(args, " "), out.String())
	}
	// The watch's reconnect warnings.
	r := startOrigin(t, "-w", "--health-addr=", "-c", fmt.Sprintf("ws://bob:hunter2@127.0.0.1:%d?token=tok3n", port))
	r.waitFor("a reconnect warning", 10*time.Second, func() bool { return strings.Contains(r.log.String(), "reconnecting") })
	r.stop()
	check("-w", r.log.String())
	if !strings.Contains(r.log.String(), "REDACTED@127.0.0.1") {
		t.Errorf("the log does not name the server:\n%s", r.log)
	}
}

func freeTCPPort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// pki is a CA with a server and a client certificate, as PEM files.
type pki struct {
	caFile, certFile, keyFile string
	pool                      *x509.CertPool
	server                    tls.Certificate
}

func newPKI(t *testing.T) pki {
	t.Helper()
	dir := t.TempDir()
	caKey, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	caTmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "test CA"}, IsCA: true,
		BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign, NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour)}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	ca, _ := x509.ParseCertificate(caDER)
	issue := func(cn string, usage x509.ExtKeyUsage) ([]byte, []byte) {
		key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		tmpl := &x509.Certificate{SerialNumber: big.NewInt(time.Now().UnixNano()), Subject: pkix.Name{CommonName: cn},
			IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)}, ExtKeyUsage: []x509.ExtKeyUsage{usage},
			NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour)}
		der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
		if err != nil {
			t.Fatal(err)
		}
		kb, _ := x509.MarshalECPrivateKey(key)
		return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kb})
	}
	p := pki{caFile: filepath.Join(dir, "ca.pem"), certFile: filepath.Join(dir, "client.pem"), keyFile: filepath.Join(dir, "client-key.pem"),
		pool: x509.NewCertPool()}
	p.pool.AddCert(ca)
	write := func(f string, b []byte) {
		if err := os.WriteFile(f, b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write(p.caFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: caDER}))
	c, k := issue("client", x509.ExtKeyUsageClientAuth)
	write(p.certFile, c)
	write(p.keyFile, k)
	sc, sk := issue("cds", x509.ExtKeyUsageServerAuth)
	if p.server, err = tls.X509KeyPair(sc, sk); err != nil {
		t.Fatal(err)
	}
	return p
}

// A config discovery server behind TLS with a private CA that wants a client
// certificate: reached with --cds-ca and --cds-cert/--cds-key, over a GET
// and over the watch's websocket; refused without them.
func TestCDSClientTLS(t *testing.T) {
	p := newPKI(t)
	const doc = `{"version":"v1","auth":{"credentials":{"username":"u","password":"p"}},"listeners":[{"name":"l"}]}`
	srv := httptest.NewUnstartedServer(serveConfig(doc))
	srv.TLS = &tls.Config{Certificates: []tls.Certificate{p.server}, ClientAuth: tls.RequireAndVerifyClientCert, ClientCAs: p.pool}
	srv.StartTLS()
	defer srv.Close()
	org, err := parseOrigin(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	client := func(c cdsOptions) *cdsClient {
		tlsCfg, err := cdsTLS(c)
		if err != nil {
			t.Fatal(err)
		}
		tr := http.DefaultTransport.(*http.Transport).Clone()
		tr.TLSClientConfig = tlsCfg
		return &cdsClient{base: org.cds, namespace: "ns", name: "gw", tls: tlsCfg, http: &http.Client{Transport: tr, Timeout: 5 * time.Second},
			log: slog.New(slog.NewTextHandler(io.Discard, nil))}
	}
	ctx := t.Context()
	if _, err := client(cdsOptions{}).get(ctx); err == nil {
		t.Error("GET: the system roots trusted the private CA")
	}
	if _, err := client(cdsOptions{ca: p.caFile}).get(ctx); err == nil {
		t.Error("GET: served without a client certificate")
	}
	good := client(cdsOptions{ca: p.caFile, cert: p.certFile, key: p.keyFile})
	if b, err := good.get(ctx); err != nil || string(b) != doc {
		t.Fatalf("GET with --cds-ca and --cds-cert: %q %v", b, err)
	}
	out := make(chan []byte, 1)
	served, err := good.stream(ctxWithTimeout(t, 500*time.Millisecond), out)
	if !served || len(out) != 1 {
		t.Fatalf("watch over wss: served %v, %v", served, err)
	}
	if _, err := cdsTLS(cdsOptions{ca: p.keyFile}); err == nil {
		t.Error("--cds-ca of a key file accepted")
	}
}

// A config over the read limit fails the GET and the websocket read, instead
// of being buffered.
func TestCDSReadLimit(t *testing.T) {
	big := strings.Repeat(" ", cdsMaxConfig+1)
	srv := httptest.NewServer(serveConfig(big))
	defer srv.Close()
	org, _ := parseOrigin(srv.URL)
	c := &cdsClient{base: org.cds, namespace: "ns", name: "gw", http: srv.Client(), log: slog.New(slog.NewTextHandler(io.Discard, nil))}
	if _, err := c.get(t.Context()); !errors.Is(err, errConfigTooLarge) {
		t.Errorf("GET: %v", err)
	}
	out := make(chan []byte, 1)
	if _, err := c.stream(ctxWithTimeout(t, 5*time.Second), out); !errors.Is(err, websocket.ErrReadLimit) || len(out) != 0 {
		t.Errorf("watch: %v, %d configs", err, len(out))
	}
}

// Before the first config, /status is STUNner's NOT-READY status (200), as
// stunnerd answers from its zero config; /ready is 503.
func TestStatusBeforeFirstConfig(t *testing.T) {
	port := freeTCPPort(t)
	t.Setenv("STUNNER_NAMESPACE", "stunner")
	t.Setenv("STUNNER_NAME", "udp-gateway")
	dir := t.TempDir()
	r := startOrigin(t, "-w", "-c", filepath.Join(dir, "absent.conf"), fmt.Sprintf("--health-addr=127.0.0.1:%d", port))
	var st status.Status
	r.waitFor("/status", 10*time.Second, func() bool {
		resp, err := http.Get(fmt.Sprintf("http://127.0.0.1:%d/status", port))
		if err != nil {
			return false
		}
		defer resp.Body.Close()
		return resp.StatusCode == http.StatusOK && json.NewDecoder(resp.Body).Decode(&st) == nil
	})
	if st.Status != status.NotReady || st.Admin == nil || st.Admin.Name != "stunner/udp-gateway" {
		t.Errorf("/status %+v", st)
	}
	resp, err := http.Get(fmt.Sprintf("http://127.0.0.1:%d/ready", port))
	if err != nil || resp.StatusCode != http.StatusServiceUnavailable {
		t.Errorf("/ready: %v %v", resp, err)
	}
	if resp != nil {
		resp.Body.Close()
	}
	r.stop()
}

func ctxWithTimeout(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(t.Context(), d)
	t.Cleanup(cancel)
	return ctx
}

// serveConfig is a config discovery server sending doc on a GET and as the
// first message of a watch.
func serveConfig(doc string) http.Handler {
	up := websocket.Upgrader{CheckOrigin: func(*http.Request) bool { return true }}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Query().Get("watch") != "true" {
			_, _ = io.WriteString(w, doc)
			return
		}
		c, err := up.Upgrade(w, r, nil)
		if err != nil {
			return
		}
		defer c.Close()
		_ = c.WriteMessage(websocket.TextMessage, []byte(doc))
		_, _, _ = c.ReadMessage() // until the client goes
	})
}
