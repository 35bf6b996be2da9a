package stunner

import (
	"bytes"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	stnrv1 "github.com/l7mp/stunner/pkg/apis/v1"
	cdsclient "github.com/l7mp/stunner/pkg/config/client"

	"github.com/l7mp/stunnerd-xdp/internal/config"
)

// The fixtures of internal/config are STUNner's own schema: each decodes
// strictly into STUNner v1.2.1's StunnerConfig and passes its Validate
// (except the one that carries fields a newer operator might add), and the
// zero config is the one STUNner's client would recognise as such.
func TestFixturesAreSTUNnerConfigs(t *testing.T) {
	t.Setenv("STUNNER_ADDR", "10.0.0.5")
	files, err := filepath.Glob("../../internal/config/testdata/*")
	if err != nil || len(files) == 0 {
		t.Fatalf("fixtures: %v %v", files, err)
	}
	for _, f := range files {
		t.Run(filepath.Base(f), func(t *testing.T) {
			b, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			var c stnrv1.StunnerConfig
			dec := json.NewDecoder(bytes.NewReader(b))
			dec.DisallowUnknownFields()
			err = dec.Decode(&c)
			future := strings.Contains(f, "future")
			if future != (err != nil) {
				t.Fatalf("strict decode into STUNner's type: %v (future fields expected: %v)", err, future)
			}
			if future {
				return
			}
			if err := c.Validate(); err != nil {
				t.Fatalf("STUNner's Validate: %v", err)
			}
			if zero := strings.Contains(f, "zero"); zero != cdsclient.IsConfigDeleted(&c) {
				t.Fatalf("STUNner's IsConfigDeleted: %v", !zero)
			}
		})
	}
}

// Configs built with STUNner's types, as the operator's renderer builds them
// and the CDS server serializes them, load; what is not implemented warns.
func TestRenderedConfigsLoad(t *testing.T) {
	t.Setenv("STUNNER_ADDR", "10.0.0.5")
	health := "http://:8086"
	base := func() *stnrv1.StunnerConfig {
		return &stnrv1.StunnerConfig{
			ApiVersion: stnrv1.ApiVersion,
			Admin:      stnrv1.AdminConfig{Name: "stunner-daemon", HealthCheckEndpoint: &health},
			Auth: stnrv1.AuthConfig{Type: "ephemeral", Realm: stnrv1.DefaultRealm,
				Credentials: map[string]string{"secret": "s"}},
			Listeners: []stnrv1.ListenerConfig{{Name: "stunner/gw/udp", Protocol: "TURN-UDP", Addr: "$STUNNER_ADDR",
				Port: 3478, Routes: []string{"stunner/route"}}},
			Clusters: []stnrv1.ClusterConfig{{Name: "stunner/route", Type: "STATIC",
				Endpoints: []string{"10.244.0.0/16:<10000-20000>", "10.96.0.1"}}},
		}
	}
	for _, c := range []struct {
		name string
		edit func(*stnrv1.StunnerConfig)
		warn string
	}{
		{"static port ranges", func(*stnrv1.StunnerConfig) {}, ""},
		{"strict dns", func(c *stnrv1.StunnerConfig) {
			c.Clusters[0] = stnrv1.ClusterConfig{Name: "stunner/route", Type: "STRICT_DNS", Endpoints: []string{"media.stunner.svc.cluster.local"}}
		}, ""},
		{"offload None", func(c *stnrv1.StunnerConfig) { c.Admin.OffloadEngine = "None" }, ""},
		{"offload TC", func(c *stnrv1.StunnerConfig) { c.Admin.OffloadEngine = "TC" }, "offload_engine TC"},
		{"user quota", func(c *stnrv1.StunnerConfig) { c.Admin.UserQuota = 3 }, ""},
		{"license", func(c *stnrv1.StunnerConfig) { c.Admin.LicenseConfig = &stnrv1.LicenseConfig{Key: "k", HMAC: "h"} }, "license_config"},
		{"tcp cluster", func(c *stnrv1.StunnerConfig) { c.Clusters[0].Protocol = "TCP" }, "protocol TCP"},
		{"tcp listener", func(c *stnrv1.StunnerConfig) { c.Listeners[0].Protocol = "TURN-TCP" }, ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			sc := base()
			c.edit(sc)
			if err := sc.Validate(); err != nil {
				t.Fatal(err)
			}
			b, err := json.Marshal(sc)
			if err != nil {
				t.Fatal(err)
			}
			r, err := config.Parse(b)
			if err != nil {
				t.Fatalf("does not load: %v\n%s", err, b)
			}
			got := strings.Join(r.Warnings, "; ")
			if (c.warn == "") != (got == "") || !strings.Contains(got, c.warn) {
				t.Errorf("warnings %q, want one about %q", got, c.warn)
			}
		})
	}
	// The zero config the CDS server sends for a deleted gateway.
	z := cdsclient.ZeroConfig("stunner/gw")
	if err := z.Validate(); err != nil {
		t.Fatal(err)
	}
	b, _ := json.Marshal(z)
	if _, err := config.Parse(b); !errors.Is(err, config.ErrZeroConfig) {
		t.Errorf("zero config: %v", err)
	}
}
