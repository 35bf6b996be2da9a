package main

import (
	"context"
	"fmt"
	"net"
	"testing"
	"time"

	"github.com/pion/turn/v4"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/l7mp/stunnerd-xdp/internal/config"
	"github.com/l7mp/stunnerd-xdp/internal/daemon"
	"github.com/l7mp/stunnerd-xdp/internal/logging"
	"github.com/l7mp/stunnerd-xdp/internal/nodelabel"
	"github.com/l7mp/stunnerd-xdp/test/netns"
	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// TestConfigReloadKeepsNodeLabel: the node label says disabled, then a config
// reload changes admin.offload_engine from None to Auto. The label is the
// operator's switch for this node and must keep XDP off (a reload used to
// attach it). Runs in a fresh network namespace, XDP on its loopback.
func TestConfigReloadKeepsNodeLabel(t *testing.T) {
	if !testenv.InNetns() {
		netns.RequirePrivileged(t)
		ns := netns.NewNS(t, "reload")
		testenv.RunInNetns(t, ns.Name, 2*time.Minute)
		return
	}
	const listen = "127.0.0.1:3478"
	doc := func(engine, password string) []byte {
		return fmt.Appendf(nil, `{"version":"v1","admin":{"offload_engine":%q,"offload_interfaces":["lo"],"metrics_endpoint":"http://127.0.0.1:18080","healthcheck_endpoint":"http://127.0.0.1:18086"},
"auth":{"type":"static","credentials":{"username":"u","password":%q}},
"listeners":[{"name":"udp","protocol":"TURN-UDP","address":"127.0.0.1","port":3478}]}`, engine, password)
	}
	o := options{log: "all:WARN", logFormat: "text", realm: config.DefaultRealm, xdpMode: "auto",
		minPort: daemon.DefaultMinRelayPort, maxPort: daemon.DefaultMaxRelayPort, maxBindings: 1024,
		watch: true, set: map[string]bool{}}
	logger, err := logging.New(o.log, o.logFormat, t.Output())
	if err != nil {
		t.Fatal(err)
	}
	// The applier is what the file and config discovery watchers feed.
	a := &applier{o: o, logger: logger, log: logger.Slog("test"), warned: map[string]bool{},
		dns: config.NewDNSCache(net.DefaultResolver)}
	if err := a.apply(doc("None", "p1")); err != nil {
		t.Fatal(err)
	}
	d := a.d
	t.Cleanup(func() { _ = d.Close() })
	if err := d.FollowNode(context.Background(), nodelabel.Detach); err != nil {
		t.Fatal(err)
	}

	// Each reload changes the password: an allocation with the new one shows
	// the reload ran. The second one orders after everything the first did.
	for _, password := range []string{"p2", "p3"} {
		if err := a.apply(doc("Auto", password)); err != nil {
			t.Fatal(err)
		}
		waitAllocates(t, listen, password)
	}
	if got := d.Attached(); len(got) != 0 {
		t.Fatalf("the reload attached XDP (%v) while the node label says disabled", got)
	}
	// The label still works: back to the config's mode.
	if err := d.FollowNode(context.Background(), nodelabel.Default); err != nil {
		t.Fatal(err)
	}
	if got := d.Attached(); len(got) != 1 {
		t.Fatalf("label back to default with offload_engine Auto: attached %v, want lo", got)
	}
}

// waitAllocates waits until a TURN allocation as u with password succeeds.
func waitAllocates(t *testing.T, server, password string) {
	t.Helper()
	err := wait.PollUntilContextTimeout(context.Background(), 100*time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
		conn, err := net.ListenPacket("udp4", "127.0.0.1:0")
		if err != nil {
			return false, err
		}
		_, err = testenv.Allocate(t, &turn.ClientConfig{
			TURNServerAddr: server, STUNServerAddr: server,
			Username: "u", Password: password, Realm: config.DefaultRealm, Conn: conn,
		})
		return err == nil, nil
	})
	if err != nil {
		t.Fatalf("no allocation with password %s: the config was not reloaded", password)
	}
}
