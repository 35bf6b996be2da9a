package daemon

import (
	"context"
	"encoding/binary"
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

	"github.com/l7mp/stunnerd-xdp/bpf"
	"github.com/l7mp/stunnerd-xdp/internal/channelmap"
	"github.com/l7mp/stunnerd-xdp/internal/config"
	"github.com/l7mp/stunnerd-xdp/internal/destinations"
	"github.com/l7mp/stunnerd-xdp/internal/loader"
	"github.com/l7mp/stunnerd-xdp/internal/logging"
	"github.com/l7mp/stunnerd-xdp/test/netns"
	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// envVIPRig names the client and peer namespaces for a test's child in the
// server namespace of a VIP rig.
const envVIPRig = "STUNNERD_XDP_TEST_VIP_RIG"

var (
	vip       = netip.MustParseAddr("192.0.2.10")
	transit   = netip.MustParseAddr("198.51.100.7") // beyond the node, down its default route
	srvClient = netip.MustParseAddr("10.100.0.1")   // the rig's srv0
	srvPeer   = netip.MustParseAddr("10.200.0.1")   // the rig's srv1
)

// inVIPRig runs body inside the server namespace of a routed rig that looks
// like a node behind a load balancer: a default route, and vip:3478 and
// vip:3479 DNATed to srv0's address by iptables (as kube-proxy does for a
// Service's external IP). The client reaches the VIP and the transit address
// through the server.
func inVIPRig(t *testing.T, body func(t *testing.T, client, peer *netns.NS)) {
	if !testenv.InNetns() {
		netns.RequirePrivileged(t, "iptables")
		r := netns.NewRouted(t)
		r.Client.IP(t, "route", "add", vip.String()+"/32", "via", r.ServerClientIf.Addr.String())
		r.Client.IP(t, "route", "add", transit.String()+"/32", "via", r.ServerClientIf.Addr.String())
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
func startInRig(t *testing.T, mode loader.Mode, listeners ...config.ResolvedListener) (*Daemon, Config, *testenv.LockedBuffer) {
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
		MinRelayPort: 64000, MaxRelayPort: 64999,
		// The rig's peer0, in a private network the defaults refuse.
		AllowPeers: []netip.Prefix{netip.MustParsePrefix("10.200.0.2/32")},
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
		config.ResolvedListener{Name: "specific", Protocol: config.UDP, Addr: spec},
		config.ResolvedListener{Name: "wildcard", Protocol: config.UDP, Addr: wild})
	static := destinations.Table{
		spec:                                spec,
		netip.AddrPortFrom(srvClient, 3479): wild,
		netip.AddrPortFrom(srvPeer, 3479):   wild,
	}
	waitDestinations(t, d, "start", static)

	vipSpec, vipWild := netip.AddrPortFrom(vip, spec.Port()), netip.AddrPortFrom(vip, wild.Port())
	allocateFrom(t, client, vipSpec)
	relayWild, _ := allocateFrom(t, client, vipWild)
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
	d, _, _ := startInRig(t, mode, config.ResolvedListener{Name: "udp", Protocol: config.UDP, Addr: listen})
	relay, _ := allocateFrom(t, client, netip.AddrPortFrom(vip, listen.Port()))

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

// TestDaemonForwardsTransit: ChannelData from a bound client to an address
// beyond the node is transit traffic: the node forwards it down its default
// route (where nobody owns the address), pion/turn never sees it, so nothing
// reaches the peer, and the reply source stays the listener's address. With
// XDP the program passes it (pass_not_listener_address) to the same kernel;
// with XDP off that is the expectation.
func TestDaemonForwardsTransit(t *testing.T) {
	for _, mode := range []loader.Mode{loader.ModeNative, loader.ModeOff} {
		t.Run(string(mode), func(t *testing.T) {
			inVIPRig(t, func(t *testing.T, client, peer *netns.NS) { testDaemonForwardsTransit(t, mode, client, peer) })
		})
	}
}

func testDaemonForwardsTransit(t *testing.T, mode loader.Mode, client, peer *netns.NS) {
	listen := netip.MustParseAddrPort("0.0.0.0:3478")
	server := netip.AddrPortFrom(srvClient, listen.Port())
	echo := netip.MustParseAddrPort("10.200.0.2:5001") // the rig's peer0
	peer.ServeUDPEcho(t, echo)
	d, _, _ := startInRig(t, mode, config.ResolvedListener{Name: "udp", Protocol: config.UDP, Addr: listen})
	relay, conn := allocateFrom(t, client, server)
	echoes := make(chan string, 100)
	go func() {
		buf := make([]byte, 1500)
		for {
			n, _, err := relay.ReadFrom(buf)
			if err != nil {
				close(echoes)
				return
			}
			echoes <- string(buf[:n])
		}
	}()
	// Until pion/turn's client has bound its first channel (0x4000) and the
	// echoes come back as ChannelData.
	to := net.UDPAddrFromAddrPort(echo)
	bound := wait.PollUntilContextTimeout(context.Background(), 50*time.Millisecond, 10*time.Second, true,
		func(context.Context) (bool, error) {
			if _, err := relay.WriteTo([]byte("bound?"), to); err != nil {
				return false, err
			}
			m := d.Maps()
			if m == nil || mode == loader.ModeOff {
				return len(echoes) > 3, nil
			}
			dump, err := m.Dump()
			for _, b := range dump {
				if b.Channel == 0x4000 && b.ReplySource.IsValid() {
					return true, err
				}
			}
			return false, err
		})
	if bound != nil {
		t.Fatalf("no channel bound: %v", bound)
	}
	verdicts := func() (notListener, c2p uint64) {
		m := d.Maps()
		if m == nil {
			return 0, 0
		}
		v, err := m.Verdicts()
		if err != nil {
			t.Fatal(err)
		}
		return v[bpf.RelayReasonREASON_NOT_LISTENER_ADDR], v[bpf.RelayReasonREASON_RELAY_C2P_TX] + v[bpf.RelayReasonREASON_RELAY_C2P_REDIRECT]
	}
	notListener0, c2p0 := verdicts()

	// ChannelData on the bound channel, from the client's own socket, to the
	// transit address at the listener port.
	const count = 20
	for i := range count {
		payload := fmt.Sprintf("transit %d", i)
		msg := binary.BigEndian.AppendUint16(binary.BigEndian.AppendUint16(nil, 0x4000), uint16(len(payload)))
		msg = append(msg, payload...)
		for len(msg)%4 != 0 {
			msg = append(msg, 0)
		}
		if _, err := conn.WriteTo(msg, net.UDPAddrFromAddrPort(netip.AddrPortFrom(transit, listen.Port()))); err != nil {
			t.Fatal(err)
		}
	}
	// A datagram through the listener after them comes back; nothing sent to
	// the transit address may.
	if _, err := relay.WriteTo([]byte("last"), to); err != nil {
		t.Fatal(err)
	}
	deadline := time.After(5 * time.Second)
	for last := false; !last; {
		select {
		case e, ok := <-echoes:
			if !ok {
				t.Fatal("the relay closed")
			}
			if strings.HasPrefix(e, "transit") {
				t.Errorf("ChannelData to the transit address %v reached the peer: %q", transit, e)
			}
			last = e == "last"
		case <-deadline:
			t.Fatal("the echo of the last datagram never came")
		}
	}
	notListener, c2p := verdicts()
	t.Logf("pass_not_listener_address +%d, relayed to peers +%d", notListener-notListener0, c2p-c2p0)
	if mode != loader.ModeOff {
		if notListener-notListener0 != count {
			t.Errorf("pass_not_listener_address counted %d of %d transit datagrams", notListener-notListener0, count)
		}
		dump, err := d.Maps().Dump()
		if err != nil {
			t.Fatal(err)
		}
		for _, b := range dump {
			if b.ReplySource != srvClient {
				t.Errorf("binding %+v: reply source %v, want the listener's %v", b.Key(), b.ReplySource, srvClient)
			}
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
// namespace to server; it returns the relayed connection and the client's
// socket.
func allocateFrom(t *testing.T, client *netns.NS, server netip.AddrPort) (relay, conn net.PacketConn) {
	t.Helper()
	if err := client.Do(func() (err error) { conn, err = net.ListenPacket("udp4", "10.100.0.2:0"); return err }); err != nil {
		t.Fatal(err)
	}
	relay, err := testenv.Allocate(t, &turn.ClientConfig{
		TURNServerAddr: server.String(), STUNServerAddr: server.String(),
		Username: "u", Password: "p", Realm: config.DefaultRealm, Conn: conn,
	})
	if err != nil {
		t.Fatalf("allocate through %v: %v", server, err)
	}
	return relay, conn
}
