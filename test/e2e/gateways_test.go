package e2e

import (
	"fmt"
	"net"
	"net/netip"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pion/turn/v4"

	"github.com/l7mp/stunnerd-xdp/internal/config"
	"github.com/l7mp/stunnerd-xdp/test/netns"
	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// Several Gateways on one node (issue 25): each Gateway's daemon runs as its
// own pod on the node, with its own listener, metrics and health ports. The
// NIC's XDP hook takes one program: the first daemon's; the others' XDP
// attach fails with EBUSY and their TC engines relay on the NIC instead
// (tcx runs them all, each passing on what is not its own), moving to XDP
// when the hook frees. A Gateway's restart must not cost another Gateway's
// session a datagram, nor its place in the kernel.

// gatewaysRate is what each session sends a second; gatewaysShare the
// kernel's share each Gateway's session must reach, both ways.
const (
	gatewaysRate  = 200
	gatewaysShare = 0.95
)

var twoGateways = []netns.Gateway{
	{Name: "stunner/udp-gateway", ListenPort: 3478, MetricsPort: 8080, HealthPort: 8086},
	{Name: "tenant-b/udp-gateway", ListenPort: 3479, MetricsPort: 8081, HealthPort: 8087},
}

// TestGatewaysShareANode runs two Gateways' daemons on a node shaped like a
// Kubernetes node (the media server is a pod behind a plain veth), each
// relaying a session to its own peer: both in the kernel; then restarts each
// daemon in turn while the other's session flows. With --xdp-mode=off (the
// twin) the same sessions lose nothing in userspace.
func TestGatewaysShareANode(t *testing.T) {
	if testenv.InNetns() {
		t.Skip("parent-only test")
	}
	netns.RequirePrivileged(t, "iptables", "conntrack", "bridge", "ethtool")
	for _, mode := range shapeModes {
		t.Run(mode, func(t *testing.T) { gatewaysShareANode(t, mode == "off") })
	}
}

// gatewaySession is one Gateway's daemon and the client session it relays.
type gatewaySession struct {
	gw    netns.Gateway
	proc  *netns.Proc
	peer  netip.AddrPort
	relay net.PacketConn
	tag   uint64
}

func gatewaysShareANode(t *testing.T, off bool) {
	r := netns.NewNode(t, netns.PodVeth)
	if err := r.LooksLikeANode(); err != nil {
		t.Fatal(err)
	}
	bin, dir := netns.RequireBinary(t, netns.Daemon), testenv.BPFFS(t)
	gs := make([]*gatewaySession, len(twoGateways))
	start := func(g *gatewaySession) {
		// A short drain: the restart is the pod's, not a rollout's.
		g.proc = r.StartDaemon(t, netns.DaemonOptions{Binary: bin, SteeringDir: dir, Off: off,
			User: user, Password: password, Gateway: &g.gw, Args: []string{"--grace-period=1s"}})
	}
	for i, gw := range twoGateways {
		gs[i] = &gatewaySession{gw: gw, peer: netip.AddrPortFrom(r.PeerIP, uint16(5002+i)), tag: uint64(0x6A + i)}
		startPeer(t, r.Peer, gs[i].peer.String(), true, 0)
		start(gs[i])
		// The first daemon takes the NIC's XDP hook; the second's TC
		// engine relays there (another program holds the hook).
		want := []string{"native", "tc"}[i]
		if off {
			want = ""
		}
		waitGatewayAttached(t, r, gs[i].gw, r.NIC, want)
		// STUNner's admin.offload in /status names the engine in use.
		engine := map[string]string{"native": `"offload":"XDP[`, "tc": `"offload":"TC[`, "": `"offload":"None[`}[want]
		if _, body, err := r.Node.HTTPGet(fmt.Sprintf("http://%s:%d/status", r.NodeIP, gs[i].gw.HealthPort)); err != nil || !strings.Contains(body, engine) {
			t.Errorf("%s: /status %v %s, want %s", gs[i].gw.Name, err, body, engine)
		}
		allocateGateway(t, r, gs[i], off)
	}

	t.Logf("both Gateways' sessions at once")
	var wg sync.WaitGroup
	rows := make([]gatewayRow, len(gs))
	for i, g := range gs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rows[i] = runGatewaySession(t, r, g, 3*time.Second)
		}()
	}
	wg.Wait()
	for _, row := range rows {
		row.check(t, off)
	}

	for victim := range gs {
		other := gs[1-victim]
		t.Logf("restarting %s while %s's session flows", gs[victim].gw.Name, other.gw.Name)
		var row gatewayRow
		wg.Add(1)
		go func() {
			defer wg.Done()
			row = runGatewaySession(t, r, other, 8*time.Second)
		}()
		time.Sleep(time.Second)
		if err := gs[victim].proc.Stop(); err != nil {
			t.Logf("%s stopped: %v", gs[victim].gw.Name, err)
		}
		// The survivor takes the hook the victim's program left, if it
		// did not hold it.
		if !off {
			waitGatewayAttached(t, r, other.gw, r.NIC, "native")
		}
		start(gs[victim])
		wg.Wait()
		row.check(t, off)
		// The victim's daemon came back beside the survivor, which holds
		// the hook now: its TC engine relays its new session.
		if !off {
			waitGatewayAttached(t, r, gs[victim].gw, r.NIC, "tc")
		}
		allocateGateway(t, r, gs[victim], off)
		runGatewaySession(t, r, gs[victim], 2*time.Second).check(t, off)
	}
}

// allocateGateway makes the client's allocation on the Gateway and a
// channel binding to its peer, and waits for the binding to settle on a
// path.
func allocateGateway(t *testing.T, r *netns.NodeRig, g *gatewaySession, off bool) {
	t.Helper()
	relay, err := r.Client.Allocate(t, "udp4", netip.AddrPortFrom(r.ClientIP, 0).String(), &turn.ClientConfig{
		TURNServerAddr: netip.AddrPortFrom(r.NodeIP, g.gw.ListenPort).String(), Username: user, Password: password,
		Realm: config.DefaultRealm})
	if err != nil {
		t.Fatalf("%s: %v", g.gw.Name, err)
	}
	g.relay = relay
	warm := &taggedSession{peer: net.UDPAddrFromAddrPort(g.peer), limit: 10}
	warm.run(t, relay, g.tag|0x100, 50, time.Second)
	waitFor(t, g.gw.Name+": the channel binding, settled on a path", 10*time.Second, func() bool {
		m, err := r.Node.Scrape(g.gw.MetricsURL(r))
		return err == nil && m.Settled(off)
	})
}

// waitGatewayAttached waits until the Gateway's daemon reports the mode on the
// interface (stunnerd_xdp_attached); "" waits until it is attached nowhere.
func waitGatewayAttached(t *testing.T, r *netns.NodeRig, gw netns.Gateway, iface, mode string) {
	t.Helper()
	var last map[string]string
	if err := netns.Eventually(10*time.Second, 50*time.Millisecond, func() error {
		m, err := r.Node.Scrape(gw.MetricsURL(r))
		if err != nil {
			return err
		}
		last = attachedModes(m.Samples())
		if mode == "" && len(last) == 0 || mode != "" && last[iface] == mode {
			return nil
		}
		return fmt.Errorf("attached %v", last)
	}); err != nil {
		t.Fatalf("%s: want %s %q: %v", gw.Name, iface, mode, err)
	}
}

// attachedModes reads stunnerd_xdp_attached: the mode per interface.
func attachedModes(s map[string]float64) map[string]string {
	out := map[string]string{}
	for name, v := range s {
		labels, ok := strings.CutPrefix(name, "stunnerd_xdp_attached{")
		if !ok || v != 1 {
			continue
		}
		var iface, mode string
		for _, kv := range strings.Split(strings.TrimSuffix(labels, "}"), ",") {
			k, val, _ := strings.Cut(kv, "=")
			switch val = strings.Trim(val, `"`); k {
			case "iface":
				iface = val
			case "mode":
				mode = val
			}
		}
		out[iface] = mode
	}
	return out
}

// gatewayRow is what one session measured on its Gateway's daemon.
type gatewayRow struct {
	name                  string
	sent, echoed, foreign int64
	kernel, user          [2]float64 // [client->peer, peer->client]
}

// runGatewaySession sends the session's datagrams for d and reads the
// Gateway's counters around it.
func runGatewaySession(t *testing.T, r *netns.NodeRig, g *gatewaySession, d time.Duration) gatewayRow {
	url := g.gw.MetricsURL(r)
	m, err := r.Node.Scrape(url)
	if err != nil {
		t.Errorf("%s: %v", g.gw.Name, err)
		return gatewayRow{name: g.gw.Name}
	}
	before := samples(m.Samples())
	s := &taggedSession{peer: net.UDPAddrFromAddrPort(g.peer)}
	s.run(t, g.relay, g.tag, gatewaysRate, d)
	if m, err = r.Node.Scrape(url); err != nil {
		t.Errorf("%s: %v", g.gw.Name, err)
		return gatewayRow{name: g.gw.Name}
	}
	after := samples(m.Samples())
	row := gatewayRow{name: g.gw.Name, sent: s.sent.Load(), echoed: s.received.Load(), foreign: s.foreign.Load()}
	for i, dir := range []string{"client_to_peer", "peer_to_client"} {
		row.kernel[i] = after.grew(t, before, relayed("xdp", dir))
		row.user[i] = after.grew(t, before, relayed("userspace", dir))
	}
	t.Logf("%s", row)
	return row
}

func (r gatewayRow) share(dir int) float64 {
	if r.kernel[dir]+r.user[dir] == 0 {
		return 0
	}
	return r.kernel[dir] / (r.kernel[dir] + r.user[dir])
}

func (r gatewayRow) String() string {
	return fmt.Sprintf("%-22s echoed %d/%d, foreign %d; in the kernel: client->peer %.1f%% (%.0f/%.0f), peer->client %.1f%% (%.0f/%.0f)",
		r.name, r.echoed, r.sent, r.foreign, 100*r.share(0), r.kernel[0], r.kernel[0]+r.user[0],
		100*r.share(1), r.kernel[1], r.kernel[1]+r.user[1])
}

// check fails the row unless every datagram came back and, but with
// --xdp-mode=off, the kernel relayed at least gatewaysShare of each direction.
func (r gatewayRow) check(t *testing.T, off bool) {
	t.Helper()
	if r.sent == 0 || r.echoed != r.sent || r.foreign != 0 {
		t.Errorf("%s: %d of %d echoes came back, %d foreign", r.name, r.echoed, r.sent, r.foreign)
	}
	for i, dir := range []string{"client->peer", "peer->client"} {
		switch share := r.share(i); {
		case off && r.kernel[i] != 0:
			t.Errorf("%s: with --xdp-mode=off the kernel relayed %.0f %s", r.name, r.kernel[i], dir)
		case !off && share < gatewaysShare:
			t.Errorf("%s: %s %.1f%% in the kernel, want at least %.0f%%", r.name, dir, 100*share, 100*gatewaysShare)
		}
	}
}
