package bpf_test

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"

	"github.com/l7mp/stunnerd-xdp/bpf"
	"github.com/l7mp/stunnerd-xdp/internal/channelmap"
	"github.com/l7mp/stunnerd-xdp/internal/loader"
	"github.com/l7mp/stunnerd-xdp/internal/packet"
	"github.com/l7mp/stunnerd-xdp/internal/testenv"
)

const (
	listenerPort = 3478
	xdpPass      = 2
	xdpTX        = 3
	xdpRedirect  = 4
)

var (
	clientMAC = [6]byte{0x02, 0, 0, 0, 0x10, 0x02}
	peerMAC   = [6]byte{0x02, 0, 0, 0, 0x20, 0x02}
	peer2MAC  = [6]byte{0x02, 0, 0, 0, 0x10, 0x03}
	smallMAC  = [6]byte{0x02, 0, 0, 0, 0x21, 0x02}
	offMAC    = [6]byte{0x02, 0, 0, 0, 0x22, 0x02}
	otherMAC  = [6]byte{0x02, 0, 0, 0, 0x23, 0x02}
)

// link is one server-side interface of the golden environment.
type iface struct {
	name    string
	addr    string // server address, /24
	mtu     int
	fwd     bool
	devmap  bool
	index   int
	mac     [6]byte
	neigh   map[string][6]byte
	unreach string
}

// env is a network namespace whose routing and neighbour tables drive
// bpf_fib_lookup, and the relay program loaded with bindings for every branch.
type env struct {
	ns     *testenv.NSWorker
	prog   *loader.Program
	maps   *channelmap.Maps
	ifaces map[string]*iface
}

func newEnv(t *testing.T) *env {
	t.Helper()
	testenv.RequireRoot(t)
	e := &env{ns: testenv.NewNSWorker(t), ifaces: map[string]*iface{}}
	for _, i := range []*iface{
		{name: "a0", addr: "10.100.0.1", mtu: 1500, fwd: true, devmap: true,
			neigh: map[string][6]byte{"10.100.0.2": clientMAC, "10.100.0.3": peer2MAC}},
		{name: "b0", addr: "10.200.0.1", mtu: 1500, fwd: true, devmap: true,
			neigh: map[string][6]byte{"10.200.0.2": peerMAC}, unreach: "10.250.0.0/24"},
		{name: "c0", addr: "10.201.0.1", mtu: 100, fwd: true, devmap: true,
			neigh: map[string][6]byte{"10.201.0.2": smallMAC}},
		{name: "d0", addr: "10.202.0.1", mtu: 1500, fwd: false, devmap: true,
			neigh: map[string][6]byte{"10.202.0.2": offMAC}},
		{name: "e0", addr: "10.203.0.1", mtu: 1500, fwd: true, devmap: false,
			neigh: map[string][6]byte{"10.203.0.2": otherMAC}},
	} {
		e.ifaces[i.name] = i
	}
	prog, err := loader.Load(loader.Config{
		ListenerPorts: []uint16{listenerPort}, MinRelayPort: 49152, MaxRelayPort: 65535, MaxBindings: 1024,
	}, slog.New(slog.NewTextHandler(os.Stderr, nil)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { prog.Close() })
	e.prog = prog
	e.maps = channelmap.New(prog.Maps())
	if err := e.ns.Do(func() error { return e.setup() }); err != nil {
		t.Fatal(err)
	}
	return e
}

func (e *env) setup() error {
	if err := os.WriteFile("/proc/sys/net/ipv4/conf/all/forwarding", []byte("0"), 0); err != nil {
		return err
	}
	for _, i := range e.ifaces {
		la := netlink.NewLinkAttrs()
		la.Name = i.name
		la.MTU = i.mtu
		if err := netlink.LinkAdd(&netlink.Veth{LinkAttrs: la, PeerName: i.name[:1] + "1"}); err != nil {
			return fmt.Errorf("add veth %s: %w", i.name, err)
		}
		l, err := netlink.LinkByName(i.name)
		if err != nil {
			return err
		}
		p, err := netlink.LinkByName(i.name[:1] + "1")
		if err != nil {
			return err
		}
		addr, _ := netlink.ParseAddr(i.addr + "/24")
		if err := netlink.AddrAdd(l, addr); err != nil {
			return fmt.Errorf("add address to %s: %w", i.name, err)
		}
		for _, up := range []netlink.Link{l, p} {
			if err := netlink.LinkSetUp(up); err != nil {
				return err
			}
		}
		fwd := "0"
		if i.fwd {
			fwd = "1"
		}
		if err := os.WriteFile("/proc/sys/net/ipv4/conf/"+i.name+"/forwarding", []byte(fwd), 0); err != nil {
			return err
		}
		for ip, mac := range i.neigh {
			if err := netlink.NeighAdd(&netlink.Neigh{LinkIndex: l.Attrs().Index, State: netlink.NUD_PERMANENT,
				IP: net.ParseIP(ip), HardwareAddr: net.HardwareAddr(mac[:])}); err != nil {
				return fmt.Errorf("add neighbour %s: %w", ip, err)
			}
		}
		if i.unreach != "" {
			_, dst, _ := net.ParseCIDR(i.unreach)
			if err := netlink.RouteAdd(&netlink.Route{Dst: dst, Type: 7 /* RTN_UNREACHABLE */}); err != nil {
				return fmt.Errorf("add unreachable route: %w", err)
			}
		}
		i.index = l.Attrs().Index
		copy(i.mac[:], l.Attrs().HardwareAddr)
		if i.devmap {
			if err := e.prog.Maps().TxPorts.Put(uint32(i.index), uint32(i.index)); err != nil {
				return fmt.Errorf("devmap %s: %w", i.name, err)
			}
		}
	}
	return nil
}

type xdpMD struct {
	Data, DataEnd, DataMeta, IngressIfindex, RxQueueIndex, EgressIfindex uint32
}

// run runs the program once on frame as if it arrived on the named interface.
func (e *env) run(t *testing.T, ingress string, frame []byte) (uint32, []byte) {
	t.Helper()
	var (
		ret uint32
		out []byte
	)
	err := e.ns.Do(func() error {
		var err error
		ctx := xdpMD{DataEnd: uint32(len(frame)), IngressIfindex: uint32(e.ifaces[ingress].index)}
		buf := make([]byte, len(frame)+512)
		opts := ebpf.RunOptions{Data: frame, DataOut: buf, Context: ctx}
		ret, err = e.prog.XDP().Run(&opts)
		out = opts.DataOut
		return err
	})
	if err != nil {
		t.Fatalf("BPF_PROG_RUN: %v", err)
	}
	return ret, out
}

func ap(s string) netip.AddrPort { return netip.MustParseAddrPort(s) }

// bindings: one per branch of the program, see each comment.
var bindings = map[string]channelmap.Binding{
	// client on a0, peer on b0: redirect both ways.
	"redirect": {Client: ap("10.100.0.2:40000"), ListenerPort: listenerPort, Channel: 0x4000,
		Peer: ap("10.200.0.2:5001"), Relay: ap("10.200.0.1:50000"), ListenerAddr: netip.MustParseAddr("10.100.0.1")},
	// client and peer both behind a0: XDP_TX both ways.
	"tx": {Client: ap("10.100.0.2:40000"), ListenerPort: listenerPort, Channel: 0x4001,
		Peer: ap("10.100.0.3:6000"), Relay: ap("10.100.0.1:50001"), ListenerAddr: netip.MustParseAddr("10.100.0.1")},
	// peer without a neighbour entry.
	"noneigh": {Client: ap("10.100.0.2:40000"), ListenerPort: listenerPort, Channel: 0x4002,
		Peer: ap("10.200.0.9:5001"), Relay: ap("10.200.0.1:50002"), ListenerAddr: netip.MustParseAddr("10.100.0.1")},
	// peer behind c0, MTU 100.
	"smallmtu": {Client: ap("10.100.0.2:40000"), ListenerPort: listenerPort, Channel: 0x4003,
		Peer: ap("10.201.0.2:5001"), Relay: ap("10.201.0.1:50003"), ListenerAddr: netip.MustParseAddr("10.100.0.1")},
	// peer behind an unreachable route.
	"unreachable": {Client: ap("10.100.0.2:40000"), ListenerPort: listenerPort, Channel: 0x4004,
		Peer: ap("10.250.0.2:5001"), Relay: ap("10.200.0.1:50004"), ListenerAddr: netip.MustParseAddr("10.100.0.1")},
	// peer behind e0, which is not in the devmap.
	"notattached": {Client: ap("10.100.0.2:40000"), ListenerPort: listenerPort, Channel: 0x4005,
		Peer: ap("10.203.0.2:5001"), Relay: ap("10.203.0.1:50005"), ListenerAddr: netip.MustParseAddr("10.100.0.1")},
	// client behind d0, forwarding off there.
	"fwdoff": {Client: ap("10.202.0.2:40000"), ListenerPort: listenerPort, Channel: 0x4000,
		Peer: ap("10.200.0.2:5002"), Relay: ap("10.200.0.1:50006"), ListenerAddr: netip.MustParseAddr("10.202.0.1")},
	// wildcard listener: the source for the client is learned from its packets.
	"learn": {Client: ap("10.100.0.2:40001"), ListenerPort: listenerPort, Channel: 0x4000,
		Peer: ap("10.200.0.2:5003"), Relay: ap("10.200.0.1:50007")},
	// client behind c0 (MTU 100): the 4 added bytes can push a reply over it.
	"clientsmallmtu": {Client: ap("10.201.0.2:40000"), ListenerPort: listenerPort, Channel: 0x4000,
		Peer: ap("10.200.0.2:5004"), Relay: ap("10.200.0.1:50008"), ListenerAddr: netip.MustParseAddr("10.201.0.1")},
}

func (e *env) install(t *testing.T) {
	t.Helper()
	for name, b := range bindings {
		if err := e.maps.Upsert(b); err != nil {
			t.Fatalf("install %s: %v", name, err)
		}
	}
}

// fromClient is a frame the client sends to the listener; fromPeer one the peer
// sends to the relay address.
func fromClient(b channelmap.Binding, listener string, payload []byte) packet.Frame {
	return packet.Frame{DstMAC: [6]byte{0x02, 0xaa}, SrcMAC: clientMAC, TTL: 63, ID: 0x1234, FragOff: 0x4000,
		TOS: 0xb8, Src: b.Client, Dst: netip.AddrPortFrom(netip.MustParseAddr(listener), b.ListenerPort), Payload: payload}
}

func fromPeer(b channelmap.Binding, payload []byte) packet.Frame {
	return packet.Frame{DstMAC: [6]byte{0x02, 0xbb}, SrcMAC: peerMAC, TTL: 1, ID: 0x4321,
		Src: b.Peer, Dst: b.Relay, Payload: payload}
}

func data(n int) []byte {
	d := make([]byte, n)
	for i := range d {
		d[i] = byte(i*7 + 1)
	}
	return d
}

// toPeer is what the relay must send to the peer for a client frame.
func toPeer(in packet.Frame, b channelmap.Binding, srcMAC, dstMAC [6]byte, d []byte) packet.Frame {
	return packet.Frame{DstMAC: dstMAC, SrcMAC: srcMAC, TTL: 64, ID: in.ID, FragOff: in.FragOff, TOS: in.TOS,
		Src: b.Relay, Dst: b.Peer, Payload: d, NoUDPChecksum: in.NoUDPChecksum}
}

// toClient is what the relay must send to the client for a peer frame.
func toClient(in packet.Frame, b channelmap.Binding, listener netip.Addr, srcMAC, dstMAC [6]byte, d []byte) packet.Frame {
	return packet.Frame{DstMAC: dstMAC, SrcMAC: srcMAC, TTL: 64, ID: in.ID, FragOff: in.FragOff, TOS: in.TOS,
		Src: netip.AddrPortFrom(listener, b.ListenerPort), Dst: b.Client,
		Payload: packet.ChannelData(b.Channel, d, nil), NoUDPChecksum: in.NoUDPChecksum}
}

type golden struct {
	name    string
	ingress string
	in      []byte
	verdict uint32
	reason  bpf.RelayReason
	out     []byte // nil: the input, untouched
}

func TestGoldenPackets(t *testing.T) {
	e := newEnv(t)
	e.install(t)
	a0, b0, c0 := e.ifaces["a0"], e.ifaces["b0"], e.ifaces["c0"]
	redirect, tx := bindings["redirect"], bindings["tx"]

	var cases []golden
	// client->peer: data lengths with every padding, odd and even lengths, and
	// padding bytes that are not zero (they must leave the checksum too).
	for _, n := range []int{0, 1, 2, 3, 4, 5, 99, 100, 1199, 1200} {
		for pad := 0; pad <= 3; pad++ {
			d := data(n)
			padding := bytes.Repeat([]byte{0xA5 + byte(pad)}, pad)
			in := fromClient(redirect, "10.100.0.1", packet.ChannelData(redirect.Channel, d, padding))
			cases = append(cases, golden{
				name: fmt.Sprintf("c2p/redirect/len=%d/pad=%d", n, pad), ingress: "a0", in: in.Marshal(),
				verdict: xdpRedirect, reason: bpf.RelayReasonREASON_RELAY_C2P_REDIRECT,
				out: toPeer(in, redirect, b0.mac, peerMAC, d).Marshal(),
			})
		}
	}
	{
		in := fromClient(redirect, "10.100.0.1", packet.ChannelData(redirect.Channel, data(100), nil))
		in.NoUDPChecksum = true
		cases = append(cases, golden{name: "c2p/redirect/no-udp-checksum", ingress: "a0", in: in.Marshal(),
			verdict: xdpRedirect, reason: bpf.RelayReasonREASON_RELAY_C2P_REDIRECT,
			out: toPeer(in, redirect, b0.mac, peerMAC, data(100)).Marshal()})
	}
	{
		// A short frame padded to Ethernet's 60-byte minimum: the trailer goes.
		in := fromClient(redirect, "10.100.0.1", packet.ChannelData(redirect.Channel, data(5), []byte{0, 0, 0}))
		in.Trailer = make([]byte, 60-(packet.EthLen+packet.IPv4Len+packet.UDPLen+12))
		cases = append(cases, golden{name: "c2p/redirect/ethernet-trailer", ingress: "a0", in: in.Marshal(),
			verdict: xdpRedirect, reason: bpf.RelayReasonREASON_RELAY_C2P_REDIRECT,
			out: toPeer(in, redirect, b0.mac, peerMAC, data(5)).Marshal()})
	}
	for _, n := range []int{1, 100, 1200} {
		in := fromClient(tx, "10.100.0.1", packet.ChannelData(tx.Channel, data(n), nil))
		cases = append(cases, golden{name: fmt.Sprintf("c2p/tx/len=%d", n), ingress: "a0", in: in.Marshal(),
			verdict: xdpTX, reason: bpf.RelayReasonREASON_RELAY_C2P_TX,
			out: toPeer(in, tx, a0.mac, peer2MAC, data(n)).Marshal()})
	}
	// peer->client.
	for _, n := range []int{0, 1, 2, 3, 100, 1199, 1200} {
		in := fromPeer(redirect, data(n))
		cases = append(cases, golden{name: fmt.Sprintf("p2c/redirect/len=%d", n), ingress: "b0", in: in.Marshal(),
			verdict: xdpRedirect, reason: bpf.RelayReasonREASON_RELAY_P2C_REDIRECT,
			out: toClient(in, redirect, redirect.ListenerAddr, a0.mac, clientMAC, data(n)).Marshal()})
	}
	{
		in := fromPeer(redirect, data(33))
		in.NoUDPChecksum = true
		cases = append(cases, golden{name: "p2c/redirect/no-udp-checksum", ingress: "b0", in: in.Marshal(),
			verdict: xdpRedirect, reason: bpf.RelayReasonREASON_RELAY_P2C_REDIRECT,
			out: toClient(in, redirect, redirect.ListenerAddr, a0.mac, clientMAC, data(33)).Marshal()})
		in = fromPeer(redirect, data(3))
		in.Trailer = make([]byte, 60-(packet.EthLen+packet.IPv4Len+packet.UDPLen+3))
		cases = append(cases, golden{name: "p2c/redirect/ethernet-trailer", ingress: "b0", in: in.Marshal(),
			verdict: xdpRedirect, reason: bpf.RelayReasonREASON_RELAY_P2C_REDIRECT,
			out: toClient(in, redirect, redirect.ListenerAddr, a0.mac, clientMAC, data(3)).Marshal()})
	}
	for _, n := range []int{1, 1200} {
		in := fromPeer(tx, data(n))
		in.SrcMAC = peer2MAC
		cases = append(cases, golden{name: fmt.Sprintf("p2c/tx/len=%d", n), ingress: "a0", in: in.Marshal(),
			verdict: xdpTX, reason: bpf.RelayReasonREASON_RELAY_P2C_TX,
			out: toClient(in, tx, tx.ListenerAddr, a0.mac, clientMAC, data(n)).Marshal()})
	}
	// A small result still fits under c0's MTU of 100.
	{
		b := bindings["smallmtu"]
		in := fromClient(b, "10.100.0.1", packet.ChannelData(b.Channel, data(72), nil))
		cases = append(cases, golden{name: "c2p/redirect/fits-small-mtu", ingress: "a0", in: in.Marshal(),
			verdict: xdpRedirect, reason: bpf.RelayReasonREASON_RELAY_C2P_REDIRECT,
			out: toPeer(in, b, c0.mac, smallMAC, data(72)).Marshal()})
	}

	// Everything the program does not own passes untouched.
	pass := func(name, ingress string, in []byte, reason bpf.RelayReason) {
		cases = append(cases, golden{name: "pass/" + name, ingress: ingress, in: in, verdict: xdpPass, reason: reason})
	}
	cd := func(b channelmap.Binding, n int) []byte { return packet.ChannelData(b.Channel, data(n), nil) }
	good := fromClient(redirect, "10.100.0.1", cd(redirect, 100))

	ipv6 := good.Marshal()
	binary.BigEndian.PutUint16(ipv6[12:14], 0x86DD)
	pass("not-ipv4/ethertype-ipv6", "a0", ipv6, bpf.RelayReasonREASON_NOT_IPV4)
	vlan := append(append(append([]byte{}, good.Marshal()[:12]...), 0x81, 0x00, 0x00, 0x64), good.Marshal()[12:]...)
	pass("not-ipv4/vlan-tagged", "a0", vlan, bpf.RelayReasonREASON_NOT_IPV4)

	f := good
	f.Proto = 6
	pass("not-udp/tcp", "a0", f.Marshal(), bpf.RelayReasonREASON_NOT_UDP)
	f = good
	f.Dst = ap("10.100.0.1:3479")
	pass("not-ours/other-port", "a0", f.Marshal(), bpf.RelayReasonREASON_NOT_OURS)
	f = good
	f.Dst = ap("10.200.0.1:49151")
	pass("not-ours/below-relay-range", "b0", f.Marshal(), bpf.RelayReasonREASON_NOT_OURS)

	pass("malformed-ip/truncated-header", "a0", good.Marshal()[:packet.EthLen+19], bpf.RelayReasonREASON_MALFORMED_IP)
	m := good.Marshal()
	m[packet.EthLen] = 0x65 // version 6 under an IPv4 ethertype
	pass("malformed-ip/version", "a0", m, bpf.RelayReasonREASON_MALFORMED_IP)
	m = good.Marshal()
	m[packet.EthLen] = 0x44 // IHL 4
	pass("malformed-ip/ihl-below-5", "a0", m, bpf.RelayReasonREASON_MALFORMED_IP)
	m = good.Marshal()
	binary.BigEndian.PutUint16(m[packet.EthLen+2:], uint16(len(m)-packet.EthLen+1))
	pass("malformed-ip/total-length-beyond-frame", "a0", m, bpf.RelayReasonREASON_MALFORMED_IP)
	m = good.Marshal()
	binary.BigEndian.PutUint16(m[packet.EthLen+2:], 27)
	pass("malformed-ip/total-length-below-udp", "a0", m, bpf.RelayReasonREASON_MALFORMED_IP)
	f = good
	f.Options = []byte{0x01, 0x01, 0x01, 0x00} // NOPs and end of options
	pass("ip-options", "a0", f.Marshal(), bpf.RelayReasonREASON_IP_OPTIONS)
	f = good
	f.FragOff = 0x2000 // MF: first fragment
	pass("ip-fragment/first", "a0", f.Marshal(), bpf.RelayReasonREASON_IP_FRAGMENT)
	f = good
	f.FragOff = 0x0010 // a later fragment
	pass("ip-fragment/later", "a0", f.Marshal(), bpf.RelayReasonREASON_IP_FRAGMENT)

	m = good.Marshal()
	binary.BigEndian.PutUint16(m[packet.EthLen+packet.IPv4Len+4:], uint16(packet.UDPLen+len(good.Payload)-4))
	pass("malformed-udp/length-short", "a0", m, bpf.RelayReasonREASON_MALFORMED_UDP)
	m = good.Marshal()
	binary.BigEndian.PutUint16(m[packet.EthLen+packet.IPv4Len+4:], uint16(packet.UDPLen+len(good.Payload)+4))
	pass("malformed-udp/length-long", "a0", m, bpf.RelayReasonREASON_MALFORMED_UDP)
	m = good.Marshal()
	binary.BigEndian.PutUint16(m[packet.EthLen+2:], packet.IPv4Len+4)
	pass("malformed-ip/total-length-below-udp-header", "a0", m[:packet.EthLen+packet.IPv4Len+4], bpf.RelayReasonREASON_MALFORMED_IP)

	f = good
	f.Payload = []byte{0x00, 0x01, 0x00, 0x00, 0x21, 0x12, 0xA4, 0x42, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12} // Binding request
	pass("stun/binding-request", "a0", f.Marshal(), bpf.RelayReasonREASON_STUN)
	f = good
	f.Payload = []byte{0x80, 0x00, 0x00, 0x00}
	pass("stun/first-bits-10", "a0", f.Marshal(), bpf.RelayReasonREASON_STUN)
	f = good
	f.Payload = []byte{0x40, 0x00, 0x00}
	pass("malformed-channel-data/short", "a0", f.Marshal(), bpf.RelayReasonREASON_MALFORMED_CHANNEL_DATA)
	f = good
	f.Payload = append(packet.ChannelData(redirect.Channel, data(10), nil)[:4], data(9)...)
	pass("malformed-channel-data/length-beyond-payload", "a0", f.Marshal(), bpf.RelayReasonREASON_MALFORMED_CHANNEL_DATA)
	f = good
	f.Payload = packet.ChannelData(redirect.Channel, data(10), []byte{0, 0, 0, 0})
	pass("malformed-channel-data/padding-4", "a0", f.Marshal(), bpf.RelayReasonREASON_MALFORMED_CHANNEL_DATA)

	f = good
	f.Payload = packet.ChannelData(0x4FFF, data(10), nil)
	pass("no-channel/unbound-channel", "a0", f.Marshal(), bpf.RelayReasonREASON_NO_CHANNEL)
	f = good
	f.Src = ap("10.100.0.2:40009")
	pass("no-channel/other-client-port", "a0", f.Marshal(), bpf.RelayReasonREASON_NO_CHANNEL)
	f = good
	f.Payload = packet.ChannelData(0x7FFF, data(10), nil) // reserved by RFC 8656, never bound
	pass("no-channel/reserved-range", "a0", f.Marshal(), bpf.RelayReasonREASON_NO_CHANNEL)

	p := fromPeer(redirect, data(10))
	p.Src = ap("10.200.0.2:5009")
	pass("no-peer-binding/right-ip-wrong-port", "b0", p.Marshal(), bpf.RelayReasonREASON_NO_PEER_BINDING)
	p = fromPeer(redirect, data(10))
	p.Src = ap("10.200.0.77:5001")
	pass("no-peer-binding/unbound-peer", "b0", p.Marshal(), bpf.RelayReasonREASON_NO_PEER_BINDING)
	p = fromPeer(redirect, data(10))
	p.Dst = ap("10.200.0.99:50000")
	pass("no-peer-binding/other-local-address", "b0", p.Marshal(), bpf.RelayReasonREASON_NO_PEER_BINDING)

	b := bindings["noneigh"]
	pass("fib/no-neigh", "a0", fromClient(b, "10.100.0.1", cd(b, 10)).Marshal(), bpf.RelayReasonREASON_FIB_NO_NEIGH)
	b = bindings["smallmtu"]
	pass("fib/frag-needed/c2p", "a0", fromClient(b, "10.100.0.1", cd(b, 73)).Marshal(), bpf.RelayReasonREASON_FIB_FRAG_NEEDED)
	b = bindings["clientsmallmtu"]
	// 72 bytes of data fit in c0's MTU of 100 from the peer, not with the header.
	pass("fib/frag-needed/p2c-plus-4", "b0", fromPeer(b, data(69)).Marshal(), bpf.RelayReasonREASON_FIB_FRAG_NEEDED)
	b = bindings["fwdoff"]
	pass("fib/forwarding-disabled", "d0", fromClient(b, "10.202.0.1", cd(b, 10)).Marshal(), bpf.RelayReasonREASON_FIB_FWD_DISABLED)
	b = bindings["unreachable"]
	pass("fib/unreachable", "a0", fromClient(b, "10.100.0.1", cd(b, 10)).Marshal(), bpf.RelayReasonREASON_FIB_NOT_FORWARDED)
	b = bindings["notattached"]
	pass("egress-not-attached", "a0", fromClient(b, "10.100.0.1", cd(b, 10)).Marshal(), bpf.RelayReasonREASON_EGRESS_NOT_ATTACHED)

	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			before := e.verdicts(t)
			ret, out := e.run(t, c.ingress, c.in)
			if ret != c.verdict {
				t.Errorf("verdict %d, want %d", ret, c.verdict)
			}
			after := e.verdicts(t)
			for r := range after {
				want := before[r]
				if bpf.RelayReason(r) == c.reason {
					want++
				}
				if after[r] != want {
					t.Errorf("verdict counter %v: %d -> %d, want %d", bpf.RelayReason(r), before[r], after[r], want)
				}
			}
			want := c.out
			if want == nil {
				want = c.in
			}
			if !bytes.Equal(out, want) {
				t.Fatalf("output differs\n got %x\nwant %x", out, want)
			}
			if c.out != nil {
				if _, err := packet.Parse(out); err != nil {
					t.Fatalf("output frame: %v", err)
				}
			}
		})
	}
}

func (e *env) verdicts(t *testing.T) []uint64 {
	t.Helper()
	v, err := e.maps.Verdicts()
	if err != nil {
		t.Fatal(err)
	}
	return v
}

// TestLearnListenerAddress: with a wildcard listener the peer->client direction
// waits in userspace until a client packet shows the address it arrived at.
func TestLearnListenerAddress(t *testing.T) {
	e := newEnv(t)
	e.install(t)
	b := bindings["learn"]
	a0 := e.ifaces["a0"]

	in := fromPeer(b, data(20))
	if ret, out := e.run(t, "b0", in.Marshal()); ret != xdpPass || !bytes.Equal(out, in.Marshal()) {
		t.Fatalf("before learning: verdict %d, want PASS untouched", ret)
	}
	c := fromClient(b, "10.100.0.1", packet.ChannelData(b.Channel, data(20), nil))
	if ret, _ := e.run(t, "a0", c.Marshal()); ret != xdpRedirect {
		t.Fatalf("client packet: verdict %d, want REDIRECT", ret)
	}
	ret, out := e.run(t, "b0", in.Marshal())
	want := toClient(in, b, netip.MustParseAddr("10.100.0.1"), a0.mac, clientMAC, data(20)).Marshal()
	if ret != xdpRedirect || !bytes.Equal(out, want) {
		t.Fatalf("after learning: verdict %d\n got %x\nwant %x", ret, out, want)
	}
	// A client packet that arrives at another address (a VIP before DNAT)
	// moves the source of the replies with it.
	c = fromClient(b, "10.100.0.100", packet.ChannelData(b.Channel, data(20), nil))
	e.run(t, "a0", c.Marshal())
	ret, out = e.run(t, "b0", in.Marshal())
	want = toClient(in, b, netip.MustParseAddr("10.100.0.100"), a0.mac, clientMAC, data(20)).Marshal()
	if ret != xdpRedirect || !bytes.Equal(out, want) {
		t.Fatalf("after moving: verdict %d\n got %x\nwant %x", ret, out, want)
	}
}

// TestBindingCounters: per-binding packet and byte counters follow what was
// relayed in each direction, and survive the binding's removal in the totals.
func TestBindingCounters(t *testing.T) {
	e := newEnv(t)
	e.install(t)
	b := bindings["redirect"]
	for i := 0; i < 3; i++ {
		e.run(t, "a0", fromClient(b, "10.100.0.1", packet.ChannelData(b.Channel, data(100), nil)).Marshal())
	}
	for i := 0; i < 2; i++ {
		e.run(t, "b0", fromPeer(b, data(50)).Marshal())
	}
	s, err := e.maps.Stats(b.Key())
	if err != nil {
		t.Fatal(err)
	}
	want := channelmap.Stats{ClientToPeerPackets: 3, ClientToPeerBytes: 300, PeerToClientPackets: 2, PeerToClientBytes: 100}
	if s != want {
		t.Fatalf("stats %+v, want %+v", s, want)
	}
	if err := e.maps.Delete(b.Key()); err != nil {
		t.Fatal(err)
	}
	tot, err := e.maps.Totals()
	if err != nil {
		t.Fatal(err)
	}
	if tot != want {
		t.Fatalf("totals after delete %+v, want %+v", tot, want)
	}
	// Deleted: both directions pass again.
	if ret, _ := e.run(t, "a0", fromClient(b, "10.100.0.1", packet.ChannelData(b.Channel, data(100), nil)).Marshal()); ret != xdpPass {
		t.Fatalf("after delete: client verdict %d, want PASS", ret)
	}
	if ret, _ := e.run(t, "b0", fromPeer(b, data(50)).Marshal()); ret != xdpPass {
		t.Fatalf("after delete: peer verdict %d, want PASS", ret)
	}
}
