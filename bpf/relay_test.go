package bpf_test

import (
	"bytes"
	"fmt"
	"net/netip"
	"testing"

	"github.com/l7mp/stunnerd-xdp/bpf"
	"github.com/l7mp/stunnerd-xdp/internal/channelmap"
	"github.com/l7mp/stunnerd-xdp/test/model"
	"github.com/l7mp/stunnerd-xdp/test/packet"
)

func ap(s string) netip.AddrPort { return netip.MustParseAddrPort(s) }

// bindings: one per branch of the program, see each comment.
var bindings = map[string]channelmap.Binding{
	// client on a0, peer on b0: redirect both ways.
	"redirect": {Client: ap("10.100.0.2:40000"), Listener: wildcard4, Channel: 0x4000,
		Peer: ap("10.200.0.2:5001"), Relay: ap("10.200.0.1:50000"), ReplySource: netip.MustParseAddr("10.100.0.1")},
	// client and peer both behind a0: XDP_TX both ways.
	"tx": {Client: ap("10.100.0.2:40000"), Listener: wildcard4, Channel: 0x4001,
		Peer: ap("10.100.0.3:6000"), Relay: ap("10.100.0.1:50001"), ReplySource: netip.MustParseAddr("10.100.0.1")},
	// peer without a neighbour entry.
	"noneigh": {Client: ap("10.100.0.2:40000"), Listener: wildcard4, Channel: 0x4002,
		Peer: ap("10.200.0.9:5001"), Relay: ap("10.200.0.1:50002"), ReplySource: netip.MustParseAddr("10.100.0.1")},
	// peer behind c0, MTU 100.
	"smallmtu": {Client: ap("10.100.0.2:40000"), Listener: wildcard4, Channel: 0x4003,
		Peer: ap("10.201.0.2:5001"), Relay: ap("10.201.0.1:50003"), ReplySource: netip.MustParseAddr("10.100.0.1")},
	// peer behind an unreachable route.
	"unreachable": {Client: ap("10.100.0.2:40000"), Listener: wildcard4, Channel: 0x4004,
		Peer: ap("10.250.0.2:5001"), Relay: ap("10.200.0.1:50004"), ReplySource: netip.MustParseAddr("10.100.0.1")},
	// peer behind e0, which is not in the devmap.
	"notattached": {Client: ap("10.100.0.2:40000"), Listener: wildcard4, Channel: 0x4005,
		Peer: ap("10.203.0.2:5001"), Relay: ap("10.203.0.1:50005"), ReplySource: netip.MustParseAddr("10.100.0.1")},
	// client behind d0, forwarding off there.
	"fwdoff": {Client: ap("10.202.0.2:40000"), Listener: wildcard4, Channel: 0x4000,
		Peer: ap("10.200.0.2:5002"), Relay: ap("10.200.0.1:50006"), ReplySource: netip.MustParseAddr("10.202.0.1")},
	// wildcard listener: the source for the client is learned from its packets.
	"learn": {Client: ap("10.100.0.2:40001"), Listener: wildcard4, Channel: 0x4000,
		Peer: ap("10.200.0.2:5003"), Relay: ap("10.200.0.1:50007")},
	// client behind c0 (MTU 100): the 4 added bytes can push a reply over it.
	"clientsmallmtu": {Client: ap("10.201.0.2:40000"), Listener: wildcard4, Channel: 0x4000,
		Peer: ap("10.200.0.2:5004"), Relay: ap("10.200.0.1:50008"), ReplySource: netip.MustParseAddr("10.201.0.1")},

	// A relay whose flow the node source-NATs (a masquerade, natcheck's
	// Translated): on the wire it is 10.200.0.7:51041, not pion's socket.
	"snat": {Client: ap("10.100.0.2:40000"), Listener: wildcard4, Channel: 0x4006,
		Peer: ap("10.200.0.2:5040"), Relay: ap("10.100.0.1:50040"), Wire: ap("10.200.0.7:51041"),
		ReplySource: netip.MustParseAddr("10.100.0.1")},
	// The same with a port outside the relay range (--random-fully picks
	// any): its peer's datagrams reach the lookup through nat_relay_ports.
	"snatport": {Client: ap("10.100.0.2:40000"), Listener: wildcard4, Channel: 0x4007,
		Peer: ap("10.200.0.2:5041"), Relay: ap("10.100.0.1:50041"), Wire: ap("10.200.0.7:31041"),
		ReplySource: netip.MustParseAddr("10.100.0.1")},

	// IPv6 clients; relays and peers are IPv4.
	// client on a0, peer on b0: redirect both ways, v6->v4 and v4->v6.
	"v6redirect": {Client: ap("[fd00:100::2]:40000"), Listener: wildcard6, Channel: 0x4000,
		Peer: ap("10.200.0.2:5010"), Relay: ap("10.200.0.1:50010"), ReplySource: netip.MustParseAddr("fd00:100::1")},
	// client and peer both behind a0: XDP_TX both ways.
	"v6tx": {Client: ap("[fd00:100::2]:40000"), Listener: wildcard6, Channel: 0x4001,
		Peer: ap("10.100.0.3:6010"), Relay: ap("10.100.0.1:50011"), ReplySource: netip.MustParseAddr("fd00:100::1")},
	// wildcard listener: learned from the client's IPv6 packets.
	"v6learn": {Client: ap("[fd00:100::2]:40001"), Listener: wildcard6, Channel: 0x4000,
		Peer: ap("10.200.0.2:5011"), Relay: ap("10.200.0.1:50012")},
	// IPv6 client without a neighbour entry.
	"v6noneigh": {Client: ap("[fd00:100::9]:40000"), Listener: wildcard6, Channel: 0x4000,
		Peer: ap("10.200.0.2:5012"), Relay: ap("10.200.0.1:50013"), ReplySource: netip.MustParseAddr("fd00:100::1")},
	// IPv6 client behind f0 (MTU 1280): the reply is 24 bytes longer than the
	// peer's datagram.
	"v6clientsmallmtu": {Client: ap("[fd00:204::2]:40000"), Listener: wildcard6, Channel: 0x4000,
		Peer: ap("10.200.0.2:5013"), Relay: ap("10.200.0.1:50014"), ReplySource: netip.MustParseAddr("fd00:204::1")},
	// IPv6 client, peer behind c0 (MTU 100): the IPv4 result is 24 bytes
	// shorter than the IPv6 ChannelData.
	"v6smallmtu": {Client: ap("[fd00:100::2]:40002"), Listener: wildcard6, Channel: 0x4000,
		Peer: ap("10.201.0.2:5014"), Relay: ap("10.201.0.1:50015"), ReplySource: netip.MustParseAddr("fd00:100::1")},
	// IPv6 client behind d0: IPv4 forwarding off there (client->peer passes),
	// IPv6 forwarding on (its replies are relayed).
	"v6fwdoff": {Client: ap("[fd00:202::2]:40000"), Listener: wildcard6, Channel: 0x4000,
		Peer: ap("10.200.0.2:5015"), Relay: ap("10.200.0.1:50016"), ReplySource: netip.MustParseAddr("fd00:202::1")},
	// peer behind e0: IPv6 forwarding off there (replies to the IPv6 client
	// pass), and e0 is not attached (client->peer passes).
	"v6fwdoff6": {Client: ap("[fd00:100::2]:40003"), Listener: wildcard6, Channel: 0x4000,
		Peer: ap("10.203.0.2:5016"), Relay: ap("10.203.0.1:50017"), ReplySource: netip.MustParseAddr("fd00:100::1")},
	// IPv6 client behind e0, which is not attached.
	"v6notattached": {Client: ap("[fd00:203::2]:40000"), Listener: wildcard6, Channel: 0x4000,
		Peer: ap("10.200.0.2:5017"), Relay: ap("10.200.0.1:50018"), ReplySource: netip.MustParseAddr("fd00:203::1")},
	// An IPv6 "client" at the server's own address: a local route.
	"v6local": {Client: ap("[fd00:100::1]:40000"), Listener: wildcard6, Channel: 0x4000,
		Peer: ap("10.200.0.2:5019"), Relay: ap("10.200.0.1:50020"), ReplySource: netip.MustParseAddr("fd00:100::1")},
	// A multicast "client", its peer behind e0 (IPv6 forwarding off).
	"v6multicast": {Client: ap("[ff02::1]:40000"), Listener: wildcard6, Channel: 0x4000,
		Peer: ap("10.203.0.2:5020"), Relay: ap("10.203.0.1:50021"), ReplySource: netip.MustParseAddr("fd00:100::1")},
	// A link-local listener address.
	"v6linklocal": {Client: ap("[fd00:100::2]:40004"), Listener: wildcard6, Channel: 0x4000,
		Peer: ap("10.200.0.2:5021"), Relay: ap("10.200.0.1:50022"), ReplySource: netip.MustParseAddr("fe80::1")},
	// The specific listener sharing the port with the wildcard: the same client
	// address:port and channel as "redirect" ("v6redirect"), another peer.
	"specific": {Client: ap("10.100.0.2:40000"), Listener: specific4, Channel: 0x4000,
		Peer: ap("10.200.0.2:5030"), Relay: ap("10.200.0.1:50030"), ReplySource: netip.MustParseAddr("10.100.0.5")},
	"v6specific": {Client: ap("[fd00:100::2]:40000"), Listener: specific6, Channel: 0x4000,
		Peer: ap("10.200.0.2:5031"), Relay: ap("10.200.0.1:50031"), ReplySource: netip.MustParseAddr("fd00:100::5")},
	// A client that reaches the wildcard listener through a NodePort DNAT
	// (nodePort -> listenerPort): replies leave from the NodePort it sent to.
	"nodeport": {Client: ap("10.100.0.2:40010"), Listener: wildcard4, Channel: 0x4000,
		Peer: ap("10.200.0.2:5040"), Relay: ap("10.200.0.1:50040"), ReplySource: netip.MustParseAddr("10.100.0.1"), ReplyPort: nodePort},
	"v6nodeport": {Client: ap("[fd00:100::2]:40010"), Listener: wildcard6, Channel: 0x4000,
		Peer: ap("10.200.0.2:5041"), Relay: ap("10.200.0.1:50041"), ReplySource: netip.MustParseAddr("fd00:100::1"), ReplyPort: nodePort},
	// The same, nothing learned yet: its replies wait for a client packet.
	"nodeportlearn": {Client: ap("10.100.0.2:40011"), Listener: wildcard4, Channel: 0x4000,
		Peer: ap("10.200.0.2:5042"), Relay: ap("10.200.0.1:50042")},
	// IPv6 client behind an unreachable route.
	"v6unreachable": {Client: ap("[fd00:250::2]:40000"), Listener: wildcard6, Channel: 0x4000,
		Peer: ap("10.200.0.2:5018"), Relay: ap("10.200.0.1:50019"), ReplySource: netip.MustParseAddr("fd00:100::1")},
}

// install puts the golden bindings into the maps and returns the model of the
// environment holding the same bindings.
func (e *env) install(t testing.TB) *model.Model {
	t.Helper()
	bs := sortedBindings()
	e.replace(t, bs)
	return e.newModel(t, bs)
}

// fromClient is a frame the client sends to the listener; fromPeer one the peer
// sends to the relay address. An IPv6 client's frame is IPv6, with a flow
// label (which the relay does not carry over).
func fromClient(b channelmap.Binding, listener string, payload []byte) packet.Frame {
	f := packet.Frame{DstMAC: [6]byte{0x02, 0xaa}, SrcMAC: clientMAC, TTL: 63, ID: 0x1234, FragOff: 0x4000,
		TOS: 0xb8, Src: b.Client, Dst: netip.AddrPortFrom(netip.MustParseAddr(listener), b.Listener.Port()), Payload: payload}
	if f.Is6() {
		f.FlowLabel = 0xabcde
	}
	return f
}

func fromPeer(b channelmap.Binding, payload []byte) packet.Frame {
	return packet.Frame{DstMAC: [6]byte{0x02, 0xbb}, SrcMAC: peerMAC, TTL: 9, ID: 0x4321,
		Src: b.Peer, Dst: b.OnWire(), Payload: payload}
}

func data(n int) []byte {
	d := make([]byte, n)
	for i := range d {
		d[i] = byte(i*7 + 1)
	}
	return d
}

// toPeer is what the relay must send to the peer for a client frame: TTL one
// less, a full UDP checksum. From an IPv6 client: TOS = the traffic class, ID
// 0, DF.
func toPeer(in packet.Frame, b channelmap.Binding, srcMAC, dstMAC [6]byte, d []byte) packet.Frame {
	id, frag := in.ID, in.FragOff
	if in.Is6() {
		id, frag = 0, 0x4000
	}
	return packet.Frame{DstMAC: dstMAC, SrcMAC: srcMAC, TTL: in.TTL - 1, ID: id, FragOff: frag, TOS: in.TOS,
		Src: b.OnWire(), Dst: b.Peer, Payload: d, NoUDPChecksum: in.NoUDPChecksum}
}

// toClient is what the relay must send to the client for a peer frame. To an
// IPv6 client (an IPv6 listener address): IPv6, traffic class = the TOS, flow
// label 0, hop limit = TTL - 1.
func toClient(in packet.Frame, b channelmap.Binding, listener netip.Addr, srcMAC, dstMAC [6]byte, d []byte) packet.Frame {
	return toClientFrom(in, b, netip.AddrPortFrom(listener, b.Listener.Port()), srcMAC, dstMAC, d)
}

// toClientFrom is toClient from another port than the listener's (a NodePort).
func toClientFrom(in packet.Frame, b channelmap.Binding, from netip.AddrPort, srcMAC, dstMAC [6]byte, d []byte) packet.Frame {
	return packet.Frame{DstMAC: dstMAC, SrcMAC: srcMAC, TTL: in.TTL - 1, ID: in.ID, FragOff: in.FragOff, TOS: in.TOS,
		Src: from, Dst: b.Client, Payload: packet.ChannelData(b.Channel, d, nil), NoUDPChecksum: in.NoUDPChecksum}
}

// toPort is f sent to another destination port (a NodePort).
func toPort(f packet.Frame, port uint16) packet.Frame {
	f.Dst = netip.AddrPortFrom(f.Dst.Addr(), port)
	return f
}

type golden struct {
	name    string
	ingress string
	in      []byte
	verdict uint32
	reason  bpf.RelayReason
	out     []byte // nil: the input, untouched
}

// TestGoldenPackets: every way a bound packet leaves, and every way the next
// hop can fail, through BPF_PROG_RUN. Each row's expected output is built by
// test/packet, independently of the program and the model, and the model
// must agree with the program on every row too.
func TestGoldenPackets(t *testing.T) {
	e := newEnv(t)
	m := e.install(t)
	runTable(t, e, m, goldenCases(e))
}

// goldenCases are the relayed rows and the next-hop (FIB) rows.
func goldenCases(e *env) []golden {
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
			out: toClient(in, redirect, redirect.ReplySource, a0.mac, clientMAC, data(n)).Marshal()})
	}
	{
		in := fromPeer(redirect, data(33))
		in.NoUDPChecksum = true
		cases = append(cases, golden{name: "p2c/redirect/no-udp-checksum", ingress: "b0", in: in.Marshal(),
			verdict: xdpRedirect, reason: bpf.RelayReasonREASON_RELAY_P2C_REDIRECT,
			out: toClient(in, redirect, redirect.ReplySource, a0.mac, clientMAC, data(33)).Marshal()})
		in = fromPeer(redirect, data(3))
		in.Trailer = make([]byte, 60-(packet.EthLen+packet.IPv4Len+packet.UDPLen+3))
		cases = append(cases, golden{name: "p2c/redirect/ethernet-trailer", ingress: "b0", in: in.Marshal(),
			verdict: xdpRedirect, reason: bpf.RelayReasonREASON_RELAY_P2C_REDIRECT,
			out: toClient(in, redirect, redirect.ReplySource, a0.mac, clientMAC, data(3)).Marshal()})
	}
	for _, n := range []int{1, 1200} {
		in := fromPeer(tx, data(n))
		in.SrcMAC = peer2MAC
		cases = append(cases, golden{name: fmt.Sprintf("p2c/tx/len=%d", n), ingress: "a0", in: in.Marshal(),
			verdict: xdpTX, reason: bpf.RelayReasonREASON_RELAY_P2C_TX,
			out: toClient(in, tx, tx.ReplySource, a0.mac, clientMAC, data(n)).Marshal()})
	}
	// A source-NATed relay: client->peer leaves from the translated address
	// and port, the peer's datagrams to them are the binding's, and those to
	// pion's socket itself are no binding's (the kernel would not de-NAT them).
	{
		snat := bindings["snat"]
		in := fromClient(snat, "10.100.0.1", packet.ChannelData(snat.Channel, data(100), nil))
		cases = append(cases, golden{name: "c2p/snat/redirect", ingress: "a0", in: in.Marshal(),
			verdict: xdpRedirect, reason: bpf.RelayReasonREASON_RELAY_C2P_REDIRECT,
			out: toPeer(in, snat, b0.mac, peerMAC, data(100)).Marshal()})
		in = fromPeer(snat, data(100))
		cases = append(cases, golden{name: "p2c/snat/redirect", ingress: "b0", in: in.Marshal(),
			verdict: xdpRedirect, reason: bpf.RelayReasonREASON_RELAY_P2C_REDIRECT,
			out: toClient(in, snat, snat.ReplySource, a0.mac, clientMAC, data(100)).Marshal()})
		in.Dst = snat.Relay
		cases = append(cases, golden{name: "pass/p2c/snat/to-untranslated-relay", ingress: "b0", in: in.Marshal(),
			verdict: xdpPass, reason: bpf.RelayReasonREASON_NO_PEER_BINDING})

		sp := bindings["snatport"]
		in = fromClient(sp, "10.100.0.1", packet.ChannelData(sp.Channel, data(100), nil))
		cases = append(cases, golden{name: "c2p/snat/port-outside-relay-range", ingress: "a0", in: in.Marshal(),
			verdict: xdpRedirect, reason: bpf.RelayReasonREASON_RELAY_C2P_REDIRECT,
			out: toPeer(in, sp, b0.mac, peerMAC, data(100)).Marshal()})
		in = fromPeer(sp, data(100))
		cases = append(cases, golden{name: "p2c/snat/port-outside-relay-range", ingress: "b0", in: in.Marshal(),
			verdict: xdpRedirect, reason: bpf.RelayReasonREASON_RELAY_P2C_REDIRECT,
			out: toClient(in, sp, sp.ReplySource, a0.mac, clientMAC, data(100)).Marshal()})
		// Another sender to that port is no binding's; a port next to it is
		// not the relay's at all.
		in.Src = ap("10.200.0.3:5041")
		cases = append(cases, golden{name: "pass/p2c/snat/port-outside-relay-range/other-peer", ingress: "b0", in: in.Marshal(),
			verdict: xdpPass, reason: bpf.RelayReasonREASON_NO_PEER_BINDING})
		in = fromPeer(sp, data(100))
		in.Dst = netip.AddrPortFrom(sp.Wire.Addr(), sp.Wire.Port()+1)
		cases = append(cases, golden{name: "pass/p2c/snat/port-outside-relay-range/next-port", ingress: "b0", in: in.Marshal(),
			verdict: xdpPass, reason: bpf.RelayReasonREASON_NOT_OURS})
	}
	// A small result still fits under c0's MTU of 100.
	{
		b := bindings["smallmtu"]
		in := fromClient(b, "10.100.0.1", packet.ChannelData(b.Channel, data(72), nil))
		cases = append(cases, golden{name: "c2p/redirect/fits-small-mtu", ingress: "a0", in: in.Marshal(),
			verdict: xdpRedirect, reason: bpf.RelayReasonREASON_RELAY_C2P_REDIRECT,
			out: toPeer(in, b, c0.mac, smallMAC, data(72)).Marshal()})
	}

	// The next hop decides: every FIB outcome passes the original untouched.
	pass := func(name, ingress string, in []byte, reason bpf.RelayReason) {
		cases = append(cases, golden{name: "pass/" + name, ingress: ingress, in: in, verdict: xdpPass, reason: reason})
	}
	cd := func(b channelmap.Binding, n int) []byte { return packet.ChannelData(b.Channel, data(n), nil) }
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

	cases = append(cases, contractCases(e)...)
	cases = append(cases, nodePortCases(e)...)
	return append(cases, goldenCases6(e)...)
}

// nodePortCases: a client that reaches the listener through a DNAT that
// changes the port (kube-proxy's NodePort: nodeIP:31478 -> nodeIP:3478).
// The node's conntrack would reverse-NAT pion's replies to come from the
// NodePort; the program sends them from it, and takes the client's
// ChannelData to it, only where the destination table says a listener gets
// it.
func nodePortCases(e *env) []golden {
	a0, b0 := e.ifaces["a0"], e.ifaces["b0"]
	np, np6 := bindings["nodeport"], bindings["v6nodeport"]
	var cases []golden
	in := toPort(fromClient(np, "10.100.0.1", packet.ChannelData(np.Channel, data(100), nil)), nodePort)
	cases = append(cases, golden{name: "nodeport/c2p", ingress: "a0", in: in.Marshal(),
		verdict: xdpRedirect, reason: bpf.RelayReasonREASON_RELAY_C2P_REDIRECT,
		out: toPeer(in, np, b0.mac, peerMAC, data(100)).Marshal()})
	p := fromPeer(np, data(100))
	cases = append(cases, golden{name: "nodeport/p2c", ingress: "b0", in: p.Marshal(),
		verdict: xdpRedirect, reason: bpf.RelayReasonREASON_RELAY_P2C_REDIRECT,
		out: toClientFrom(p, np, netip.AddrPortFrom(np.ReplySource, nodePort), a0.mac, clientMAC, data(100)).Marshal()})
	in = toPort(fromClient(np6, "fd00:100::1", packet.ChannelData(np6.Channel, data(100), nil)), nodePort)
	cases = append(cases, golden{name: "nodeport/v6/c2p", ingress: "a0", in: in.Marshal(),
		verdict: xdpRedirect, reason: bpf.RelayReasonREASON_RELAY_C2P_REDIRECT,
		out: toPeer(in, np6, b0.mac, peerMAC, data(100)).Marshal()})
	p = fromPeer(np6, data(100))
	cases = append(cases, golden{name: "nodeport/v6/p2c", ingress: "b0", in: p.Marshal(),
		verdict: xdpRedirect, reason: bpf.RelayReasonREASON_RELAY_P2C_REDIRECT,
		out: toClientFrom(p, np6, netip.AddrPortFrom(np6.ReplySource, nodePort), a0.mac, clientMAC, data(100)).Marshal()})

	pass := func(name string, in packet.Frame, reason bpf.RelayReason) {
		cases = append(cases, golden{name: "nodeport/pass/" + name, ingress: "a0", in: in.Marshal(), verdict: xdpPass, reason: reason})
	}
	cd := packet.ChannelData(np.Channel, data(10), nil)
	// A port no destination translates: not the relay's at all.
	pass("port-not-translated", toPort(fromClient(np, "10.100.0.1", cd), nodePort+1), bpf.RelayReasonREASON_NOT_OURS)
	// A translated port at an address whose DNAT was not learned (the
	// specific listener's address; transit traffic to another host).
	pass("address-not-translated", toPort(fromClient(np, "10.100.0.5", cd), nodePort), bpf.RelayReasonREASON_NOT_LISTENER_ADDR)
	pass("transit", toPort(fromClient(np, "10.200.0.2", cd), nodePort), bpf.RelayReasonREASON_NOT_LISTENER_ADDR)
	// STUN (an Allocate, a Refresh) to the NodePort: pion's.
	pass("stun", toPort(fromClient(np, "10.100.0.1", []byte{0, 1, 0, 0, 0x21, 0x12, 0xa4, 0x42,
		1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}), nodePort), bpf.RelayReasonREASON_STUN)
	// Bound, but a channel the client did not bind.
	pass("no-channel", toPort(fromClient(np, "10.100.0.1", packet.ChannelData(0x4abc, data(10), nil)), nodePort),
		bpf.RelayReasonREASON_NO_CHANNEL)
	// A translated port inside the relay range is a relay port to the
	// program: the client's ChannelData there goes to pion.
	pass("relay-range-port", toPort(fromClient(np, "10.100.0.1", cd), relayRangeNodePort), bpf.RelayReasonREASON_NO_PEER_BINDING)
	return cases
}

// contractCases: what pion/turn and the node's kernel would do, in the
// deployments issue 9 names. Each row's output is built by test/packet.
func contractCases(e *env) []golden {
	a0, b0 := e.ifaces["a0"], e.ifaces["b0"]
	var cases []golden
	add := func(name, ingress string, in []byte, verdict uint32, reason bpf.RelayReason, out []byte) {
		cases = append(cases, golden{name: "contract/" + name, ingress: ingress, in: in, verdict: verdict, reason: reason, out: out})
	}
	// Two listeners on one port: one client address:port, channel 0x4000 on
	// each; each listener's address leads to its own peer.
	for _, c := range []struct{ name, dst string }{{"redirect", "10.100.0.1"}, {"specific", "10.100.0.5"},
		{"v6redirect", "fd00:100::1"}, {"v6specific", "fd00:100::5"}} {
		b := bindings[c.name]
		in := fromClient(b, c.dst, packet.ChannelData(b.Channel, data(30), nil))
		add("two-listeners/c2p/"+c.name, "a0", in.Marshal(), xdpRedirect, bpf.RelayReasonREASON_RELAY_C2P_REDIRECT,
			toPeer(in, b, b0.mac, peerMAC, data(30)).Marshal())
		p := fromPeer(b, data(30))
		add("two-listeners/p2c/"+c.name, "b0", p.Marshal(), xdpRedirect, bpf.RelayReasonREASON_RELAY_P2C_REDIRECT,
			toClient(p, b, b.ReplySource, a0.mac, clientMAC, data(30)).Marshal())
	}
	// Destinations no listener accepts: transit (a peer, a host beyond the
	// node), broadcast, multicast, the unspecified address.
	redirect := bindings["redirect"]
	for _, dst := range []string{"10.200.0.2", "192.0.2.1", "10.100.0.255", "255.255.255.255", "224.0.0.1", "0.0.0.0"} {
		in := fromClient(redirect, dst, packet.ChannelData(redirect.Channel, data(30), nil))
		add("not-listener-address/"+dst, "a0", in.Marshal(), xdpPass, bpf.RelayReasonREASON_NOT_LISTENER_ADDR, nil)
	}
	for _, dst := range []string{"fd00:100::3", "2001:db8::1", "ff02::1", "::ffff:10.100.0.1"} {
		b := bindings["v6redirect"]
		in := fromClient(b, dst, packet.ChannelData(b.Channel, data(30), nil))
		add("not-listener-address/"+dst, "a0", in.Marshal(), xdpPass, bpf.RelayReasonREASON_NOT_LISTENER_ADDR, nil)
	}
	// CHECKSUM_PARTIAL senders: the output carries a full checksum. Lengths
	// around every chunk the program sums in, inline (sum_short, up to 255
	// bytes) and in sum_data.
	for _, n := range []int{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 15, 16, 63, 64, 67, 100, 127, 128, 254, 255, 256, 257, 260,
		511, 512, 513, 515, 1023, 1200, 1201} {
		for _, name := range []string{"redirect", "v6redirect"} {
			b := bindings[name]
			in := fromClient(b, map[string]string{"redirect": "10.100.0.1", "v6redirect": "fd00:100::1"}[name],
				packet.ChannelData(b.Channel, data(n), bytes.Repeat([]byte{0xC3}, (4-n%4)%4)))
			in.PartialChecksum = true
			add(fmt.Sprintf("partial-checksum/c2p/%s/len=%d", name, n), "a0", in.Marshal(), xdpRedirect,
				bpf.RelayReasonREASON_RELAY_C2P_REDIRECT, toPeer(in, b, b0.mac, peerMAC, data(n)).Marshal())
			p := fromPeer(b, data(n))
			p.PartialChecksum = true
			add(fmt.Sprintf("partial-checksum/p2c/%s/len=%d", name, n), "b0", p.Marshal(), xdpRedirect,
				bpf.RelayReasonREASON_RELAY_P2C_REDIRECT, toClient(p, b, b.ReplySource, a0.mac, clientMAC, data(n)).Marshal())
		}
	}
	// An IPv4 header whose checksum does not verify: the kernel would drop it.
	{
		in := fromClient(redirect, "10.100.0.1", packet.ChannelData(redirect.Channel, data(30), nil)).Marshal()
		in[packet.EthLen+10] ^= 0x10
		add("bad-ip-checksum/c2p", "a0", in, xdpPass, bpf.RelayReasonREASON_BAD_IP_CHECKSUM, nil)
		p := fromPeer(redirect, data(30)).Marshal()
		p[packet.EthLen+11] ^= 0x01
		add("bad-ip-checksum/p2c", "b0", p, xdpPass, bpf.RelayReasonREASON_BAD_IP_CHECKSUM, nil)
	}
	return cases
}

// goldenCases6 are the IPv6 client's relayed rows and next-hop rows.
func goldenCases6(e *env) []golden {
	a0, b0, c0, d0 := e.ifaces["a0"], e.ifaces["b0"], e.ifaces["c0"], e.ifaces["d0"]
	redirect, tx := bindings["v6redirect"], bindings["v6tx"]
	const listener = "fd00:100::1"

	var cases []golden
	add := func(name, ingress string, in []byte, verdict uint32, reason bpf.RelayReason, out []byte) {
		cases = append(cases, golden{name: "v6/" + name, ingress: ingress, in: in, verdict: verdict, reason: reason, out: out})
	}
	// client->peer, IPv6 in, IPv4 out.
	for _, n := range []int{0, 1, 2, 3, 4, 5, 99, 100, 1199, 1200} {
		for pad := 0; pad <= 3; pad++ {
			d := data(n)
			padding := bytes.Repeat([]byte{0xA5 + byte(pad)}, pad)
			in := fromClient(redirect, listener, packet.ChannelData(redirect.Channel, d, padding))
			add(fmt.Sprintf("c2p/redirect/len=%d/pad=%d", n, pad), "a0", in.Marshal(), xdpRedirect,
				bpf.RelayReasonREASON_RELAY_C2P_REDIRECT, toPeer(in, redirect, b0.mac, peerMAC, d).Marshal())
		}
	}
	for _, tc := range []uint8{0x00, 0x01, 0x10, 0xff} {
		in := fromClient(redirect, listener, packet.ChannelData(redirect.Channel, data(7), nil))
		in.TOS = tc
		add(fmt.Sprintf("c2p/redirect/traffic-class=%#02x", tc), "a0", in.Marshal(), xdpRedirect,
			bpf.RelayReasonREASON_RELAY_C2P_REDIRECT, toPeer(in, redirect, b0.mac, peerMAC, data(7)).Marshal())
	}
	for _, hl := range []uint8{2, 255} {
		in := fromClient(redirect, listener, packet.ChannelData(redirect.Channel, data(7), nil))
		in.TTL = hl
		add(fmt.Sprintf("c2p/redirect/hop-limit=%d", hl), "a0", in.Marshal(), xdpRedirect,
			bpf.RelayReasonREASON_RELAY_C2P_REDIRECT, toPeer(in, redirect, b0.mac, peerMAC, data(7)).Marshal())
	}
	for _, hl := range []uint8{0, 1} {
		in := fromClient(redirect, listener, packet.ChannelData(redirect.Channel, data(7), nil))
		in.TTL = hl
		add(fmt.Sprintf("pass/c2p/hop-limit=%d", hl), "a0", in.Marshal(), xdpPass, bpf.RelayReasonREASON_TTL_EXPIRED, nil)
	}
	{
		// Illegal on IPv6 (RFC 8200 8.1): Linux drops it, pion/turn never sees it.
		in := fromClient(redirect, listener, packet.ChannelData(redirect.Channel, data(100), []byte{1}))
		in.NoUDPChecksum = true
		add("pass/c2p/zero-udp-checksum", "a0", in.Marshal(), xdpPass, bpf.RelayReasonREASON_NO_CHECKSUM, nil)
		// An IPv6 frame is never below Ethernet's minimum; a trailer anyway.
		in = fromClient(redirect, listener, packet.ChannelData(redirect.Channel, data(5), []byte{0xa, 0xb, 0xc}))
		in.Trailer = []byte{0xee, 0xee, 0xee, 0xee, 0xee}
		add("c2p/redirect/ethernet-trailer", "a0", in.Marshal(), xdpRedirect,
			bpf.RelayReasonREASON_RELAY_C2P_REDIRECT, toPeer(in, redirect, b0.mac, peerMAC, data(5)).Marshal())
	}
	for _, n := range []int{1, 100, 1200} {
		in := fromClient(tx, listener, packet.ChannelData(tx.Channel, data(n), []byte{0x5a}))
		add(fmt.Sprintf("c2p/tx/len=%d", n), "a0", in.Marshal(), xdpTX,
			bpf.RelayReasonREASON_RELAY_C2P_TX, toPeer(in, tx, a0.mac, peer2MAC, data(n)).Marshal())
	}
	// peer->client, IPv4 in, IPv6 out.
	for _, n := range []int{0, 1, 2, 3, 100, 1199, 1200} {
		in := fromPeer(redirect, data(n))
		in.TOS = 0x2d
		add(fmt.Sprintf("p2c/redirect/len=%d", n), "b0", in.Marshal(), xdpRedirect, bpf.RelayReasonREASON_RELAY_P2C_REDIRECT,
			toClient(in, redirect, redirect.ReplySource, a0.mac, clientMAC, data(n)).Marshal())
	}
	for _, tos := range []uint8{0x00, 0x01, 0xb8, 0xff} {
		in := fromPeer(redirect, data(9))
		in.TOS = tos
		add(fmt.Sprintf("p2c/redirect/tos=%#02x", tos), "b0", in.Marshal(), xdpRedirect, bpf.RelayReasonREASON_RELAY_P2C_REDIRECT,
			toClient(in, redirect, redirect.ReplySource, a0.mac, clientMAC, data(9)).Marshal())
	}
	{
		in := fromPeer(redirect, data(3))
		in.Trailer = make([]byte, 60-(packet.EthLen+packet.IPv4Len+packet.UDPLen+3))
		add("p2c/redirect/ethernet-trailer", "b0", in.Marshal(), xdpRedirect, bpf.RelayReasonREASON_RELAY_P2C_REDIRECT,
			toClient(in, redirect, redirect.ReplySource, a0.mac, clientMAC, data(3)).Marshal())
		// IPv6 needs a checksum; pion/turn sums it.
		in = fromPeer(redirect, data(33))
		in.NoUDPChecksum = true
		add("p2c/no-udp-checksum", "b0", in.Marshal(), xdpPass, bpf.RelayReasonREASON_NO_CHECKSUM, nil)
	}
	for _, n := range []int{1, 1200} {
		in := fromPeer(tx, data(n))
		in.SrcMAC = peer2MAC
		add(fmt.Sprintf("p2c/tx/len=%d", n), "a0", in.Marshal(), xdpTX, bpf.RelayReasonREASON_RELAY_P2C_TX,
			toClient(in, tx, tx.ReplySource, a0.mac, clientMAC, data(n)).Marshal())
	}
	// IPv4 forwarding is off on d0, IPv6 forwarding on: replies to the client
	// behind it are relayed (its ChannelData is not: see below).
	{
		b := bindings["v6fwdoff"]
		in := fromPeer(b, data(10))
		add("p2c/redirect/to-ipv4-forwarding-off", "b0", in.Marshal(), xdpRedirect, bpf.RelayReasonREASON_RELAY_P2C_REDIRECT,
			toClient(in, b, b.ReplySource, d0.mac, offMAC, data(10)).Marshal())
	}
	// MTUs: an IPv4 result of 28+72 fits c0's 100; the whole IPv6 reply,
	// 40+8+4+1228, fits f0's 1280.
	{
		b := bindings["v6smallmtu"]
		in := fromClient(b, listener, packet.ChannelData(b.Channel, data(72), []byte{1, 2}))
		add("c2p/redirect/fits-small-mtu", "a0", in.Marshal(), xdpRedirect, bpf.RelayReasonREASON_RELAY_C2P_REDIRECT,
			toPeer(in, b, c0.mac, smallMAC, data(72)).Marshal())
		add("pass/fib/frag-needed/c2p", "a0", fromClient(b, listener, packet.ChannelData(b.Channel, data(73), nil)).Marshal(),
			xdpPass, bpf.RelayReasonREASON_FIB_FRAG_NEEDED, nil)
		b = bindings["v6clientsmallmtu"]
		in = fromPeer(b, data(1228))
		add("p2c/redirect/fits-1280", "b0", in.Marshal(), xdpRedirect, bpf.RelayReasonREASON_RELAY_P2C_REDIRECT,
			toClient(in, b, b.ReplySource, e.ifaces["f0"].mac, f0MAC, data(1228)).Marshal())
		// 1 byte over; and 1240, which an IPv4 reply (32+n) or the IPv6
		// payload alone (12+n) would fit.
		for _, n := range []int{1229, 1240} {
			add(fmt.Sprintf("pass/fib/frag-needed/p2c-plus-24/len=%d", n), "b0", fromPeer(b, data(n)).Marshal(),
				xdpPass, bpf.RelayReasonREASON_FIB_FRAG_NEEDED, nil)
		}
	}
	pass := func(name, ingress string, in []byte, reason bpf.RelayReason) {
		add("pass/"+name, ingress, in, xdpPass, reason, nil)
	}
	cd := func(b channelmap.Binding, n int) []byte { return packet.ChannelData(b.Channel, data(n), nil) }
	pass("fib/no-neigh/p2c", "b0", fromPeer(bindings["v6noneigh"], data(10)).Marshal(), bpf.RelayReasonREASON_FIB_NO_NEIGH)
	b := bindings["v6fwdoff"]
	pass("fib/forwarding-disabled/c2p-ipv4-off", "d0", fromClient(b, "fd00:202::1", cd(b, 10)).Marshal(), bpf.RelayReasonREASON_FIB_FWD_DISABLED)
	b = bindings["v6fwdoff6"]
	pass("fib/forwarding-disabled/p2c-ipv6-off", "e0", fromPeer(b, data(10)).Marshal(), bpf.RelayReasonREASON_FIB_FWD_DISABLED)
	pass("egress-not-attached/c2p", "a0", fromClient(b, listener, cd(b, 10)).Marshal(), bpf.RelayReasonREASON_EGRESS_NOT_ATTACHED)
	pass("egress-not-attached/p2c", "b0", fromPeer(bindings["v6notattached"], data(10)).Marshal(), bpf.RelayReasonREASON_EGRESS_NOT_ATTACHED)
	pass("fib/unreachable/p2c", "b0", fromPeer(bindings["v6unreachable"], data(10)).Marshal(), bpf.RelayReasonREASON_FIB_NOT_FORWARDED)
	pass("fib/local/p2c", "b0", fromPeer(bindings["v6local"], data(10)).Marshal(), bpf.RelayReasonREASON_FIB_NOT_FORWARDED)
	// bpf_ipv6_fib_lookup refuses multicast, link-local and loopback sources
	// and destinations before it looks at forwarding (e0 has it off).
	pass("fib/multicast-client/p2c-ipv6-forwarding-off", "e0", fromPeer(bindings["v6multicast"], data(10)).Marshal(), bpf.RelayReasonREASON_FIB_NOT_FORWARDED)
	pass("fib/link-local-listener/p2c", "b0", fromPeer(bindings["v6linklocal"], data(10)).Marshal(), bpf.RelayReasonREASON_FIB_NOT_FORWARDED)
	return cases
}

// runTable runs every row through the program and the model: the row's own
// verdict, reason and output must hold, exactly one verdict counter (the row's)
// must move by one, and the model must agree with the program on all of it.
// Each row runs twice: the first run may resolve its next hop with
// bpf_fib_lookup, the second finds it cached.
func runTable(t *testing.T, e *env, m *model.Model, cases []golden) {
	t.Helper()
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			for run := 0; run < 2; run++ {
				runRow(t, e, m, c)
			}
		})
	}
}

func runRow(t *testing.T, e *env, m *model.Model, c golden) {
	t.Helper()
	got, _ := e.check(t, m, c.ingress, c.in)
	if got.verdict != c.verdict {
		t.Errorf("verdict %d, want %d", got.verdict, c.verdict)
	}
	if got.reason != c.reason {
		t.Errorf("reason %s, want %s", reasonName(got.reason), reasonName(c.reason))
	}
	want := c.out
	if want == nil {
		want = c.in
	}
	if !bytes.Equal(got.out, want) {
		t.Fatalf("output differs\n got %x\nwant %x", got.out, want)
	}
	if c.out != nil {
		if _, err := packet.Parse(got.out); err != nil {
			t.Fatalf("output frame: %v", err)
		}
	}
}

// TestLearnListenerAddress: with a wildcard listener the peer->client direction
// waits in userspace until a client packet shows the address it arrived at.
func TestLearnListenerAddress(t *testing.T) {
	e := newEnv(t)
	m := e.install(t)
	b := bindings["learn"]
	a0 := e.ifaces["a0"]

	// Every step goes through the model too (e.check), which also compares the
	// learned address in the kernel with the model's after each packet.
	in := fromPeer(b, data(20))
	if got, _ := e.check(t, m, "b0", in.Marshal()); got.verdict != xdpPass || got.reason != bpf.RelayReasonREASON_CLIENT_ADDR_UNKNOWN ||
		!bytes.Equal(got.out, in.Marshal()) {
		t.Fatalf("before learning: verdict %d %s, want PASS client_addr_unknown untouched", got.verdict, reasonName(got.reason))
	}
	c := fromClient(b, "10.100.0.1", packet.ChannelData(b.Channel, data(20), nil))
	if got, res := e.check(t, m, "a0", c.Marshal()); got.verdict != xdpRedirect || res.Learned == nil {
		t.Fatalf("client packet: verdict %d, learned %v, want REDIRECT and a learned address", got.verdict, res.Learned)
	}
	got, _ := e.check(t, m, "b0", in.Marshal())
	want := toClient(in, b, netip.MustParseAddr("10.100.0.1"), a0.mac, clientMAC, data(20)).Marshal()
	if got.verdict != xdpRedirect || !bytes.Equal(got.out, want) {
		t.Fatalf("after learning: verdict %d\n got %x\nwant %x", got.verdict, got.out, want)
	}
	// A client packet that arrives at another address (a VIP before DNAT)
	// moves the source of the replies with it.
	c = fromClient(b, "10.100.0.100", packet.ChannelData(b.Channel, data(20), nil))
	e.check(t, m, "a0", c.Marshal())
	got, _ = e.check(t, m, "b0", in.Marshal())
	want = toClient(in, b, netip.MustParseAddr("10.100.0.100"), a0.mac, clientMAC, data(20)).Marshal()
	if got.verdict != xdpRedirect || !bytes.Equal(got.out, want) {
		t.Fatalf("after moving: verdict %d\n got %x\nwant %x", got.verdict, got.out, want)
	}
	// A packet to no unicast address teaches nothing: the replies keep coming
	// from the address learned last.
	for _, dst := range []string{"0.0.0.0", "255.255.255.255", "224.0.0.1"} {
		c = fromClient(b, dst, packet.ChannelData(b.Channel, data(20), nil))
		if _, res := e.check(t, m, "a0", c.Marshal()); res.Learned != nil {
			t.Fatalf("a client packet to %s was learned as the listener address", dst)
		}
		if got, _ = e.check(t, m, "b0", in.Marshal()); !bytes.Equal(got.out, want) {
			t.Fatalf("after a client packet to %s the replies changed source", dst)
		}
	}
	// Learning does not wait for a next hop: a bound client packet that passes
	// (its peer has no neighbour entry yet) still shows where it was sent.
	nb := bindings["noneigh"]
	c = fromClient(nb, "10.100.0.77", packet.ChannelData(nb.Channel, data(20), nil))
	if got, res := e.check(t, m, "a0", c.Marshal()); got.reason != bpf.RelayReasonREASON_FIB_NO_NEIGH || res.Learned == nil ||
		res.Learned.Addr != netip.MustParseAddr("10.100.0.77") {
		t.Fatalf("bound packet without a next hop: %s, learned %v", reasonName(got.reason), res.Learned)
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

// TestLearnListenerAddressIPv6: an IPv6 client's replies wait until its
// packets show the IPv6 address they arrive at; :: and multicast teach nothing.
func TestLearnListenerAddressIPv6(t *testing.T) {
	e := newEnv(t)
	m := e.install(t)
	b := bindings["v6learn"]
	a0 := e.ifaces["a0"]

	in := fromPeer(b, data(20))
	if got, _ := e.check(t, m, "b0", in.Marshal()); got.verdict != xdpPass || got.reason != bpf.RelayReasonREASON_CLIENT_ADDR_UNKNOWN {
		t.Fatalf("before learning: verdict %d %s, want PASS client_addr_unknown", got.verdict, reasonName(got.reason))
	}
	// Packets to an address no listener accepts teach nothing, before or after
	// learning: ::, multicast, an IPv4-mapped address, a host beyond the node.
	noLearn := func(stage string) {
		for _, dst := range []string{"::", "ff02::1", "ff0e::1:3", "::ffff:10.100.0.1", "fd00:100::3"} {
			c := fromClient(b, dst, packet.ChannelData(b.Channel, data(20), nil))
			if _, res := e.check(t, m, "a0", c.Marshal()); res.Learned != nil {
				t.Fatalf("%s: a client packet to %s was learned as the listener address", stage, dst)
			}
		}
	}
	noLearn("before")
	if got, _ := e.check(t, m, "b0", in.Marshal()); got.reason != bpf.RelayReasonREASON_CLIENT_ADDR_UNKNOWN {
		t.Fatalf("after packets to :: and multicast: %s, want client_addr_unknown", reasonName(got.reason))
	}
	for _, listener := range []string{"fd00:100::1", "fd00:100::100"} {
		c := fromClient(b, listener, packet.ChannelData(b.Channel, data(20), nil))
		if got, res := e.check(t, m, "a0", c.Marshal()); got.verdict != xdpRedirect || res.Learned == nil {
			t.Fatalf("client packet to %s: verdict %d, learned %v, want REDIRECT and a learned address", listener, got.verdict, res.Learned)
		}
		got, _ := e.check(t, m, "b0", in.Marshal())
		want := toClient(in, b, netip.MustParseAddr(listener), a0.mac, clientMAC, data(20))
		if got.verdict != xdpRedirect || !bytes.Equal(got.out, want.Marshal()) {
			t.Fatalf("after learning %s: verdict %d\n got %x\nwant %x", listener, got.verdict, got.out, want.Marshal())
		}
		noLearn("after " + listener)
	}
	// Learning does not wait for a next hop.
	nb := bindings["v6noneigh"]
	c := fromClient(nb, "fd00:100::77", packet.ChannelData(nb.Channel, data(20), nil))
	if _, res := e.check(t, m, "a0", c.Marshal()); res.Learned == nil || res.Learned.Addr != netip.MustParseAddr("fd00:100::77") {
		t.Fatalf("learned %v, want fd00:100::77", res.Learned)
	}
	if got, _ := e.check(t, m, "b0", fromPeer(nb, data(3)).Marshal()); got.reason != bpf.RelayReasonREASON_FIB_NO_NEIGH {
		t.Fatalf("reply to a client without a neighbour: %s", reasonName(got.reason))
	}
}

// TestLearnNodePort: the replies to a client that reaches the listener
// through a NodePort DNAT wait until its ChannelData shows the address and
// port it sends to, leave from both, and follow the client when it moves to
// another destination (the listener's own port, another VIP).
func TestLearnNodePort(t *testing.T) {
	e := newEnv(t)
	m := e.install(t)
	b := bindings["nodeportlearn"]
	a0 := e.ifaces["a0"]

	p := fromPeer(b, data(20))
	if got, _ := e.check(t, m, "b0", p.Marshal()); got.reason != bpf.RelayReasonREASON_CLIENT_ADDR_UNKNOWN {
		t.Fatalf("before learning: %s, want client_addr_unknown", reasonName(got.reason))
	}
	for _, dst := range []netip.AddrPort{ap("10.100.0.100:31478"), ap("10.100.0.1:3478"), ap("10.100.0.1:31478")} {
		c := toPort(fromClient(b, dst.Addr().String(), packet.ChannelData(b.Channel, data(20), nil)), dst.Port())
		got, res := e.check(t, m, "a0", c.Marshal())
		if got.verdict != xdpRedirect || res.Learned == nil || res.Learned.Addr != dst.Addr() || res.Learned.Port != dst.Port() {
			t.Fatalf("client packet to %v: verdict %d, learned %+v, want REDIRECT and %v learned", dst, got.verdict, res.Learned, dst)
		}
		got, _ = e.check(t, m, "b0", p.Marshal())
		want := toClientFrom(p, b, dst, a0.mac, clientMAC, data(20)).Marshal()
		if got.verdict != xdpRedirect || !bytes.Equal(got.out, want) {
			t.Fatalf("reply after a client packet to %v: verdict %d\n got %x\nwant %x", dst, got.verdict, got.out, want)
		}
	}
	// A packet to a destination no listener accepts teaches nothing.
	c := toPort(fromClient(b, "10.100.0.5", packet.ChannelData(b.Channel, data(20), nil)), nodePort)
	if _, res := e.check(t, m, "a0", c.Marshal()); res.Learned != nil {
		t.Fatalf("a packet to 10.100.0.5:%d was learned: %+v", nodePort, res.Learned)
	}
}
