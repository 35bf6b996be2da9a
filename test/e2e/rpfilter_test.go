package e2e

import (
	"encoding/binary"
	"fmt"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/pion/turn/v4"

	"github.com/l7mp/stunnerd-xdp/internal/config"
	"github.com/l7mp/stunnerd-xdp/test/netns"
	"github.com/l7mp/stunnerd-xdp/test/packet"
	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// The reverse-path twin test (issue 35): a hardened node (net.ipv4.conf.all.rp_filter=1) with a
// second NIC on another wire, both NICs offloaded. A real session relays through the node; then
// rpForged ChannelData datagrams forged with the bound client's address, port and channel arrive
// at the listener through the second NIC, whose route back to the client leaves through eth0.
// The stack drops them (fib_validate_source: the route back does not use the device), so with
// --xdp-mode=off none reaches the peer; the kernel path must not relay them either, and counts
// what it hands the stack for it as pass_rp_filter. The control: with rp_filter back to 0 the
// same frames do reach the peer in both modes, so the zero is the filter's, not a bad frame's.

const (
	rpForged = 200 // forged datagrams
	rpSlack  = 5   // how many of them the default mode may still relay
	// rpChannel is the bound channel: pion/turn's first channel number, the one binding of the
	// session (its warm-ups go to the same peer).
	rpChannel = 0x4000
	rpTag     = 0x35F0 // the forged datagrams' tag, which the echo peer counts
	rpTagOpen = 0x35F1 // the control's: the same frames with rp_filter off
)

// TestNodeRPFilterTwins runs the reverse-path rows in the default mode and with --xdp-mode=off:
// the forged datagrams through the node's second NIC (XDP's check), and from a Calico pod
// through its host-side veth, whose filter is strict (no address on it), where the TC engine
// meets them (the TC engine's check).
func TestNodeRPFilterTwins(t *testing.T) {
	if testenv.InNetns() {
		t.Skip("parent-only test")
	}
	netns.RequirePrivileged(t, "iptables", "conntrack", "ethtool", "sysctl")
	for _, via := range []string{"second-nic", "pod"} {
		t.Run(via, func(t *testing.T) {
			for _, mode := range shapeModes {
				t.Run(mode, func(t *testing.T) { runRPFilter(t, mode, via) })
			}
		})
	}
}

func runRPFilter(t *testing.T, mode, via string) {
	var r *netns.NodeRig
	var offload []string
	if via == "pod" {
		r = netns.NewNode(t, netns.CalicoPod)
	} else {
		r = netns.NewNode(t, netns.RemoteHost, netns.WithSecondNIC())
		offload = []string{r.NIC, r.NIC2}
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("drops and errors the kernel counted:\n%s", r.DropCounters())
		}
	})
	if err := r.LooksLikeANode(); err != nil {
		t.Fatal(err)
	}
	// A hardened node: strict reverse-path filtering on every device (conf.all; the devices keep
	// their 0, and the larger value counts).
	r.Node.Run(t, "sysctl", "-q", "-w", "net.ipv4.conf.all.rp_filter=1")
	r.StartDaemon(t, netns.DaemonOptions{Binary: netns.RequireBinary(t, netns.Daemon), SteeringDir: testenv.BPFFS(t),
		Off: mode == "off", OffloadInterfaces: offload, User: user, Password: password})
	peerAddr := netip.AddrPortFrom(r.PeerIP, 5002)
	peer := startPeer(t, r.Peer, peerAddr.String(), true, 0)
	cfg := &turn.ClientConfig{TURNServerAddr: r.ListenAddr().String(), Username: user, Password: password, Realm: config.DefaultRealm}
	relay, err := r.Client.Allocate(t, "udp4", netip.AddrPortFrom(r.ClientIP, 0).String(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	client := cfg.Conn.LocalAddr().(*net.UDPAddr).AddrPort()
	client = netip.AddrPortFrom(client.Addr().Unmap(), client.Port())

	// The real session: bound, settled, and (default mode) relayed in the kernel both ways.
	warm := &taggedSession{peer: net.UDPAddrFromAddrPort(peerAddr), limit: 10}
	warm.run(t, relay, 0x5B, 50, time.Second)
	waitFor(t, "the channel binding, settled on a path", 10*time.Second, func() bool {
		m, err := r.Node.Scrape(r.MetricsURL())
		return err == nil && m.Settled(mode == "off")
	})
	if mode != "off" {
		warmUntilKernel(t, r, relay, peerAddr, shapeCase{engagesC2P: true, engagesP2C: true})
	}
	node := r.NodeIP.String()
	before := scrapeAt(t, r.Node, node)
	s := &taggedSession{peer: net.UDPAddrFromAddrPort(peerAddr), limit: 500}
	s.run(t, relay, 0x35B, 500, 2*time.Second)
	checkSession(t, "the real session", s)
	mid := scrapeAt(t, r.Node, node)
	if mode != "off" {
		for i, dir := range []string{"client_to_peer", "peer_to_client"} {
			sh := kernelShare(t, before, mid, dir)
			t.Logf("the real session's %s: %.1f%% in the kernel", dir, 100*sh)
			if sh < 0.9 {
				t.Errorf("%s of the real session: the kernel relayed %.1f%%, want at least 90%%: the forged datagrams below must meet a binding in the kernel's maps",
					[]string{"client->peer", "peer->client"}[i], 100*sh)
			}
		}
	}

	// The forged datagrams, from the second NIC's wire.
	const rpDrops = "TcpExt.IPReversePathFilter"
	stackBefore := r.Node.Netstat(t)[rpDrops]
	from := forgedFrom(t, r, via)
	from.send(t, client, rpTag)
	// What is relayed arrives within milliseconds; a second (scaled) is plenty.
	time.Sleep(testenv.Timeout(time.Second))
	after := scrapeAt(t, r.Node, node)
	reached := peer.got(rpTag)
	stackDropped := r.Node.Netstat(t)[rpDrops] - stackBefore
	rp := after[verdict("pass_rp_filter")] - mid[verdict("pass_rp_filter")]
	rpTC := after[tcVerdict("pass_rp_filter")] - mid[tcVerdict("pass_rp_filter")]
	t.Logf("%s: %d of %d forged datagrams from %v via %s reached the peer; pass_rp_filter grew by %.0f (XDP) and %.0f (TC); the stack's rp_filter dropped %d (%s)",
		mode, reached, rpForged, client, from.nodeIf, rp, rpTC, stackDropped, rpDrops)
	defer func() {
		// The control: without the filter the stack takes the same frames (and pion relays them).
		r.Node.Run(t, "sysctl", "-q", "-w", "net.ipv4.conf.all.rp_filter=0")
		from.send(t, client, rpTagOpen)
		waitFor(t, "the forged frames relayed with rp_filter=0 (the control: the frames are well-formed)", 5*time.Second, func() bool {
			return float64(peer.got(rpTagOpen)) >= 0.99*rpForged
		})
	}()
	if mode == "off" {
		if reached != 0 {
			t.Errorf("with --xdp-mode=off %d of %d forged datagrams reached the peer, want 0: the stack's strict rp_filter drops them; the rig does not test what it claims",
				reached, rpForged)
		}
		if stackDropped < rpForged {
			t.Errorf("with --xdp-mode=off the stack's reverse-path filter dropped %d (%s), want all %d forged datagrams: something else dropped them",
				stackDropped, rpDrops, rpForged)
		}
		return
	}
	if reached > rpSlack {
		t.Errorf("the kernel path relayed %d of %d forged datagrams to the peer, want at most %d: its --xdp-mode=off twin (the stack with rp_filter=1) relays none",
			reached, rpForged, rpSlack)
	}
	if got := rp + rpTC; got < rpForged-rpSlack {
		t.Errorf("pass_rp_filter grew by %.0f (XDP %.0f, TC %.0f), want about %d: the kernel path must hand the stack every forged datagram for the reverse-path check",
			got, rp, rpTC, rpForged)
	}
}

// tcVerdict is the TC engine's verdicts_total sample of one reason.
func tcVerdict(reason string) string {
	return fmt.Sprintf(`stunnerd_xdp_tc_verdicts_total{reason=%q}`, reason)
}

// forger sends frames into one of the node's devices from the other end of its link.
type forger struct {
	ns     *netns.NS // where the frames are sent from
	ifName string    // out of this device of ns
	nodeIf string    // into this device of the node
	dstMAC net.HardwareAddr
	dst    netip.AddrPort // the listener
}

// forgedFrom is the forger of the row: Wire2's eth0 into the node's second NIC, or the pod's
// eth0 into its host-side veth.
func forgedFrom(t *testing.T, r *netns.NodeRig, via string) forger {
	t.Helper()
	f := forger{ns: r.Wire2, ifName: "eth0", nodeIf: r.NIC2, dst: r.ListenAddr()}
	if via == "pod" {
		f.ns, f.nodeIf = r.Pod, r.EgressIf
	}
	if err := r.Node.Do(func() error {
		nic, err := net.InterfaceByName(f.nodeIf)
		if err == nil {
			f.dstMAC = nic.HardwareAddr
		}
		return err
	}); err != nil {
		t.Fatal(err)
	}
	return f
}

// send sends rpForged Ethernet frames: IPv4 and UDP from the client's address and port to the
// listener, checksums correct, carrying ChannelData on the bound channel with the tag and a
// sequence number, a millisecond apart.
func (g forger) send(t *testing.T, client netip.AddrPort, tag uint64) {
	t.Helper()
	err := g.ns.Do(func() error {
		raw, err := testenv.OpenRaw(g.ifName)
		if err != nil {
			return err
		}
		defer raw.Close()
		f := packet.Frame{TTL: 64, Src: client, Dst: g.dst}
		copy(f.DstMAC[:], g.dstMAC)
		copy(f.SrcMAC[:], raw.MAC())
		data := make([]byte, 16)
		binary.BigEndian.PutUint64(data, tag)
		for i := range rpForged {
			binary.BigEndian.PutUint64(data[8:], uint64(i))
			f.ID = uint16(i)
			f.Payload = packet.ChannelData(rpChannel, data, nil)
			if err := raw.Send(f.Marshal()); err != nil {
				return fmt.Errorf("forged frame %d: %w", i, err)
			}
			time.Sleep(time.Millisecond)
		}
		return nil
	})
	if err != nil {
		t.Fatalf("netns %s: forged frames: %v", g.ns.Name, err)
	}
}
