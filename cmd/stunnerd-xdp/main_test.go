package main

import (
	"bytes"
	"crypto/x509"
	"io"
	"net/netip"
	"runtime"
	"strings"
	"testing"

	"github.com/l7mp/stunnerd-xdp/internal/channelmap"
	"github.com/l7mp/stunnerd-xdp/internal/config"
	"github.com/l7mp/stunnerd-xdp/internal/loader"
)

func TestParseURI(t *testing.T) {
	for _, c := range []struct {
		uri, listen, user, pass, err string
		proto                        config.Protocol
	}{
		{uri: "turn://user1:passwd1@10.0.0.1:3478", listen: "10.0.0.1:3478", user: "user1", pass: "passwd1"},
		{uri: "turn://u:p@0.0.0.0:3479?transport=udp", listen: "0.0.0.0:3479", user: "u", pass: "p"},
		{uri: "turn://u:p@10.0.0.1", listen: "10.0.0.1:3478", user: "u", pass: "p"},
		{uri: "turn://u:p@[fd00::1]:3478", listen: "[fd00::1]:3478", user: "u", pass: "p"},
		{uri: "turn://u:p%40x@10.0.0.1:3478", listen: "10.0.0.1:3478", user: "u", pass: "p@x"},
		// Every protocol stunnerd's URIs name (its uri.go).
		{uri: "turn://u:p@10.0.0.1:3478?transport=tcp", listen: "10.0.0.1:3478", user: "u", pass: "p", proto: config.TCP},
		{uri: "turns://u:p@10.0.0.1:5349", listen: "10.0.0.1:5349", user: "u", pass: "p", proto: config.TLS},
		{uri: "turns://u:p@10.0.0.1", listen: "10.0.0.1:443", user: "u", pass: "p", proto: config.TLS},
		{uri: "turn://u:p@10.0.0.1:5349?transport=tls", listen: "10.0.0.1:5349", user: "u", pass: "p", proto: config.TLS},
		{uri: "turns://u:p@10.0.0.1:5349?transport=tcp", listen: "10.0.0.1:5349", user: "u", pass: "p", proto: config.TLS},
		{uri: "turns://u:p@10.0.0.1:5349?transport=udp", listen: "10.0.0.1:5349", user: "u", pass: "p", proto: config.DTLS},
		{uri: "turn://u:p@10.0.0.1:5349?transport=dtls", listen: "10.0.0.1:5349", user: "u", pass: "p", proto: config.DTLS},
		{uri: "turn://u:p@10.0.0.1:3478?transport=sctp", err: "transport"},
		{uri: "stun://u:p@10.0.0.1:3478", err: "scheme"},
		{uri: "turn://10.0.0.1:3478", err: "no user"},
		{uri: "turn://u@10.0.0.1:3478", err: "no password"},
		{uri: "turn://u:p@example.com:3478", err: "must be an IP address"},
		{uri: "turn://u:p@10.0.0.1:0", err: "invalid port"},
		{uri: "turn://u:p@10.0.0.1:70000", err: "invalid port"},
	} {
		t.Run(c.uri, func(t *testing.T) {
			u, err := parseURI(c.uri)
			if c.err != "" {
				if err == nil || !strings.Contains(err.Error(), c.err) {
					t.Fatalf("error %v, want one containing %q", err, c.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if c.proto == "" {
				c.proto = config.UDP
			}
			if u.addr != netip.MustParseAddrPort(c.listen) || u.user != c.user || u.pass != c.pass || u.proto != c.proto {
				t.Fatalf("got %+v", u)
			}
		})
	}
}

// A TLS or DTLS URI serves a self-signed certificate, as stunnerd's does.
func TestTLSURIConfig(t *testing.T) {
	o := options{log: "all:INFO", logFormat: "text", realm: "r", xdpMode: "auto", minPort: 49152, maxPort: 65535, maxBindings: 1024}
	for uri, proto := range map[string]config.Protocol{"turns://u:p@127.0.0.1:5349": config.TLS, "turns://u:p@127.0.0.1:5349?transport=udp": config.DTLS} {
		cfg, err := buildConfig(o, uri)
		if err != nil {
			t.Fatal(err)
		}
		if len(cfg.Listeners) != 1 || cfg.Listeners[0].Protocol != proto || cfg.Listeners[0].Cert == nil || cfg.Users["u"] != "p" {
			t.Fatalf("%s: %+v", uri, cfg.Listeners)
		}
		leaf, err := x509.ParseCertificate(cfg.Listeners[0].Cert.Certificate[0])
		if err != nil || leaf.Subject.CommonName != "localhost" {
			t.Fatalf("%s: certificate: %v %v", uri, leaf, err)
		}
	}
}

func TestBuildConfigErrors(t *testing.T) {
	good := options{log: "all:INFO", logFormat: "text", realm: "r", xdpMode: "auto", minPort: 49152, maxPort: 65535, maxBindings: 1024}
	uri := "turn://u:p@10.0.0.1:3478"
	cfg, err := buildConfig(good, uri)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.XDPMode != loader.ModeAuto || cfg.MaxBindings != 1024 || cfg.Users["u"] != "p" {
		t.Fatalf("config %+v", cfg)
	}
	for name, mut := range map[string]func(*options){
		"bad mode":          func(o *options) { o.xdpMode = "turbo" },
		"bad relay address": func(o *options) { o.relayAddr = "10.0.0" },
		"port zero":         func(o *options) { o.minPort = 0 },
		"port too big":      func(o *options) { o.maxPort = 70000 },
		"empty iface":       func(o *options) { o.xdpIfaces = "eth0,," },
		"zero bindings":     func(o *options) { o.maxBindings = 0 },
		"bad over-limit":    func(o *options) { o.overLimit = "shape" },
	} {
		t.Run(name, func(t *testing.T) {
			o := good
			mut(&o)
			if _, err := buildConfig(o, uri); err == nil {
				t.Fatal("no error")
			}
		})
	}
}

// TestRateLimitFlags: the limit reaches the daemon's config as given, in
// datagrams and bytes per second; pass is chosen only by name.
func TestRateLimitFlags(t *testing.T) {
	o, _, err := parseFlags([]string{"--max-alloc-pps", "2000", "--max-alloc-bps", "125000", "--over-limit", "pass", "turn://u:p@10.0.0.1:3478"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	o.log, o.logFormat = "all:INFO", "text"
	cfg, err := buildConfig(o, "turn://u:p@10.0.0.1:3478")
	if err != nil {
		t.Fatal(err)
	}
	if want := (channelmap.RateLimit{PacketsPerSecond: 2000, BytesPerSecond: 125000, Pass: true}); cfg.RateLimit != want {
		t.Fatalf("rate limit %+v, want %+v", cfg.RateLimit, want)
	}
	o, _, _ = parseFlags([]string{"turn://u:p@10.0.0.1:3478"}, io.Discard)
	if cfg, err := buildConfig(o, "turn://u:p@10.0.0.1:3478"); err != nil || !cfg.RateLimit.Off() || cfg.RateLimit.Pass {
		t.Fatalf("default: %+v, %v; want no limit, drop", cfg.RateLimit, err)
	}
}

// --handover-dir, the steering directory's old name, still sets it, with a
// deprecation notice; --steering-dir is the name --help shows.
func TestSteeringDirFlag(t *testing.T) {
	var stderr strings.Builder
	o, _, err := parseFlags([]string{"--handover-dir=/sys/fs/bpf/x", "turn://u:p@10.0.0.1:3478"}, &stderr)
	if err != nil || o.steeringDir != "/sys/fs/bpf/x" || !strings.Contains(stderr.String(), "--steering-dir") {
		t.Fatalf("--handover-dir: dir %q, %v, stderr %q", o.steeringDir, err, stderr.String())
	}
	o, _, err = parseFlags([]string{"--steering-dir=", "turn://u:p@10.0.0.1:3478"}, io.Discard)
	if err != nil || o.steeringDir != "" {
		t.Fatalf("--steering-dir=: dir %q, %v", o.steeringDir, err)
	}
}

func TestUsageAndBadInvocations(t *testing.T) {
	var out bytes.Buffer
	if code := run([]string{"--help"}, &out); code != 0 {
		t.Fatalf("--help exit %d", code)
	}
	for _, flagName := range []string{"-log", "-log-format", "-relay-address", "-min-relay-port", "-max-relay-port", "-xdp-mode", "-xdp-iface", "-metrics-addr", "-health-addr", "-force-ready-status", "-max-bindings", "-allow-peer", "-deny-peer", "-grace-period", "turn://USER:PASS@ADDR:PORT"} {
		if !strings.Contains(out.String(), flagName) {
			t.Errorf("--help does not explain %s", flagName)
		}
	}
	for _, args := range [][]string{
		{"turn://u:p@10.0.0.1:3478", "extra"},
		{"--log=all:LOUD", "turn://u:p@10.0.0.1:3478"},
		{"--log-format=xml", "turn://u:p@10.0.0.1:3478"},
		{"--no-such-flag", "turn://u:p@10.0.0.1:3478"},
		{"--allow-peer=10.0.0.1/8", "turn://u:p@10.0.0.1:3478"},
		{"--deny-peer=nonsense", "turn://u:p@10.0.0.1:3478"},
	} {
		out.Reset()
		if code := run(args, &out); code != 2 {
			t.Errorf("%v: exit %d, want 2 (output %q)", args, code, out.String())
		}
		if out.Len() == 0 {
			t.Errorf("%v: no error message", args)
		}
	}
}

func TestVersion(t *testing.T) {
	if code := run([]string{"--version", "turn://u:p@10.0.0.1:3478"}, io.Discard); code != 0 {
		t.Fatalf("--version exit %d, want 0 whatever else the command line holds", code)
	}
	got := versionString()
	if !strings.HasPrefix(got, "stunnerd-xdp ") || !strings.Contains(got, runtime.Version()) {
		t.Errorf("versionString() = %q, want stunnerd-xdp VERSION and the Go version", got)
	}
	defer func(v string) { version = v }(version)
	version = "v9.9.9-test"
	if got := versionString(); !strings.HasPrefix(got, "stunnerd-xdp v9.9.9-test,") {
		t.Errorf("with a link-time version: %q", got)
	}
}
