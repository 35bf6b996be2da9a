package daemon

import (
	"context"
	"fmt"
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

	"github.com/l7mp/stunnerd-xdp/internal/channelmap"
	"github.com/l7mp/stunnerd-xdp/internal/config"
	"github.com/l7mp/stunnerd-xdp/internal/destinations"
	"github.com/l7mp/stunnerd-xdp/internal/loader"
	"github.com/l7mp/stunnerd-xdp/internal/logging"
	"github.com/l7mp/stunnerd-xdp/internal/testenv"
	"github.com/l7mp/stunnerd-xdp/test/netns"
)

// envVIPRig names the client and peer namespaces for a test's child in the
// server namespace of a VIP rig.
const envVIPRig = "STUNNERD_XDP_TEST_VIP_RIG"

var (
	vip       = netip.MustParseAddr("192.0.2.10")
	srvClient = netip.MustParseAddr("10.100.0.1") // the rig's srv0
	srvPeer   = netip.MustParseAddr("10.200.0.1") // the rig's srv1
)

// inVIPRig runs body inside the server namespace of a routed rig that looks
// like a node behind a load balancer: a default route, and vip:3478 and
// vip:3479 DNATed to srv0's address by iptables (as kube-proxy does for a
// Service's external IP).
func inVIPRig(t *testing.T, body func(t *testing.T, client, peer *netns.NS)) {
	if !testenv.InNetns() {
		netns.RequirePrivileged(t, "iptables")
		r := netns.NewRouted(t)
		r.Server.IP(t, "route", "add", "default", "via", r.PeerIf.Addr.String())
		r.Client.IP(t, "route", "add", vip.String()+"/32", "via", r.ServerClientIf.Addr.String())
		for _, port := range []string{"3478", "3479"} {
			r.Server.Run(t, "iptables", "-t", "nat", "-A", "PREROUTING", "-d", vip.String(), "-p", "udp",
				"--dport", port, "-j", "DNAT", "--to-destination", r.ServerClientIf.Addr.String()+":"+port)
		}
		testenv.RunInNetns(t, r.Server.Name, 2*time.Minute, envVIPRig+"="+r.Client.Name+","+r.Peer.Name)
		return
	}
	names := strings.Split(os.Getenv(envVIPRig), ",")
	if len(names) != 2 {
		t.Fatalf("bad %s=%q", envVIPRig, os.Getenv(envVIPRig))
	}
	body(t, &netns.NS{Name: names[0]}, &netns.NS{Name: names[1]})
}

// startInRig starts a daemon on the rig's server with the given UDP
// listeners, relaying from srv1's address, XDP on both interfaces in mode.
func startInRig(t *testing.T, mode loader.Mode, listeners ...Listener) (*Daemon, Config, *testenv.LockedBuffer) {
	t.Helper()
	var logs testenv.LockedBuffer
	lf, err := logging.New("all:INFO,destinations:DEBUG", "text", io.MultiWriter(os.Stderr, &logs))
	if err != nil {
		t.Fatal(err)
	}
	cfg := Config{
		Listeners:    listeners,
		Users:        map[string]string{"u": "p"},
		RelayAddress: srvPeer,
		MinRelayPort: 40000, MaxRelayPort: 40999,
		XDPMode:    mode,
		Interfaces: []string{"srv0", "srv1"},
		Logger:     lf,
	}
	d, err := Start(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	return d, cfg, &logs
}

// TestDaemonLearnsVIPs: a client that allocates through a VIP the node DNATs
// to a listener (kube-proxy, cloud load balancers) teaches the daemon that
// the VIP reaches the listener, for a specific and a wildcard listener; the
// VIP is forgotten with the allocation or when a reload restarts the
// listener, and a reload that removes a listener removes its entries. The
// XDP maps follow.
func TestDaemonLearnsVIPs(t *testing.T) {
	inVIPRig(t, testDaemonLearnsVIPs)
}

func testDaemonLearnsVIPs(t *testing.T, client, _ *netns.NS) {
	spec, wild := netip.AddrPortFrom(srvClient, 3478), netip.MustParseAddrPort("0.0.0.0:3479")
	d, cfg, logs := startInRig(t, loader.ModeNative,
		Listener{Name: "specific", Protocol: config.UDP, Addr: spec},
		Listener{Name: "wildcard", Protocol: config.UDP, Addr: wild})
	static := destinations.Table{
		spec:                                spec,
		netip.AddrPortFrom(srvClient, 3479): wild,
		netip.AddrPortFrom(srvPeer, 3479):   wild,
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
	if strings.Contains(logs.String(), `level=WARN msg="destinations:`) {
		t.Error("the tracker logged a failure")
	}
}

// TestDaemonRelaysThroughVIP: ChannelData a client sends to a VIP the node
// DNATs to a specific or a wildcard listener is relayed to the peer, and the
// peer's answers reach the client from the VIP; with XDP, in the kernel (the
// VIP was learned), and with XDP off, by pion/turn, which is the expectation.
func TestDaemonRelaysThroughVIP(t *testing.T) {
	for _, mode := range []loader.Mode{loader.ModeNative, loader.ModeOff} {
		for _, listen := range []netip.AddrPort{netip.AddrPortFrom(srvClient, 3478), netip.MustParseAddrPort("0.0.0.0:3479")} {
			t.Run(fmt.Sprintf("%s/%v", mode, listen), func(t *testing.T) {
				inVIPRig(t, func(t *testing.T, client, peer *netns.NS) {
					testDaemonRelaysThroughVIP(t, mode, listen, client, peer)
				})
			})
		}
	}
}

func testDaemonRelaysThroughVIP(t *testing.T, mode loader.Mode, listen netip.AddrPort, client, peer *netns.NS) {
	echo := netip.MustParseAddrPort("10.200.0.2:5001") // the rig's peer0
	peer.ServeUDPEcho(t, echo)
	d, _, _ := startInRig(t, mode, Listener{Name: "udp", Protocol: config.UDP, Addr: listen})
	relay := allocateFrom(t, client, netip.AddrPortFrom(vip, listen.Port()))

	// A datagram every 5ms for a second; pion/turn's client sends the first
	// ones in Send indications, the rest as ChannelData once it has bound a
	// channel.
	const count = 200
	received := make(chan int)
	go func() {
		n := 0
		buf := make([]byte, 1500)
		_ = relay.SetReadDeadline(time.Now().Add(count*5*time.Millisecond + 3*time.Second))
		for n < count {
			if _, _, err := relay.ReadFrom(buf); err != nil {
				break
			}
			n++
		}
		received <- n
	}()
	to := net.UDPAddrFromAddrPort(echo)
	for i := range count {
		if _, err := relay.WriteTo([]byte(fmt.Sprintf("datagram %d", i)), to); err != nil {
			t.Fatal(err)
		}
		time.Sleep(5 * time.Millisecond)
	}
	n := <-received
	var kernel channelmap.Stats
	if m := d.Maps(); m != nil {
		var err error
		if kernel, err = m.Totals(); err != nil {
			t.Fatal(err)
		}
	}
	t.Logf("%d of %d echoes; the kernel relayed %d to the peer and %d back", n, count,
		kernel.ClientToPeerPackets, kernel.PeerToClientPackets)
	if n < count*9/10 {
		t.Errorf("%d of %d echoes came back", n, count)
	}
	switch mode {
	case loader.ModeOff:
		if kernel.ClientToPeerPackets+kernel.PeerToClientPackets != 0 {
			t.Errorf("XDP off, but the kernel relayed: %+v", kernel)
		}
	default:
		if kernel.ClientToPeerPackets < count/2 || kernel.PeerToClientPackets < count/2 {
			t.Errorf("the kernel relayed %+v of %d each way: the VIP's traffic stayed in userspace", kernel, count)
		}
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
