package daemon

import (
	"context"
	"io"
	"maps"
	"net"
	"net/netip"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/pion/turn/v4"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/l7mp/stunnerd-xdp/internal/config"
	"github.com/l7mp/stunnerd-xdp/internal/destinations"
	"github.com/l7mp/stunnerd-xdp/internal/loader"
	"github.com/l7mp/stunnerd-xdp/internal/logging"
	"github.com/l7mp/stunnerd-xdp/internal/testenv"
	"github.com/l7mp/stunnerd-xdp/test/netns"
)

// envClientNS names the client namespace for the child of TestDaemonLearnsVIPs.
const envClientNS = "STUNNERD_XDP_TEST_CLIENT_NS"

var vip = netip.MustParseAddr("192.0.2.10")

// TestDaemonLearnsVIPs: a client that allocates through a VIP the node DNATs
// to a listener (kube-proxy, cloud load balancers) teaches the daemon that
// the VIP reaches the listener, for a specific and a wildcard listener; the
// VIP is forgotten with the allocation or when a reload restarts the
// listener, and a reload that removes a listener removes its entries.
func TestDaemonLearnsVIPs(t *testing.T) {
	if !testenv.InNetns() {
		netns.RequirePrivileged(t, "iptables")
		r := netns.NewRouted(t)
		// Like a node: a default route, and the NAT rules in the server.
		r.Server.IP(t, "route", "add", "default", "via", r.PeerIf.Addr.String())
		r.Client.IP(t, "route", "add", vip.String()+"/32", "via", r.ServerClientIf.Addr.String())
		for _, port := range []string{"3478", "3479"} {
			r.Server.Run(t, "iptables", "-t", "nat", "-A", "PREROUTING", "-d", vip.String(), "-p", "udp",
				"--dport", port, "-j", "DNAT", "--to-destination", r.ServerClientIf.Addr.String()+":"+port)
		}
		testenv.RunInNetns(t, r.Server.Name, 2*time.Minute, envClientNS+"="+r.Client.Name)
		return
	}
	client := &netns.NS{Name: os.Getenv(envClientNS)}
	server := netip.MustParseAddr("10.100.0.1") // the rig's srv0
	spec, wild := netip.AddrPortFrom(server, 3478), netip.MustParseAddrPort("0.0.0.0:3479")
	var logs testenv.LockedBuffer
	lf, err := logging.New("all:INFO,destinations:DEBUG", "text", io.MultiWriter(os.Stderr, &logs))
	if err != nil {
		t.Fatal(err)
	}
	cfg := Config{
		Listeners: []Listener{
			{Name: "specific", Protocol: config.UDP, Addr: spec},
			{Name: "wildcard", Protocol: config.UDP, Addr: wild},
		},
		Users:        map[string]string{"u": "p"},
		RelayAddress: server,
		MinRelayPort: 40000, MaxRelayPort: 40999,
		XDPMode:    loader.ModeNative,
		Interfaces: []string{"srv0", "srv1"},
		Logger:     lf,
	}
	d, err := Start(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	static := destinations.Table{
		spec: spec,
		netip.MustParseAddrPort("10.100.0.1:3479"): wild,
		netip.MustParseAddrPort("10.200.0.1:3479"): wild,
	}
	waitDestinations(t, d, "start", static)

	vipSpec, vipWild := netip.AddrPortFrom(vip, spec.Port()), netip.AddrPortFrom(vip, wild.Port())
	allocateFrom(t, client, vipSpec)
	relayWild := allocateFrom(t, client, vipWild)
	allocateFrom(t, client, spec) // straight to the listener: nothing to learn
	learned := maps.Clone(static)
	learned[vipSpec], learned[vipWild] = spec, wild
	waitDestinations(t, d, "allocations through the VIP", learned)

	// The client deallocates (Refresh with lifetime 0).
	if err := relayWild.Close(); err != nil {
		t.Fatal(err)
	}
	delete(learned, vipWild)
	waitDestinations(t, d, "the wildcard's allocation through the VIP gone", learned)

	// A new realm restarts the listeners on the same sockets, closing their
	// allocations.
	cfg.Realm = "another.realm"
	if err := d.Reconfigure(cfg); err != nil {
		t.Fatal(err)
	}
	waitDestinations(t, d, "the listeners restarted", static)

	// A reload without the specific listener.
	cfg.Listeners = cfg.Listeners[1:]
	if err := d.Reconfigure(cfg); err != nil {
		t.Fatal(err)
	}
	delete(static, spec)
	waitDestinations(t, d, "the specific listener removed", static)
	d.Close()
	if strings.Contains(logs.String(), "scope=destinations") && strings.Contains(logs.String(), "level=WARN msg=\"destinations:") {
		t.Error("the tracker logged a failure")
	}
}

// waitDestinations waits until the daemon's table and the XDP program's are
// want.
func waitDestinations(t *testing.T, d *Daemon, what string, want destinations.Table) {
	t.Helper()
	var inMaps map[netip.AddrPort]netip.AddrPort
	err := wait.PollUntilContextTimeout(context.Background(), 20*time.Millisecond, 5*time.Second, true,
		func(context.Context) (bool, error) {
			var err error
			if inMaps, err = d.Maps().Destinations(); err != nil {
				return false, err
			}
			return maps.Equal(d.Destinations(), want) && maps.Equal(inMaps, want), nil
		})
	if err != nil {
		t.Fatalf("%s: %v: destinations %v, in the maps %v, want %v", what, err, d.Destinations(), inMaps, want)
	}
}

// allocateFrom makes a pion/turn allocation from a socket in the client
// namespace to server.
func allocateFrom(t *testing.T, client *netns.NS, server netip.AddrPort) net.PacketConn {
	t.Helper()
	var conn net.PacketConn
	if err := client.Do(func() (err error) { conn, err = net.ListenPacket("udp4", "10.100.0.2:0"); return err }); err != nil {
		t.Fatal(err)
	}
	relay, err := testenv.Allocate(t, &turn.ClientConfig{
		TURNServerAddr: server.String(), STUNServerAddr: server.String(),
		Username: "u", Password: "p", Realm: DefaultRealm, Conn: conn,
	})
	if err != nil {
		t.Fatalf("allocate through %v: %v", server, err)
	}
	return relay
}
