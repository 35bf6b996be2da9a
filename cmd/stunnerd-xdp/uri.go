package main

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"fmt"
	"math/big"
	"net/netip"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/l7mp/stunnerd-xdp/internal/config"
)

// turnURI is a TURN URI of the command line.
type turnURI struct {
	proto      config.Protocol
	addr       netip.AddrPort
	user, pass string
}

// parseURI reads a TURN URI as stunnerd does (its uri.go):
// turn|turns://USER:PASS@ADDR[:PORT][?transport=udp|tcp|tls|dtls]; turn is
// UDP and turns TLS unless the transport says otherwise; the port defaults
// to 3478, and to 443 for TLS and DTLS. Errors never show the credentials.
func parseURI(s string) (turnURI, error) {
	var r turnURI
	shown := redactURI(s)
	u, err := url.Parse(s)
	if err != nil {
		return r, fmt.Errorf("TURN URI %q: %w", shown, urlError(err))
	}
	transport := strings.ToLower(u.Query().Get("transport"))
	switch scheme := strings.ToLower(u.Scheme); {
	case transport == "tls":
		r.proto = config.TLS
	case transport == "dtls":
		r.proto = config.DTLS
	case (scheme == "turn" || scheme == "") && (transport == "" || transport == "udp"):
		r.proto = config.UDP
	case scheme == "turn" && transport == "tcp":
		r.proto = config.TCP
	case scheme == "turns" && transport == "udp":
		r.proto = config.DTLS
	case scheme == "turns" && (transport == "" || transport == "tcp"):
		r.proto = config.TLS
	default:
		return r, fmt.Errorf("TURN URI %q: scheme %q with transport %q: want turn (udp, tcp) or turns (tcp: TLS, udp: DTLS)", shown, u.Scheme, transport)
	}
	if u.User == nil || u.User.Username() == "" {
		return r, fmt.Errorf("TURN URI %q: no user, want turn://USER:PASS@ADDR:PORT", shown)
	}
	pass, ok := u.User.Password()
	if !ok || pass == "" {
		return r, fmt.Errorf("TURN URI %q: no password, want turn://USER:PASS@ADDR:PORT", shown)
	}
	r.user, r.pass = u.User.Username(), pass
	host, portStr := u.Hostname(), u.Port()
	if portStr == "" {
		portStr = "3478"
		if r.proto == config.TLS || r.proto == config.DTLS {
			portStr = "443"
		}
	}
	port, err := strconv.ParseUint(portStr, 10, 16)
	if err != nil || port == 0 {
		return r, fmt.Errorf("TURN URI %q: invalid port %q", shown, portStr)
	}
	addr, err := netip.ParseAddr(host)
	if err != nil {
		return r, fmt.Errorf("TURN URI %q: address %q must be an IP address: %w", shown, host, err)
	}
	r.addr = netip.AddrPortFrom(addr, uint16(port))
	return r, nil
}

// selfSigned makes the certificate of a TLS listener given as a URI, as
// stunnerd does (CN localhost; an ECDSA P-256 key where stunnerd makes a
// 4096-bit RSA one: as good for a throwaway certificate, and made at once).
func selfSigned() (*tls.Certificate, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 64))
	if err != nil {
		return nil, err
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber: serial, Subject: pkix.Name{CommonName: "localhost"}, DNSNames: []string{"localhost"},
		NotBefore: now.Add(-time.Hour), NotAfter: now.AddDate(10, 0, 0),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, fmt.Errorf("self-signed certificate: %w", err)
	}
	return &tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}, nil
}
