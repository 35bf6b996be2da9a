package stunner

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/base64"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	stnrv1 "github.com/l7mp/stunner/pkg/apis/v1"
	"github.com/pion/dtls/v3"
	"github.com/pion/turn/v5"

	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// certPEM is a self-signed certificate and key, base64-encoded PEM as a
// STUNner listener carries them.
func certPEM(t *testing.T) (cert, key string) {
	t.Helper()
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "stunner.test"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour)}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &k.PublicKey, k)
	if err != nil {
		t.Fatal(err)
	}
	kb, err := x509.MarshalECPrivateKey(k)
	if err != nil {
		t.Fatal(err)
	}
	enc := func(typ string, b []byte) string {
		return base64.StdEncoding.EncodeToString(pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: b}))
	}
	return enc("CERTIFICATE", der), enc("EC PRIVATE KEY", kb)
}

// A TURN-DTLS listener, as STUNner's types and validation make it (a DTLS
// Gateway), serves a pion/turn v5 client (STUNner's) over pion/dtls: it
// allocates and relays to a UDP peer and back.
func TestDTLSGateway(t *testing.T) {
	dir := t.TempDir()
	bin := filepath.Join(dir, "stunnerd-xdp")
	build := exec.Command("go", "build", "-o", bin, "./cmd/stunnerd-xdp")
	build.Dir = "../.."
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build: %v\n%s", err, out)
	}
	port := freePort(t, "udp")
	cert, key := certPEM(t)
	c := &stnrv1.StunnerConfig{
		ApiVersion: stnrv1.ApiVersion,
		Admin:      stnrv1.AdminConfig{Name: "stunner-daemon", LogLevel: "all:INFO"},
		Auth: stnrv1.AuthConfig{Type: "static", Realm: stnrv1.DefaultRealm,
			Credentials: map[string]string{"username": "user1", "password": "passwd1"}},
		Listeners: []stnrv1.ListenerConfig{{Name: "stunner/dtls-gateway/dtls", Protocol: "TURN-DTLS",
			Addr: "127.0.0.1", Port: port, Cert: cert, Key: key, Routes: []string{"stunner/loopback"}}},
		Clusters: []stnrv1.ClusterConfig{{Name: "stunner/loopback", Type: "STATIC", Endpoints: []string{"127.0.0.1/32"}}},
	}
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	doc, err := json.Marshal(c)
	if err != nil {
		t.Fatal(err)
	}
	cfgPath := filepath.Join(dir, "stunnerd.conf")
	if err := os.WriteFile(cfgPath, doc, 0o600); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var logs bytes.Buffer
	daemon := exec.CommandContext(ctx, bin, "--xdp-mode=off", "--relay-address=127.0.0.1", "--steering-dir=",
		"--min-relay-port=21000", "--max-relay-port=21999", "--metrics-addr=", "--health-addr=", "-c", cfgPath)
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
	peer, err := net.ListenPacket("udp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer peer.Close()
	server := fmt.Sprintf("127.0.0.1:%d", port)
	var relay net.PacketConn
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(200 * time.Millisecond) {
		if relay, err = allocateDTLS(server); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("allocation over DTLS: %v", err)
		}
	}
	defer relay.Close()
	testenv.RoundTrip(t, relay, peer)
}

// allocateDTLS allocates with pion/turn v5 over a DTLS connection to server.
func allocateDTLS(server string) (net.PacketConn, error) {
	addr, err := net.ResolveUDPAddr("udp4", server)
	if err != nil {
		return nil, err
	}
	dc, err := dtls.DialWithOptions("udp4", addr, dtls.WithInsecureSkipVerify(true))
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	if err := dc.HandshakeContext(ctx); err != nil {
		dc.Close()
		return nil, err
	}
	c, err := turn.NewClient(&turn.ClientConfig{STUNServerAddr: server, TURNServerAddr: server,
		Username: "user1", Password: "passwd1", Realm: stnrv1.DefaultRealm, Conn: turn.NewSTUNConn(dc)})
	if err != nil {
		dc.Close()
		return nil, err
	}
	if err := c.Listen(); err != nil {
		c.Close()
		return nil, err
	}
	relay, err := c.Allocate()
	if err != nil {
		c.Close()
		return nil, err
	}
	return &clientRelay{PacketConn: relay, c: c}, nil
}

// clientRelay closes its client with the relayed connection.
type clientRelay struct {
	net.PacketConn
	c *turn.Client
}

func (r *clientRelay) Close() error {
	err := r.PacketConn.Close()
	r.c.Close()
	return err
}
