package stunner

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/go-logr/logr"
	stnrv1 "github.com/l7mp/stunner/pkg/apis/v1"
	"github.com/l7mp/stunner/pkg/config/server"
	"github.com/pion/turn/v4"

	"github.com/l7mp/stunnerd-xdp/test/netns"
)

const (
	cdsAddr   = "127.0.0.1:13478" // in the server namespace, where the daemon runs
	gatewayNS = "stunner"
	gateway   = "udp-gateway"
	user      = "user-1"
	password  = "pass-1"
	// The cluster admits the echo peer on port echoPort only (the operator
	// renders a backend's port so); otherPort is on the same peer, outside.
	echoPort  = 5000
	otherPort = 5001
)

var (
	serverAddr = netip.MustParseAddr("10.100.0.1") // $STUNNER_ADDR: the pod's address
	peerAddr   = netip.MustParseAddr("10.200.0.2")
)

// gatewayConfig is what the operator renders for a Gateway with a UDP
// listener per port, routed to one backend with a port (STUNner v1.2.1's
// types, validated so that the defaults are filled in as the operator's
// renderer does).
func gatewayConfig(t *testing.T, ports ...int) *stnrv1.StunnerConfig {
	t.Helper()
	health := "http://:8086"
	c := &stnrv1.StunnerConfig{
		ApiVersion: stnrv1.ApiVersion,
		Admin: stnrv1.AdminConfig{
			Name: "stunner-daemon", LogLevel: "all:INFO", MetricsEndpoint: "http://:8080/metrics",
			HealthCheckEndpoint: &health, OffloadEngine: "None",
			// Dataplane spec.offloadInterfaces: the rig's pod has two
			// interfaces, and the kernel path needs both.
			OffloadInterfaces: []string{"srv0", "srv1"},
		},
		Auth: stnrv1.AuthConfig{Type: "static", Realm: stnrv1.DefaultRealm,
			Credentials: map[string]string{"username": user, "password": password}},
		Clusters: []stnrv1.ClusterConfig{{Name: "stunner/media-plane", Type: "STATIC",
			Endpoints: []string{fmt.Sprintf("%s:<%d-%d>", peerAddr, echoPort, echoPort)}}},
	}
	for _, p := range ports {
		c.Listeners = append(c.Listeners, stnrv1.ListenerConfig{
			Name: fmt.Sprintf("%s/%s/udp-%d", gatewayNS, gateway, p), Protocol: "TURN-UDP",
			PublicAddr: "203.0.113.10", PublicPort: p, Addr: "$STUNNER_ADDR", Port: p,
			Routes: []string{"stunner/media-plane"},
		})
	}
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	return c
}

// TestOperatorDataplane runs the binary as the operator runs a Dataplane
// (`stunnerd -w --udp-thread-num=16` with its STUNNER_* environment) against
// STUNner's config discovery server, in a client -- server -- peer rig, and
// follows it through boot, a first config, an added listener, a server
// restart and a deleted gateway, checking /ready and the XDP path at each step.
func TestOperatorDataplane(t *testing.T) {
	netns.RequirePrivileged(t)
	bin := buildStunnerd(t)
	r := netns.NewRouted(t)
	// A pod's address is routable: the peer answers the relay address
	// (10.100.0.1, the pod's $STUNNER_ADDR) through the server.
	r.Peer.IP(t, "route", "add", serverAddr.String()+"/32", "via", r.ServerPeerIf.Addr.String(), "dev", r.PeerIf.Name)
	r.Peer.ServeUDPEcho(t, netip.AddrPortFrom(peerAddr, echoPort))
	r.Peer.ServeUDPEcho(t, netip.AddrPortFrom(peerAddr, otherPort))

	cds := startCDS(t, r.Server)
	d := r.Server.Start(t, "env",
		"STUNNER_CONFIG_ORIGIN=http://"+cdsAddr,
		"STUNNER_ADDR="+serverAddr.String(),
		"STUNNER_NAME="+gateway,
		"STUNNER_NAMESPACE="+gatewayNS,
		"STUNNER_NODENAME=node-1",
		bin, "-w", "--udp-thread-num=16")
	fail := func(format string, args ...any) {
		t.Helper()
		t.Fatalf(format+"\ndaemon stderr:\n%s", append(args, d.Stderr())...)
	}

	// Boot: live, not ready, while the server has no config for the gateway.
	waitStatus(t, r.Server, "/live", 200, 10*time.Second, fail)
	time.Sleep(time.Second)
	if code := status(r.Server, "/ready"); code != 503 {
		fail("/ready %d before any config, want 503", code)
	}

	// The first config: ready, and the UDP listener relays on XDP.
	id := gatewayNS + "/" + gateway
	cds.UpsertConfig(id, gatewayConfig(t, 3478))
	waitStatus(t, r.Server, "/ready", 200, 15*time.Second, fail)
	first := newClient(t, r.Client, 3478)
	first.xdpEcho(t, r.Server, fail)
	// The cluster's port range holds on both paths: nothing reaches the
	// peer's other port, and nothing towards it is offloaded.
	before := verdicts(t, r.Server)
	if n := first.send(t, otherPort, 20); n != 0 {
		fail("%d echoes from port %d, outside the cluster's port range", n, otherPort)
	}
	if got := verdicts(t, r.Server) - before; got != 0 {
		fail("%d packets to port %d relayed by XDP", got, otherPort)
	}

	// An update adds a listener: it serves, and the first session goes on.
	cds.UpsertConfig(id, gatewayConfig(t, 3478, 3479))
	second := waitClient(t, r.Client, 3479, fail)
	second.xdpEcho(t, r.Server, fail)
	first.xdpEcho(t, r.Server, fail)

	// The server restarts (the operator's pod rolls): the daemon keeps
	// serving, reconnects, and follows the config the new server has.
	cds.Close()
	time.Sleep(2 * time.Second)
	if code := status(r.Server, "/ready"); code != 200 {
		fail("/ready %d while the config server is away, want 200", code)
	}
	first.echo(t, echoPort, 10, fail)
	cds = startCDS(t, r.Server)
	cds.UpsertConfig(id, gatewayConfig(t, 3478, 3479, 3480))
	third := waitClient(t, r.Client, 3480, fail)
	third.xdpEcho(t, r.Server, fail)
	if !strings.Contains(d.Stderr(), "connected to the config discovery server") {
		fail("no reconnection logged")
	}

	// A deleted gateway's zero config is ignored, as stunnerd ignores it.
	cds.DeleteConfig(id)
	time.Sleep(2 * time.Second)
	if code := status(r.Server, "/ready"); code != 200 {
		fail("/ready %d after the zero config, want 200", code)
	}
	first.echo(t, echoPort, 10, fail)
	if !strings.Contains(d.Stderr(), "ignoring the empty config") {
		fail("the zero config was not seen")
	}

	// SIGTERM drains: unready at once, the exit follows the last allocation.
	if err := syscall.Kill(d.PID(), syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	waitStatus(t, r.Server, "/ready", 503, 5*time.Second, fail)
	first.echo(t, echoPort, 5, fail)
	for _, c := range []*client{first, second, third} {
		c.close()
	}
	if err := d.Wait(15 * time.Second); err != nil {
		fail("exit after the drain: %v", err)
	}
}

// buildStunnerd builds the daemon and names it stunnerd, as the image does.
func buildStunnerd(t *testing.T) string {
	t.Helper()
	_, file, _, _ := runtime.Caller(0)
	root := filepath.Join(filepath.Dir(file), "..", "..")
	dir := t.TempDir()
	out, err := exec.Command("go", "build", "-C", root, "-o", filepath.Join(dir, "stunnerd-xdp"), "./cmd/stunnerd-xdp").CombinedOutput()
	if err != nil {
		t.Fatalf("build: %v\n%s", err, out)
	}
	if err := os.Symlink("stunnerd-xdp", filepath.Join(dir, "stunnerd")); err != nil {
		t.Fatal(err)
	}
	return filepath.Join(dir, "stunnerd")
}

// startCDS starts STUNner's config discovery server with its socket in ns.
func startCDS(t *testing.T, ns *netns.NS) *server.Server {
	t.Helper()
	srv := server.New(cdsAddr, nil, logr.Discard())
	if err := ns.Do(func() error { return srv.Start(context.Background()) }); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Close)
	return srv
}

func status(ns *netns.NS, path string) int {
	code, _, err := ns.HTTPGet("http://127.0.0.1:8086" + path)
	if err != nil {
		return 0
	}
	return code
}

func waitStatus(t *testing.T, ns *netns.NS, path string, want int, timeout time.Duration, fail func(string, ...any)) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		code := status(ns, path)
		if code == want {
			return
		}
		if time.Now().After(deadline) {
			fail("%s: %d, want %d within %v", path, code, want, timeout)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

var redirects = regexp.MustCompile(`(?m)^stunnerd_xdp_verdicts_total\{reason="relay_client_to_peer_(?:redirect|tx)"\} (\d+)`)

// verdicts sums the client->peer packets the XDP program relayed.
func verdicts(t *testing.T, ns *netns.NS) int {
	t.Helper()
	code, body, err := ns.HTTPGet("http://127.0.0.1:8080/metrics")
	if err != nil || code != 200 {
		t.Fatalf("metrics: %d %v", code, err)
	}
	n := 0
	for _, m := range redirects.FindAllStringSubmatch(body, -1) {
		v, _ := strconv.Atoi(m[1])
		n += v
	}
	return n
}

// client is a pion/turn client in the client namespace with one allocation.
type client struct {
	c     *turn.Client
	relay net.PacketConn
	once  sync.Once
}

func newClient(t *testing.T, ns *netns.NS, port int) *client {
	t.Helper()
	c, err := dial(ns, port)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.close)
	return c
}

func dial(ns *netns.NS, port int) (*client, error) {
	var conn net.PacketConn
	if err := ns.Do(func() (err error) {
		conn, err = net.ListenPacket("udp4", "10.100.0.2:0")
		return err
	}); err != nil {
		return nil, err
	}
	server := netip.AddrPortFrom(serverAddr, uint16(port)).String()
	c, err := turn.NewClient(&turn.ClientConfig{TURNServerAddr: server, STUNServerAddr: server,
		Username: user, Password: password, Realm: stnrv1.DefaultRealm, Conn: conn, RTO: 200 * time.Millisecond})
	if err != nil {
		conn.Close()
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
	return &client{c: c, relay: relay}, nil
}

// waitClient allocates on a listener that a config update is bringing up.
func waitClient(t *testing.T, ns *netns.NS, port int, fail func(string, ...any)) *client {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for {
		c, err := dial(ns, port)
		if err == nil {
			t.Cleanup(c.close)
			return c
		}
		if time.Now().After(deadline) {
			fail("no allocation on port %d: %v", port, err)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// send writes n datagrams to the peer's port, one at a time, and counts the
// echoes that come back.
func (c *client) send(t *testing.T, port, n int) int {
	t.Helper()
	peer := &net.UDPAddr{IP: peerAddr.AsSlice(), Port: port}
	buf := make([]byte, 1500)
	got := 0
	for i := range n {
		msg := fmt.Sprintf("datagram %d to %d", i, port)
		if _, err := c.relay.WriteTo([]byte(msg), peer); err != nil {
			t.Fatalf("write to %v: %v", peer, err)
		}
		_ = c.relay.SetReadDeadline(time.Now().Add(300 * time.Millisecond))
		for {
			m, from, err := c.relay.ReadFrom(buf)
			if err != nil {
				break
			}
			if from.String() == peer.String() && string(buf[:m]) == msg {
				got++
				break
			}
		}
	}
	return got
}

// echo expects nearly every datagram back (the first few wait for the
// permission and the channel).
func (c *client) echo(t *testing.T, port, n int, fail func(string, ...any)) {
	t.Helper()
	if got := c.send(t, port, n); got < n-3 {
		fail("%d of %d echoes from port %d", got, n, port)
	}
}

// xdpEcho expects the echo peer's traffic on the kernel path within a few
// seconds: the daemon is ready before its program has every table (the
// accepted destinations follow asynchronously), and pion relays meanwhile.
func (c *client) xdpEcho(t *testing.T, ns *netns.NS, fail func(string, ...any)) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		before := verdicts(t, ns)
		c.echo(t, echoPort, 20, fail)
		if got := verdicts(t, ns) - before; got >= 15 {
			return
		}
		if time.Now().After(deadline) {
			_, m, _ := ns.HTTPGet("http://127.0.0.1:8080/metrics")
			fail("the echo peer's traffic is not on the kernel path\n%s", grepXDP(m))
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func (c *client) close() {
	c.once.Do(func() {
		c.relay.Close()
		c.c.Close()
	})
}

// grepXDP keeps the stunnerd_xdp_ lines of a scrape, for failure messages.
func grepXDP(body string) string {
	var out []string
	for _, l := range strings.Split(body, "\n") {
		if strings.HasPrefix(l, "stunnerd_xdp_") {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}
