package config

import (
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// env is a fixed environment for ParseEnv.
func env(kv ...string) func(string) (string, bool) {
	m := map[string]string{}
	for i := 0; i+1 < len(kv); i += 2 {
		m[kv[i]] = kv[i+1]
	}
	return func(k string) (string, bool) { v, ok := m[k]; return v, ok }
}

func hasWarning(r *Resolved, sub string) bool {
	return slices.ContainsFunc(r.Warnings, func(w string) bool { return strings.Contains(w, sub) })
}

// stunnerd expands $VARIABLES in the whole document but the credentials, and
// defaults $STUNNER_PORT.
func TestExpandWholeDocument(t *testing.T) {
	doc := `version: v1
admin:
  name: $GW_NAME
  loglevel: $LOGLEVEL
  metrics_endpoint: "http://$METRICS_HOST:$METRICS_PORT/metrics"
auth:
  type: $AUTH_TYPE
  realm: $REALM
  credentials:
    username: user-$GW_NAME
    password: pa$$word$GW_NAME
listeners:
  - name: udp
    address: $STUNNER_ADDR
    port: $STUNNER_PORT
    routes: [$CLUSTER]
clusters:
  - name: $CLUSTER
    endpoints: ["$PEER_NET"]
`
	lookup := env("GW_NAME", "gw", "LOGLEVEL", "all:DEBUG", "METRICS_HOST", "127.0.0.1", "METRICS_PORT", "9090",
		"AUTH_TYPE", "plaintext", "REALM", "example.org", "STUNNER_ADDR", "10.0.0.5", "CLUSTER", "media",
		"PEER_NET", "10.9.0.0/16")
	r, err := ParseEnv([]byte(doc), lookup)
	if err != nil {
		t.Fatal(err)
	}
	if r.Name != "gw" || r.LogLevel != "all:DEBUG" || r.MetricsAddr != "127.0.0.1:9090" || r.Auth.Realm != "example.org" {
		t.Errorf("admin/auth not expanded: %+v", r)
	}
	// Credentials are taken as written: a '$' in a password is a '$'.
	if r.Auth.Type != AuthStatic || r.Auth.Username != "user-$GW_NAME" || r.Auth.Password != "pa$$word$GW_NAME" {
		t.Errorf("credentials expanded: %+v", r.Auth)
	}
	l := r.Listeners[0]
	if l.Addr != netip.MustParseAddrPort("10.0.0.5:3478") {
		t.Errorf("listener %v: want $STUNNER_PORT defaulted to 3478", l.Addr)
	}
	if len(l.AllowPeers) != 1 || l.AllowPeers[0] != netip.MustParsePrefix("10.9.0.0/16") {
		t.Errorf("route/cluster not expanded: %+v", l)
	}
	// $STUNNER_PORT: given, else $STUNNER_PUBLIC_PORT, else 3478; not a number: defaulted.
	for _, c := range []struct {
		env  []string
		want uint16
	}{
		{[]string{"STUNNER_PORT", "3480"}, 3480},
		{[]string{"STUNNER_PUBLIC_PORT", "3481"}, 3481},
		{[]string{"STUNNER_PORT", "x", "STUNNER_PUBLIC_PORT", "3482"}, 3482},
		{[]string{"STUNNER_PUBLIC_PORT", "y"}, 3478},
	} {
		if got := Expand("$STUNNER_PORT", env(c.env...)); got != strconv.Itoa(int(c.want)) {
			t.Errorf("env %v: $STUNNER_PORT = %q, want %d", c.env, got, c.want)
		}
	}
}

func TestStunnerdEdges(t *testing.T) {
	auth := `"auth":{"credentials":{"username":"u","password":"p"}}`
	parse := func(t *testing.T, doc string) *Resolved {
		t.Helper()
		r, err := ParseEnv([]byte(doc), env())
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
	t.Run("v1alpha1", func(t *testing.T) {
		r := parse(t, `{"version":"v1alpha1","auth":{"type":"longterm","credentials":{"secret":"s"}},"listeners":[{"name":"l"}]}`)
		if r.Auth.Type != AuthEphemeral || len(r.Listeners) != 1 {
			t.Errorf("%+v", r)
		}
	})
	t.Run("route to an absent cluster is skipped", func(t *testing.T) {
		r := parse(t, `{"version":"v1",`+auth+`,"listeners":[{"name":"a","routes":["nope","c"]}],"clusters":[{"name":"c","endpoints":["10.1.0.0/16"]}]}`)
		l := r.Listeners[0]
		if !hasWarning(r, `"nope"`) || len(l.AllowPeers) != 1 || !slices.Equal(l.SkippedRoutes, []string{"nope"}) {
			t.Errorf("%+v %q", l, r.Warnings)
		}
	})
	t.Run("zero listeners warn", func(t *testing.T) {
		r := parse(t, `{"version":"v1",`+auth+`}`)
		if len(r.Listeners) != 0 || !hasWarning(r, "no listeners") {
			t.Errorf("%+v", r)
		}
	})
	t.Run("endpoints", func(t *testing.T) {
		for _, c := range []struct{ admin, metrics, health string }{
			{`{}`, "", DefaultHealthAddr},
			{`{"metrics_endpoint":"http://:8080/metrics"}`, ":8080", DefaultHealthAddr},
			{`{"metrics_endpoint":"http://10.0.0.1/metrics","healthcheck_endpoint":"http://10.0.0.1"}`, "10.0.0.1:8080", "10.0.0.1:8086"},
			{`{"healthcheck_endpoint":"http://[::1]/"}`, "", "[::1]:8086"},
			{`{"healthcheck_endpoint":""}`, "", ""},
		} {
			r := parse(t, `{"version":"v1","admin":`+c.admin+`,`+auth+`,"listeners":[{"name":"l"}]}`)
			if r.MetricsAddr != c.metrics || r.HealthAddr != c.health {
				t.Errorf("admin %s: metrics %q health %q, want %q %q", c.admin, r.MetricsAddr, r.HealthAddr, c.metrics, c.health)
			}
		}
	})
	t.Run("eight UDP ports, TCP beside them", func(t *testing.T) {
		var ls []string
		for i := range 8 {
			ls = append(ls, `{"name":"u`+string(rune('0'+i))+`","port":400`+string(rune('0'+i))+`}`)
		}
		ls = append(ls, `{"name":"t","protocol":"TURN-TCP","port":4009}`, `{"name":"u-again","address":"127.0.0.1","port":4000}`)
		r := parse(t, `{"version":"v1",`+auth+`,"listeners":[`+strings.Join(ls, ",")+`]}`)
		if len(r.Listeners) != 10 {
			t.Errorf("%d listeners", len(r.Listeners))
		}
	})
}
