package netns_test

import (
	"fmt"
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/l7mp/stunnerd-xdp/test/netns"
)

// TestNodeShapes builds every node shape and checks what makes it one: it looks like a node
// (LooksLikeANode), the node's own socket on NodeIP reaches the peer and gets its echo, the
// client reaches the listener port through ListenAddr, the client cannot reach the peer, and the
// shape's own markers are there (the egress device the node routes the peer through; flannel's
// masquerade rewriting the node's packets to the pod).
func TestNodeShapes(t *testing.T) {
	netns.RequirePrivileged(t, "iptables", "conntrack", "bridge", "ethtool")
	for _, shape := range append(netns.Shapes(), netns.TunnelShapes()...) {
		t.Run(string(shape), func(t *testing.T) {
			r := netns.NewNode(t, shape)
			if err := r.LooksLikeANode(); err != nil {
				t.Fatal(err)
			}
			peer := netip.AddrPortFrom(r.PeerIP, 5002)
			r.Peer.ServeUDPEcho(t, peer)
			if got := r.Node.IP(t, "route", "get", r.PeerIP.String(), "from", r.NodeIP.String()); !strings.Contains(got, "dev "+r.EgressIf+" ") {
				t.Errorf("the node routes the peer %v as %q, want it through %s", r.PeerIP, got, r.EgressIf)
			}

			// The node's socket on its IP, as a relay socket: the echo comes back.
			from := udpExchange(t, r.Node, netip.AddrPortFrom(r.NodeIP, 0), peer)
			if from != peer {
				t.Errorf("the node's datagram to the peer was answered from %v, want %v", from, peer)
			}
			// The node's conntrack has the flow when a rule made it track: its reply tuple goes to
			// 10.244.0.0 when flannel's rules masqueraded it (Calico's, to tunl0's or
			// wireguard.cali's 10.244.0.0, likewise).
			seen := r.Node.Run(t, "conntrack", "-L", "-p", "udp", "-d", r.PeerIP.String())
			masqueraded := strings.Contains(seen, "dst=10.244.0.0 ")
			if want := shape == netns.VXLANMasq || shape == netns.CalicoIPIP || shape == netns.WireGuard; masqueraded != want {
				t.Errorf("the peer saw the node's datagram masqueraded to the tunnel's 10.244.0.0: %v, want %v", masqueraded, want)
			}

			// The client reaches a socket on the listener port through ListenAddr.
			listener := netip.AddrPortFrom(r.NodeIP, 3478)
			r.Node.ServeUDPEcho(t, listener)
			if from := udpExchange(t, r.Client, netip.AddrPortFrom(r.ClientIP, 0), r.ListenAddr()); from != r.ListenAddr() {
				t.Errorf("the listener answered the client from %v, want %v", from, r.ListenAddr())
			}
			// Only a relay connects the client and a pod or the macvlan NIC's host; a hostNetwork peer is on
			// the client's LAN.
			if err := r.Client.Do(func() error {
				c, err := net.DialUDP("udp4", nil, net.UDPAddrFromAddrPort(peer))
				if err == nil {
					c.Close()
				}
				return err
			}); err == nil && r.Peer != r.Node2 {
				t.Errorf("the client has a route to the peer %v", peer)
			}
		})
	}
}

// udpExchange sends a datagram from a socket bound to local in n to to and returns where the
// answer came from.
func udpExchange(t *testing.T, n *netns.NS, local, to netip.AddrPort) netip.AddrPort {
	t.Helper()
	var c *net.UDPConn
	if err := n.Do(func() (err error) {
		c, err = net.ListenUDP("udp4", net.UDPAddrFromAddrPort(local))
		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	buf := make([]byte, 64)
	for try := 0; try < 3; try++ { // the first may wait for ARP
		if _, err := c.WriteToUDPAddrPort([]byte(fmt.Sprint("probe ", try)), to); err != nil {
			t.Fatalf("netns %s: to %v: %v", n.Name, to, err)
		}
		_ = c.SetReadDeadline(time.Now().Add(time.Second))
		if _, from, err := c.ReadFromUDPAddrPort(buf); err == nil {
			return netip.AddrPortFrom(from.Addr().Unmap(), from.Port())
		}
	}
	t.Fatalf("netns %s: no answer from %v", n.Name, to)
	return netip.AddrPort{}
}
