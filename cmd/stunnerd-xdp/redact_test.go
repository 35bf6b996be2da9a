package main

import (
	"fmt"
	"io"
	"net"
	"net/http/httptest"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/pion/turn/v4"

	"github.com/l7mp/stunnerd-xdp/internal/config"
	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// No log line of a serving daemon shows a credential, at the most verbose
// level: not the TURN URI's password, not a config discovery URL's user,
// password or token, not the password of a config it was served, while
// clients allocate with the right and the wrong password.
func TestCredentialsNotLoggedWhileServing(t *testing.T) {
	t.Setenv("STUNNER_CONFIG_ORIGIN", "")
	secrets := []string{"s3cretpw", "hunter2", "tok3n", "cdspassw0rd"}
	check := func(what, log string) {
		t.Helper()
		if !strings.Contains(log, "TURN listener up") {
			t.Fatalf("%s: the daemon did not serve:\n%s", what, log)
		}
		for _, s := range secrets {
			if strings.Contains(log, s) {
				t.Errorf("%s: the log shows %q:\n%s", what, s, log)
			}
		}
	}
	allocate := func(server, user, password string) error {
		conn, err := net.ListenPacket("udp4", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		_, err = testenv.Allocate(t, &turn.ClientConfig{TURNServerAddr: server, STUNServerAddr: server,
			Username: user, Password: password, Realm: config.DefaultRealm, Conn: conn})
		return err
	}
	// serve allocates as user with the right and a wrong password once r
	// serves, stops it and checks its log.
	serve := func(what string, r *originRun, server, user, password string) {
		t.Helper()
		r.waitFor("the listener", 10*time.Second, func() bool { return strings.Contains(r.log.String(), "TURN listener up") })
		if err := allocate(server, user, password); err != nil {
			t.Fatal(err)
		}
		if allocate(server, user, "wrong") == nil {
			t.Fatal("a wrong password allocated")
		}
		r.stop()
		check(what, r.log.String())
	}
	common := []string{"--log=all:TRACE", "--grace-period=0", "--xdp-mode=off", "--health-addr=", "--metrics-addr=", "--steering-dir="}

	// A TURN URI.
	held, port := holdTURNPort(t)
	held.Close()
	server := fmt.Sprintf("127.0.0.1:%d", port)
	args := append(common, "--min-relay-port=40000", "--max-relay-port=40099", "turn://alice:s3cretpw@"+server)
	r := startRun(t, args, func(o options, log io.Writer, sigs chan os.Signal) int {
		o.configOrigin = ""
		cfg, err := buildConfig(o, args[len(args)-1])
		if err != nil {
			t.Error(err)
			return 2
		}
		return runURI(o, cfg, log, sigs)
	})
	serve("turn URI", r, server, "alice", "s3cretpw")

	// A config discovery server (a GET: the websocket of -w takes no user
	// and password in its URL), serving a static password.
	held, port = holdTURNPort(t)
	held.Close()
	server = fmt.Sprintf("127.0.0.1:%d", port)
	cds := httptest.NewServer(serveConfig(fmt.Sprintf(`{"version":"v1","admin":{},"auth":{"type":"static","credentials":{"username":"u","password":"cdspassw0rd"}},
"listeners":[{"name":"udp","protocol":"TURN-UDP","address":"127.0.0.1","port":%d}]}`, port)))
	defer cds.Close()
	url := strings.Replace(cds.URL, "http://", "http://bob:hunter2@", 1) + "/?token=tok3n"
	r = startOrigin(t, append(common, "-c", url)...)
	serve("config discovery", r, server, "u", "cdspassw0rd")
}
