package stunner

// stunnerd's edges, checked with STUNner's own code: its sample v1alpha1
// config, its $VARIABLE expansion, its ephemeral usernames in both orders.

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"testing"
	"time"

	stnrv1 "github.com/l7mp/stunner/pkg/apis/v1"
	a12n "github.com/l7mp/stunner/pkg/authentication"
	cdsclient "github.com/l7mp/stunner/pkg/config/client"
	"github.com/pion/turn/v5"

	"github.com/l7mp/stunnerd-xdp/internal/config"
)

const sampleV1alpha1 = "testdata/stunnerd-v1alpha1.conf"

// sampleEnv is the environment STUNner's sample config is written for.
func sampleEnv(t *testing.T, authType string) {
	for k, v := range map[string]string{"STUNNER_ADDR": "127.0.0.1", "STUNNER_AUTH_TYPE": authType,
		"STUNNER_LOGLEVEL": "all:INFO", "STUNNER_REALM": "stunner.l7mp.io", "STUNNER_PORT": "", "STUNNER_PUBLIC_PORT": "",
		"STUNNER_MIN_PORT": "", "STUNNER_MAX_PORT": ""} {
		t.Setenv(k, v)
	}
}

// STUNner's own sample config (version v1alpha1) loads, and reads as
// STUNner's parser reads the same document once expanded: the same
// listeners, on the same addresses and ports, and the same auth type.
func TestSTUNnerSampleV1alpha1(t *testing.T) {
	sampleEnv(t, "longterm")
	b, err := os.ReadFile(sampleV1alpha1)
	if err != nil {
		t.Fatal(err)
	}
	ours, err := config.Parse(b)
	if err != nil {
		t.Fatalf("the sample does not load: %v", err)
	}
	// stunnerd v1.2.1's ParseConfig decodes the document before expanding
	// it, and `port: $STUNNER_PORT` fails that decode: its own sample does
	// not load in stunnerd. What it means is the expanded document.
	if _, err := cdsclient.ParseConfig(b); err != nil {
		t.Logf("stunnerd v1.2.1 itself refuses its sample (decoded before expansion): %v", err)
	}
	t.Setenv("STUNNER_PORT", "3478") // what stunnerd's ParseConfig sets when unset
	theirs, err := cdsclient.ParseConfig([]byte(os.ExpandEnv(string(b))))
	if err != nil {
		t.Fatal(err)
	}
	if err := theirs.Validate(); err != nil {
		t.Fatal(err)
	}
	if ours.Source.APIVersion != "v1alpha1" || theirs.ApiVersion != stnrv1.ApiVersion {
		t.Errorf("versions %q (ours, as written) %q (STUNner's, converted)", ours.Source.APIVersion, theirs.ApiVersion)
	}
	if string(ours.Auth.Type) != theirs.Auth.Type || ours.Auth.Realm != theirs.Auth.Realm {
		t.Errorf("auth %+v, STUNner's %s", ours.Auth, theirs.Auth.String())
	}
	// Credentials are not expanded, by either.
	if ours.Auth.Secret != "$STUNNER_SHARED_SECRET" {
		t.Errorf("secret %q: want it as written", ours.Auth.Secret)
	}
	var want, got []string
	for _, l := range theirs.Listeners {
		want = append(want, fmt.Sprintf("%s %s %s:%d %v", l.Name, l.Protocol, l.Addr, l.Port, l.Routes))
	}
	for _, l := range ours.Listeners {
		var routes []string
		for _, c := range l.Clusters {
			routes = append(routes, c.Name)
		}
		got = append(got, fmt.Sprintf("%s %s %s:%d %v", l.Name, l.Protocol, l.Addr.Addr(), l.Addr.Port(), routes))
	}
	slices.Sort(want)
	slices.Sort(got)
	if !slices.Equal(got, want) {
		t.Errorf("listeners:\nours:     %q\nSTUNner's: %q", got, want)
	}
}

// The binary serves STUNner's sample config with ephemeral credentials, and
// a pion/turn v5 client (STUNner's) allocates with usernames STUNner's
// authentication package accepts in both orders: EXPIRY:USER (what
// GenerateTimeWindowedUsername writes) and USER:EXPIRY.
func TestEphemeralUsernamesBothOrders(t *testing.T) {
	sampleEnv(t, "ephemeral")
	dir := t.TempDir()
	bin := filepath.Join(dir, "stunnerd-xdp")
	build := exec.Command("go", "build", "-o", bin, "./cmd/stunnerd-xdp")
	build.Dir = "../.."
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build: %v\n%s", err, out)
	}
	turnPort := freeBothPort(t)
	t.Setenv("STUNNER_PORT", fmt.Sprint(turnPort))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var logs bytes.Buffer
	// The sample's metrics endpoint is 0.0.0.0:8080: the flags keep the
	// test's endpoints off shared ports.
	daemon := exec.CommandContext(ctx, bin, "--xdp-mode=off", "--relay-address=127.0.0.1", "--steering-dir=",
		"--min-relay-port=20000", "--max-relay-port=20999", "--metrics-addr=", fmt.Sprintf("--health-addr=127.0.0.1:%d", freePort(t, "tcp")),
		"-c", sampleV1alpha1)
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
	secret := "$STUNNER_SHARED_SECRET" // credentials are not expanded, in stunnerd either
	expiry := time.Now().Add(time.Hour).Unix()
	for _, user := range []string{
		a12n.GenerateTimeWindowedUsername(time.Now(), time.Hour, "alice"),
		fmt.Sprintf("alice:%d", expiry),
	} {
		if _, err := a12n.CheckTimeWindowedUsername(user); err != nil {
			t.Fatalf("STUNner refuses %q: %v", user, err)
		}
		pass, err := a12n.GetLongTermCredential(user, secret)
		if err != nil {
			t.Fatal(err)
		}
		if err := allocateV5(fmt.Sprintf("127.0.0.1:%d", turnPort), user, pass); err != nil {
			t.Errorf("%s: %v", user, err)
		}
	}
}

// freeBothPort is a port free for UDP and TCP (the sample's two listeners
// share it).
func freeBothPort(t *testing.T) int {
	for range 20 {
		p := freePort(t, "udp")
		if l, err := net.Listen("tcp4", fmt.Sprintf("127.0.0.1:%d", p)); err == nil {
			l.Close()
			return p
		}
	}
	t.Fatal("no port free for both UDP and TCP")
	return 0
}

// allocateV5 allocates with pion/turn v5, retrying while the daemon starts.
func allocateV5(server, user, pass string) error {
	var err error
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		if err = allocateOnce(server, user, pass); err == nil {
			return nil
		}
	}
	return err
}

func allocateOnce(server, user, pass string) error {
	conn, err := net.ListenPacket("udp4", "127.0.0.1:0")
	if err != nil {
		return err
	}
	defer conn.Close()
	c, err := turn.NewClient(&turn.ClientConfig{STUNServerAddr: server, TURNServerAddr: server,
		Username: user, Password: pass, Realm: stnrv1.DefaultRealm, Conn: conn})
	if err != nil {
		return err
	}
	defer c.Close()
	if err := c.Listen(); err != nil {
		return err
	}
	relay, err := c.Allocate()
	if err != nil {
		return err
	}
	return relay.Close()
}

// admin.offload_engine: stunnerd-xdp takes exactly the values STUNner's
// parser (stnrv1.NewOffloadEngine, which stunnerd v1.2.1 validates the admin
// section with) takes, whatever their case, and refuses the others.
func TestOffloadEngineAsStunnerd(t *testing.T) {
	for _, engine := range []string{"", "None", "none", "NONE", "XDP", "xdp", "TC", "tc", "Auto", "AUTO", "Turbo", "eBPF", "none "} {
		_, theirs := stnrv1.NewOffloadEngine(engine)
		if engine == "" {
			theirs = nil // stunnerd's default: None
		}
		_, ours := config.Parse([]byte(`{"version":"v1","admin":{"offload_engine":"` + engine + `"},` +
			`"auth":{"credentials":{"username":"u","password":"p"}},"listeners":[{"name":"l"}]}`))
		if (ours == nil) != (theirs == nil) {
			t.Errorf("offload_engine %q: ours %v, stunnerd's %v", engine, ours, theirs)
		}
	}
}
