package config

import (
	"context"
	"errors"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// The fixtures are configs as the operator renders them (the shape of
// STUNner v1.2.1's pkg/apis/v1 types after Validate, with the operator's
// defaults: admin name stunner-daemon, $STUNNER_ADDR listener addresses,
// offload_engine None, port ranges :<min-max> from a backend's port and
// endPort, STRICT_DNS clusters when endpoint discovery is off), STUNner's own
// example (stunner-iperf-test.conf, verbatim), one with fields a newer
// operator might render, and the zero config the discovery service sends.
func TestFixturesLoad(t *testing.T) {
	t.Setenv("STUNNER_ADDR", "10.0.0.5")
	files, err := filepath.Glob("testdata/*")
	if err != nil || len(files) < 4 {
		t.Fatalf("fixtures: %v %v", files, err)
	}
	for _, f := range files {
		t.Run(filepath.Base(f), func(t *testing.T) {
			b, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			r, err := Parse(b)
			if filepath.Base(f) == "zero-config.json" {
				if !errors.Is(err, ErrZeroConfig) {
					t.Fatalf("zero config: %v", err)
				}
				return
			}
			if err != nil {
				t.Fatalf("does not load: %v", err)
			}
			if len(r.Listeners) == 0 {
				t.Fatal("no listeners")
			}
		})
	}
}

func TestOperatorManaged(t *testing.T) {
	t.Setenv("STUNNER_ADDR", "10.0.0.5")
	r := parseFile(t, "testdata/operator-managed.json")
	if len(r.Warnings) != 0 {
		t.Errorf("warnings for a config the operator renders today: %q", r.Warnings)
	}
	// offload_engine None is no preference (the flags and the label decide),
	// not "off".
	if r.XDPMode != "" || r.OffloadEngine != "None" {
		t.Errorf("offload: mode %q engine %q", r.XDPMode, r.OffloadEngine)
	}
	udp := r.Listeners[1]
	if udp.Name != "stunner/udp-gateway/udp-listener" || udp.Addr != netip.MustParseAddrPort("10.0.0.5:3478") || udp.Protocol != UDP {
		t.Fatalf("udp listener %+v", udp)
	}
	want := []Endpoint{
		{netip.MustParsePrefix("10.244.0.12/32"), 10000, 20000},
		{netip.MustParsePrefix("10.244.1.0/24"), 5000, 5000},
		{netip.MustParsePrefix("10.96.14.3/32"), 1, 65535},
	}
	if !slices.Equal(udp.PeerPorts, want) || len(udp.AllowPeers) != 3 {
		t.Errorf("peer ports %v, allow %v", udp.PeerPorts, udp.AllowPeers)
	}
	if !slices.Equal(udp.DNSNames, []string{"media-server.stunner.svc.cluster.local"}) || !r.HasDNS() {
		t.Errorf("dns names %v", udp.DNSNames)
	}
	if tcp := r.Listeners[0]; tcp.Protocol != TCP || len(tcp.DNSNames) != 0 || len(tcp.PeerPorts) != 3 {
		t.Errorf("tcp listener %+v", tcp)
	}
}

// Fields this dataplane does not implement and fields it does not know warn,
// each naming its path, and the rest of the config runs.
func TestUnknownAndUnimplementedWarn(t *testing.T) {
	t.Setenv("STUNNER_ADDR", "10.0.0.5")
	r := parseFile(t, "testdata/operator-future.json")
	for _, w := range []string{
		"unknown field admin.telemetry_sink", "min_relay_port and max_relay_port are v1alpha1 fields: ignored in a v1 config", "unknown field clusters[0].weight",
		"admin.license_config", "offload_engine TC", "protocol TCP",
	} {
		if !slices.ContainsFunc(r.Warnings, func(s string) bool { return strings.Contains(s, w) }) {
			t.Errorf("no warning about %q in %q", w, r.Warnings)
		}
	}
	if len(r.Warnings) != 6 {
		t.Errorf("%d warnings, want 6: %q", len(r.Warnings), r.Warnings)
	}
	if r.UserQuota != 10 {
		t.Errorf("admin.user_quota resolved to %d, want 10", r.UserQuota)
	}
	if r.XDPMode != "auto" || len(r.Listeners) != 2 || r.Listeners[0].Protocol != DTLS || r.Auth.Type != AuthEphemeral {
		t.Errorf("resolved %+v", r)
	}
	// A TCP cluster admits its endpoints as UDP peers, as stunnerd's does.
	if l := r.Listeners[0]; !slices.Equal(l.AllowPeers, []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}) {
		t.Errorf("tcp cluster endpoints %v", l.AllowPeers)
	}
}

func TestOffloadEngine(t *testing.T) {
	for engine, want := range map[string]string{"": "", "None": "", "none": "", "Auto": "auto", "XDP": "auto", "TC": "auto"} {
		r, err := Parse([]byte(`{"version":"v1","admin":{"offload_engine":"` + engine + `"},"auth":{"credentials":{"username":"u","password":"p"}},"listeners":[{"name":"l"}]}`))
		if err != nil || r.XDPMode != want {
			t.Errorf("offload_engine %q: mode %q (%v), want %q", engine, r.XDPMode, err, want)
			continue
		}
		if warned := len(r.Warnings) > 0; warned != (engine == "TC") {
			t.Errorf("offload_engine %q: warnings %q", engine, r.Warnings)
		}
	}
	// An engine stunnerd does not know is refused, as stunnerd refuses it
	// (test/stunner checks the same list against STUNner's parser).
	if _, err := Parse([]byte(`{"version":"v1","admin":{"offload_engine":"Turbo"},"auth":{"credentials":{"username":"u","password":"p"}},"listeners":[{"name":"l"}]}`)); err == nil {
		t.Error("offload_engine Turbo: accepted")
	}
}

func TestParseEndpoint(t *testing.T) {
	for in, want := range map[string]Endpoint{
		"10.0.0.1":                {netip.MustParsePrefix("10.0.0.1/32"), 1, 65535},
		"10.0.0.0/8:<1-1>":        {netip.MustParsePrefix("10.0.0.0/8"), 1, 1},
		"10.0.0.1:<5000-6000>":    {netip.MustParsePrefix("10.0.0.1/32"), 5000, 6000},
		"fd00::1:<5000-6000>":     {netip.MustParsePrefix("fd00::1/128"), 5000, 6000},
		"fd00::/64:<65535-65535>": {netip.MustParsePrefix("fd00::/64"), 65535, 65535},
	} {
		got, err := ParseEndpoint(in)
		if err != nil || got != want {
			t.Errorf("%s: %+v %v, want %+v", in, got, err, want)
		}
	}
	e, _ := ParseEndpoint("10.0.0.0/24:<5000-5001>")
	for p, ok := range map[string]bool{"10.0.0.7:5000": true, "10.0.0.7:5001": true, "10.0.0.7:4999": false, "10.0.0.7:5002": false, "10.0.1.7:5000": false} {
		if e.Contains(netip.MustParseAddrPort(p)) != ok {
			t.Errorf("%v contains %s: want %v", e, p, ok)
		}
	}
}

type fakeResolver map[string][]netip.Addr

func (f fakeResolver) LookupNetIP(_ context.Context, _, host string) ([]netip.Addr, error) {
	if a, ok := f[host]; ok {
		return a, nil
	}
	return nil, errors.New("no such host")
}

func TestDNSCache(t *testing.T) {
	t.Setenv("STUNNER_ADDR", "10.0.0.5")
	r := parseFile(t, "testdata/operator-managed.json")
	const name = "media-server.stunner.svc.cluster.local"
	res := fakeResolver{name: {netip.MustParseAddr("10.244.2.9"), netip.MustParseAddr("::ffff:10.244.2.8")}}
	c := NewDNSCache(res)
	got, errs := c.Apply(context.Background(), r)
	if len(errs) != 0 {
		t.Fatal(errs)
	}
	udp := got.Listeners[1]
	if !slices.Contains(udp.AllowPeers, netip.MustParsePrefix("10.244.2.8/32")) || !slices.Contains(udp.AllowPeers, netip.MustParsePrefix("10.244.2.9/32")) ||
		!slices.Contains(udp.PeerPorts, Endpoint{netip.MustParsePrefix("10.244.2.9/32"), 1, 65535}) {
		t.Errorf("resolved: %v %v", udp.AllowPeers, udp.PeerPorts)
	}
	if len(r.Listeners[1].AllowPeers) != 3 || len(got.Listeners[0].AllowPeers) != 3 {
		t.Errorf("the input or a listener without the route changed: %v %v", r.Listeners[1].AllowPeers, got.Listeners[0].AllowPeers)
	}
	// A failing lookup keeps the last addresses.
	delete(res, name)
	again, errs := c.Apply(context.Background(), r)
	if len(errs) != 1 || !slices.Equal(again.Listeners[1].AllowPeers, udp.AllowPeers) {
		t.Errorf("after a failed lookup: %v %v", errs, again.Listeners[1].AllowPeers)
	}
}

func parseFile(t *testing.T, f string) *Resolved {
	t.Helper()
	b, err := os.ReadFile(f)
	if err != nil {
		t.Fatal(err)
	}
	r, err := Parse(b)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// A v1alpha1 config's relay port range (its listeners' min_relay_port and
// max_relay_port, which stunnerd v1.2.1 drops) is the daemon's; unset ends
// take v1alpha1's defaults; listeners that differ are refused.
func TestV1alpha1RelayPorts(t *testing.T) {
	doc := func(a, b string) []byte {
		return []byte(`{"version":"v1alpha1","auth":{"credentials":{"username":"u","password":"p"}},"listeners":[` +
			`{"name":"a","protocol":"TURN-UDP","address":"10.0.0.5","port":3478` + a + `},` +
			`{"name":"b","protocol":"TURN-TCP","address":"10.0.0.5","port":3478` + b + `}]}`)
	}
	for _, c := range []struct {
		name, a, b string
		lo, hi     uint16
		err        string
	}{
		{"none", "", "", 0, 0, ""},
		{"both", `,"min_relay_port":40000,"max_relay_port":41000`, `,"min_relay_port":40000,"max_relay_port":41000`, 40000, 41000, ""},
		{"one listener", `,"min_relay_port":40000,"max_relay_port":41000`, "", 40000, 41000, ""},
		{"min only", `,"min_relay_port":40000`, "", 40000, 65535, ""},
		{"max only", `,"max_relay_port":40000`, "", 32768, 40000, ""},
		{"different", `,"min_relay_port":40000`, `,"min_relay_port":40001`, 0, 0, "one daemon relays from one range"},
		{"empty", `,"min_relay_port":41000,"max_relay_port":40000`, "", 0, 0, "want 1 <= min_relay_port"},
	} {
		r, err := Parse(doc(c.a, c.b))
		switch {
		case c.err != "" && (err == nil || !strings.Contains(err.Error(), c.err)):
			t.Errorf("%s: %v, want an error about %q", c.name, err, c.err)
		case c.err == "" && err != nil:
			t.Errorf("%s: %v", c.name, err)
		case c.err == "" && (r.MinRelayPort != c.lo || r.MaxRelayPort != c.hi):
			t.Errorf("%s: %d-%d, want %d-%d", c.name, r.MinRelayPort, r.MaxRelayPort, c.lo, c.hi)
		}
	}
}
