package main

import (
	"bytes"
	"errors"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/l7mp/stunnerd-xdp/internal/config"
)

func TestParseOrigin(t *testing.T) {
	for in, want := range map[string]string{
		"10.0.0.1:13478":                      "http://10.0.0.1:13478",
		":13478":                              "http://:13478",
		"stunner-config-discovery:13478":      "http://stunner-config-discovery:13478",
		"[fd00::1]:13478":                     "http://[fd00::1]:13478",
		"http://cds.stunner-system.svc:13478": "http://cds.stunner-system.svc:13478",
		"https://cds:13478/api/v1":            "https://cds:13478",
		"ws://cds:13478":                      "http://cds:13478",
		"wss://cds:13478":                     "https://cds:13478",
		"file:///etc/stunnerd/stunnerd.conf":  "file:///etc/stunnerd/stunnerd.conf",
		"/etc/stunnerd/stunnerd.conf":         "file:///etc/stunnerd/stunnerd.conf",
		"stunnerd.conf":                       "file://stunnerd.conf",
	} {
		o, err := parseOrigin(in)
		if err != nil || o.String() != want {
			t.Errorf("%s: %v %v, want %s", in, o, err, want)
		}
	}
	for in, want := range map[string]string{"k8s": "STUNNER_CONFIG_ORIGIN", "ftp://x:1": "scheme", "http://": "no host", "": "empty"} {
		if _, err := parseOrigin(in); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%q: %v, want an error about %s", in, err, want)
		}
	}
	if _, err := parseOrigin("k8s"); !errors.Is(err, errK8sOrigin) {
		t.Errorf("k8s: %v", err)
	}
}

func TestCDSURL(t *testing.T) {
	o, _ := parseOrigin("10.0.0.1:13478")
	c := &cdsClient{base: o.cds, namespace: "stunner", name: "udp-gateway", node: "node-1"}
	if got := c.url(false).String(); got != "http://10.0.0.1:13478/api/v1/configs/stunner/udp-gateway?node=node-1" {
		t.Errorf("get: %s", got)
	}
	if got := c.url(true).String(); got != "ws://10.0.0.1:13478/api/v1/configs/stunner/udp-gateway?node=node-1&watch=true" {
		t.Errorf("watch: %s", got)
	}
	o, _ = parseOrigin("https://cds:13478")
	c.base, c.node = o.cds, ""
	if got := c.url(true).String(); got != "wss://cds:13478/api/v1/configs/stunner/udp-gateway?watch=true" {
		t.Errorf("watch over TLS: %s", got)
	}
}

// The operator's command line and environment parse into what stunnerd
// makes of them.
func TestOperatorCommandLine(t *testing.T) {
	t.Setenv("STUNNER_CONFIG_ORIGIN", "http://10.96.0.10:13478")
	t.Setenv("STUNNER_NAMESPACE", "stunner")
	t.Setenv("STUNNER_NAME", "udp-gateway")
	t.Setenv("STUNNER_NODENAME", "node-1")
	t.Setenv("NODE_NAME", "")
	var out bytes.Buffer
	o, _, err := parseFlags([]string{"-w", "--udp-thread-num=16"}, &out)
	if err != nil {
		t.Fatal(err)
	}
	if o.configOrigin != "http://10.96.0.10:13478" || o.id != "stunner/udp-gateway" || !o.watch || o.udpThreadNum != 16 ||
		o.cdsNode != "node-1" || o.nodeName != "node-1" || !o.labelNode {
		t.Errorf("options %+v", o)
	}
	cfg, err := flagsConfig(o)
	if err != nil || cfg.UDPThreadNum != 16 {
		t.Errorf("daemon config: UDPThreadNum %d, %v", cfg.UDPThreadNum, err)
	}
	// Short forms, and flags over the environment.
	o, _, err = parseFlags([]string{"-c", "file:///x.conf", "-i", "ns/gw", "-u", "4", "-v", "-d", "--node-name=n2"}, &out)
	if err != nil || o.configOrigin != "file:///x.conf" || o.id != "ns/gw" || o.udpThreadNum != 4 || o.log != "all:DEBUG" ||
		!o.dryRun || o.nodeName != "n2" || o.labelNode {
		t.Errorf("short forms: %+v %v", o, err)
	}
	// NODE_NAME is the label's node before $STUNNER_NODENAME, and is strict.
	t.Setenv("NODE_NAME", "n3")
	if o, _, _ = parseFlags([]string{"-w"}, &out); o.nodeName != "n3" || o.labelNode || o.cdsNode != "node-1" {
		t.Errorf("NODE_NAME: %+v", o)
	}
}

func TestStunnerdBadInput(t *testing.T) {
	t.Setenv("STUNNER_CONFIG_ORIGIN", "")
	for _, c := range []struct {
		args []string
		env  map[string]string
		want string
	}{
		{[]string{"--udp-thread-num=-1", "turn://u:p@10.0.0.1:3478"}, nil, "udp-thread-num"},
		{[]string{"--udp-thread-num=many", "turn://u:p@10.0.0.1:3478"}, nil, "udp-thread-num"},
		{[]string{"-c", "k8s"}, nil, "STUNNER_CONFIG_ORIGIN"},
		{[]string{"-c", "10.0.0.1:13478", "-i", "no-slash"}, nil, "NAMESPACE/NAME"},
		{[]string{"-c", "10.0.0.1:13478", "turn://u:p@10.0.0.1:3478"}, nil, "exclude each other"},
		{nil, map[string]string{"STUNNER_CONFIG_ORIGIN": "ftp://x:1"}, "scheme"},
		{[]string{"-c", "/no/such/stunnerd.conf"}, nil, "read config"},
		{[]string{"-c", "../../internal/config/testdata/zero-config.json", "--health-addr="}, nil, "nothing to serve"},
	} {
		for k, v := range c.env {
			t.Setenv(k, v)
		}
		var out bytes.Buffer
		if code := run(c.args, &out); code != 2 || !strings.Contains(out.String(), c.want) {
			t.Errorf("%v %v: exit %d, %q; want 2 and %q", c.args, c.env, code, out.String(), c.want)
		}
		for k := range c.env {
			t.Setenv(k, "")
		}
	}
	var out bytes.Buffer
	if code := run([]string{"--help"}, &out); code != 0 {
		t.Fatalf("--help: %d", code)
	}
	for _, want := range []string{"--config", "-w, --watch", "-l, --log", "-i, --id", "-d, --dry-run", "-v, --verbose",
		"-u, --udp-thread-num", "--force-ready-status", "--log-format", "STUNNER_CONFIG_ORIGIN", "STUNNER_NODENAME",
		"offload_engine None", "turn://USER:PASS@ADDR:PORT", "--xdp-mode"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("--help does not explain %q", want)
		}
	}
}

// A dry run checks a config and exits without serving.
func TestDryRun(t *testing.T) {
	t.Setenv("STUNNER_ADDR", "10.0.0.5")
	dir := t.TempDir()
	good := filepath.Join(dir, "good.json")
	b, err := os.ReadFile("../../internal/config/testdata/operator-future.json")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(good, b, 0o600); err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	if code := run([]string{"-d", "-c", good}, &out); code != 0 || !strings.Contains(out.String(), "dry run: config valid") ||
		!strings.Contains(out.String(), "unknown field admin.telemetry_sink") {
		t.Errorf("dry run: exit %d\n%s", code, out.String())
	}
	bad := filepath.Join(dir, "bad.json")
	if err := os.WriteFile(bad, []byte(`{"version":"v1","auth":{"type":"none"},"listeners":[{"name":"l"}]}`), 0o600); err != nil {
		t.Fatal(err)
	}
	out.Reset()
	if code := run([]string{"-d", "-c", bad}, &out); code != 2 || !strings.Contains(out.String(), "open relay") {
		t.Errorf("dry run of a bad config: exit %d\n%s", code, out.String())
	}
	// Valid as a document, refused by a start (relays are IPv4 and no
	// listener names an IPv4 address): the dry run refuses it too.
	v6 := filepath.Join(dir, "v6.json")
	if err := os.WriteFile(v6, []byte(`{"version":"v1","auth":{"type":"static","credentials":{"username":"u","password":"p"}},`+
		`"listeners":[{"name":"l","protocol":"TURN-UDP","address":"2001:db8::5","port":3478,"routes":["c"]}],`+
		`"clusters":[{"name":"c","type":"STATIC","endpoints":["0.0.0.0/0"]}]}`), 0o600); err != nil {
		t.Fatal(err)
	}
	out.Reset()
	if code := run([]string{"-d", "-c", v6}, &out); code != 2 || !strings.Contains(out.String(), "relay-address") {
		t.Errorf("dry run of an IPv6-only listener without a relay address: exit %d\n%s", code, out.String())
	}
	out.Reset()
	if code := run([]string{"-d", "turn://u:p@[2001:db8::5]:3478"}, &out); code != 2 || !strings.Contains(out.String(), "relay-address") {
		t.Errorf("dry run of an IPv6 TURN URI without a relay address: exit %d\n%s", code, out.String())
	}
}

// The config becomes the daemon's: port ranges per listener, offload from the
// config unless --xdp-mode is given, None leaving the flag's default.
func TestFromConfig(t *testing.T) {
	t.Setenv("STUNNER_ADDR", "10.0.0.5")
	b, err := os.ReadFile("../../internal/config/testdata/operator-managed.json")
	if err != nil {
		t.Fatal(err)
	}
	r, err := config.Parse(b)
	if err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	o, _, err := parseFlags([]string{"-c", "x.conf"}, &out)
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := fromConfig(o, r)
	if err != nil {
		t.Fatal(err)
	}
	if requestedMode(cfg) != "auto" || len(cfg.Listeners) != 2 || len(cfg.Listeners[1].PeerPorts) != 3 ||
		cfg.Listeners[1].PeerPorts[0].Prefix != netip.MustParsePrefix("10.244.0.12/32") || cfg.Users["user-1"] != "pass-1" {
		t.Errorf("config %+v", cfg)
	}
	o, _, _ = parseFlags([]string{"-c", "x.conf", "--xdp-mode=off"}, &out)
	r.XDPMode = "auto" // as Auto, XDP or TC in the config
	if cfg, _ := fromConfig(o, r); requestedMode(cfg) != "off" {
		t.Errorf("--xdp-mode=off lost to the config: %s", cfg.XDPMode)
	}
	// offload_interfaces: given, the interfaces XDP attaches to; empty
	// (STUNner's "all"), the daemon's default; --xdp-iface wins.
	for _, c := range []struct {
		config, flag, want []string
	}{
		{[]string{"eth1", "eth2"}, nil, []string{"eth1", "eth2"}},
		{nil, nil, nil},
		{[]string{"eth1"}, []string{"--xdp-iface=eth9"}, []string{"eth9"}},
	} {
		o, _, _ := parseFlags(append([]string{"-c", "x.conf"}, c.flag...), &out)
		r.Interfaces = c.config
		if cfg, err := fromConfig(o, r); err != nil || !slices.Equal(cfg.Interfaces, c.want) {
			t.Errorf("offload_interfaces %v, flags %v: interfaces %v, want %v (%v)", c.config, c.flag, cfg.Interfaces, c.want, err)
		}
	}
}

// A v1alpha1 config's relay port range is the daemon's unless the command
// line gives one.
func TestFromConfigRelayPorts(t *testing.T) {
	r, err := config.Parse([]byte(`{"version":"v1alpha1","auth":{"credentials":{"username":"u","password":"p"}},"listeners":[` +
		`{"name":"a","protocol":"TURN-UDP","address":"10.0.0.5","port":3478,"min_relay_port":40000,"max_relay_port":41000}]}`))
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		flags  []string
		lo, hi uint16
	}{
		{nil, 40000, 41000},
		{[]string{"--min-relay-port=50000"}, 50000, 41000},
		{[]string{"--min-relay-port=50000", "--max-relay-port=51000"}, 50000, 51000},
	} {
		var out bytes.Buffer
		o, _, err := parseFlags(append([]string{"-c", "x.conf"}, c.flags...), &out)
		if err != nil {
			t.Fatal(err)
		}
		cfg, err := fromConfig(o, r)
		if err != nil {
			t.Fatal(err)
		}
		if cfg.MinRelayPort != c.lo || cfg.MaxRelayPort != c.hi {
			t.Errorf("%v: relay ports %d-%d, want %d-%d", c.flags, cfg.MinRelayPort, cfg.MaxRelayPort, c.lo, c.hi)
		}
	}
}
