package e2e

import (
	"encoding/binary"
	"fmt"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/pion/turn/v4"
	"golang.org/x/sys/unix"

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

// TestNodeRPFilterTwins runs the reverse-path row in the default mode and with --xdp-mode=off.
func TestNodeRPFilterTwins(t *testing.T) {
	if testenv.InNetns() {
		t.Skip("parent-only test")
	}
	netns.RequirePrivileged(t, "iptables", "conntrack", "ethtool", "sysctl")
	for _, mode := range shapeModes {
		t.Run(mode, func(t *testing.T) { runRPFilter(t, mode) })
	}
}

func runRPFilter(t *testing.T, mode string) {
	r := netns.NewNode(t, netns.RemoteHost, netns.WithSecondNIC())
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
		Off: mode == "off", OffloadInterfaces: []string{r.NIC, r.NIC2}, User: user, Password: password})
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
	sendForged(t, r, client, rpTag)
	// What is relayed arrives within milliseconds; a second (scaled) is plenty.
	time.Sleep(testenv.Timeout(time.Second))
	after := scrapeAt(t, r.Node, node)
	reached := peer.got(rpTag)
	stackDropped := r.Node.Netstat(t)[rpDrops] - stackBefore
	rp := after[verdict("pass_rp_filter")] - mid[verdict("pass_rp_filter")]
	rpTC := after[tcVerdict("pass_rp_filter")] - mid[tcVerdict("pass_rp_filter")]
	t.Logf("%s: %d of %d forged datagrams from %v via %s reached the peer; pass_rp_filter grew by %.0f (XDP) and %.0f (TC); the stack's rp_filter dropped %d (%s)",
		mode, reached, rpForged, client, r.NIC2, rp, rpTC, stackDropped, rpDrops)
	defer func() {
		// The control: without the filter the stack takes the same frames (and pion relays them).
		r.Node.Run(t, "sysctl", "-q", "-w", "net.ipv4.conf.all.rp_filter=0")
		sendForged(t, r, client, rpTagOpen)
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

// sendForged sends rpForged Ethernet frames out of Wire2's eth0 to the node's second NIC: IPv4
// and UDP from the client's address and port to the listener, checksums correct, carrying
// ChannelData on the bound channel with the tag and a sequence number, a millisecond apart.
func sendForged(t *testing.T, r *netns.NodeRig, client netip.AddrPort, tag uint64) {
	t.Helper()
	var dstMAC net.HardwareAddr
	if err := r.Node.Do(func() error {
		nic, err := net.InterfaceByName(r.NIC2)
		if err == nil {
			dstMAC = nic.HardwareAddr
		}
		return err
	}); err != nil {
		t.Fatal(err)
	}
	err := r.Wire2.Do(func() error {
		wire, err := net.InterfaceByName("eth0")
		if err != nil {
			return err
		}
		// Protocol 0: the socket only sends.
		fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_RAW, 0)
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		f := packet.Frame{TTL: 64, Src: client, Dst: r.ListenAddr()}
		copy(f.DstMAC[:], dstMAC)
		copy(f.SrcMAC[:], wire.HardwareAddr)
		sa := &unix.SockaddrLinklayer{Ifindex: wire.Index, Protocol: htons(unix.ETH_P_IP), Halen: 6}
		copy(sa.Addr[:], dstMAC)
		data := make([]byte, 16)
		binary.BigEndian.PutUint64(data, tag)
		for i := range rpForged {
			binary.BigEndian.PutUint64(data[8:], uint64(i))
			f.ID = uint16(i)
			f.Payload = packet.ChannelData(rpChannel, data, nil)
			if err := unix.Sendto(fd, f.Marshal(), 0, sa); err != nil {
				return fmt.Errorf("forged frame %d: %w", i, err)
			}
			time.Sleep(time.Millisecond)
		}
		return nil
	})
	if err != nil {
		t.Fatalf("netns %s: forged frames: %v", r.Wire2.Name, err)
	}
}

// htons is v in network byte order, as sockaddr_ll's protocol takes it.
func htons(v uint16) uint16 { return binary.NativeEndian.Uint16(binary.BigEndian.AppendUint16(nil, v)) }
