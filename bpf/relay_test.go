package bpf_test

import (
	"bytes"
	"fmt"
	"net/netip"
	"testing"

	"github.com/l7mp/stunnerd-xdp/bpf"
	"github.com/l7mp/stunnerd-xdp/internal/channelmap"
	"github.com/l7mp/stunnerd-xdp/internal/model"
	"github.com/l7mp/stunnerd-xdp/internal/packet"
)

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

// install puts the golden bindings into the maps and returns the model of the
// environment holding the same bindings.
func (e *env) install(t testing.TB) *model.Model {
	t.Helper()
	bs := sortedBindings()
	e.replace(t, bs)
	return e.newModel(t, bs)
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

// TestGoldenPackets: every way a bound packet leaves, and every way the next
// hop can fail, through BPF_PROG_RUN. Each row's expected output is built by
// internal/packet, independently of the program and the model, and the model
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

	return cases
}

// runTable runs every row through the program and the model: the row's own
// verdict, reason and output must hold, exactly one verdict counter (the row's)
// must move by one, and the model must agree with the program on all of it.
func runTable(t *testing.T, e *env, m *model.Model, cases []golden) {
	t.Helper()
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
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
		})
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
