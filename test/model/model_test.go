package model_test

import (
	"bytes"
	"encoding/binary"
	"net/netip"
	"testing"

	"github.com/l7mp/stunnerd-xdp/bpf"
	"github.com/l7mp/stunnerd-xdp/internal/channelmap"
	"github.com/l7mp/stunnerd-xdp/test/model"
	"github.com/l7mp/stunnerd-xdp/test/packet"
)

// These tests pin the model's own reading of the spec, unprivileged: the
// privileged tests in bpf/ then hold the program to the model.

var (
	clientMAC = [6]byte{2, 0, 0, 0, 0x10, 2}
	peerMAC   = [6]byte{2, 0, 0, 0, 0x20, 2}
	aMAC      = [6]byte{2, 0, 0, 0, 0xa0, 1}
	bMAC      = [6]byte{2, 0, 0, 0, 0xb0, 1}
)

func testEnv() model.Env {
	return model.Env{
		ListenerPorts: []uint16{3478}, MinRelayPort: 49152, MaxRelayPort: 65535,
		Interfaces: []model.Interface{
			{Name: "a", Index: 2, MAC: aMAC, Addr: netip.MustParsePrefix("10.100.0.1/24"), MTU: 1500, Forwarding: true, Attached: true,
				Neighbours: map[netip.Addr][6]byte{netip.MustParseAddr("10.100.0.2"): clientMAC}, Caps: nativeCaps(1500)},
			{Name: "b", Index: 3, MAC: bMAC, Addr: netip.MustParsePrefix("10.200.0.1/24"), MTU: 100, Forwarding: true, Attached: true,
				Neighbours: map[netip.Addr][6]byte{netip.MustParseAddr("10.200.0.2"): peerMAC}, Caps: nativeCaps(100)},
		},
		Unreachable: []netip.Prefix{netip.MustParsePrefix("10.200.0.128/25")},
		Destinations: map[netip.AddrPort]netip.AddrPort{
			netip.MustParseAddrPort("10.100.0.1:3478"): listener,
			netip.MustParseAddrPort("192.0.2.10:3478"): listener, // a VIP the node DNATs to it
			netip.MustParseAddrPort("10.100.0.3:3478"): listener2,
		},
	}
}

// nativeCaps: the program runs natively, and XDP frames out of the device are
// transmitted (a NIC, a veth whose peer runs XDP).
func nativeCaps(mtu int) *model.DevCaps {
	return &model.DevCaps{Native: true, XDPXmit: true, XDPTX: true, MTU: mtu}
}

var (
	listener  = netip.MustParseAddrPort("10.100.0.1:3478")
	listener2 = netip.MustParseAddrPort("10.100.0.3:3478")
)

var binding = channelmap.Binding{
	Client: netip.MustParseAddrPort("10.100.0.2:40000"), Listener: listener, Channel: 0x4000,
	Peer: netip.MustParseAddrPort("10.200.0.2:5001"), Relay: netip.MustParseAddrPort("10.200.0.1:50000"),
}

func newModel(t *testing.T, bs ...channelmap.Binding) *model.Model {
	t.Helper()
	m, err := model.New(testEnv(), bs)
	if err != nil {
		t.Fatal(err)
	}
	return m
}

func clientFrame(dst string, payload []byte) packet.Frame {
	return packet.Frame{DstMAC: aMAC, SrcMAC: clientMAC, TTL: 9, ID: 7, FragOff: 0x4000, TOS: 0xb8,
		Src: binding.Client, Dst: netip.AddrPortFrom(netip.MustParseAddr(dst), 3478), Payload: payload}
}

func TestClientToPeer(t *testing.T) {
	m := newModel(t, binding)
	d := []byte("hello, peer")
	in := clientFrame("10.100.0.1", packet.ChannelData(0x4000, d, []byte{9}))
	res := m.Process(2, in.Marshal())
	if res.Verdict != model.Redirect || res.Reason != bpf.RelayReasonREASON_RELAY_C2P_REDIRECT {
		t.Fatalf("%v %v, want REDIRECT relay_c2p_redirect", res.Verdict, res.Reason)
	}
	want := packet.Frame{DstMAC: peerMAC, SrcMAC: bMAC, TTL: 8, ID: 7, FragOff: 0x4000, TOS: 0xb8,
		Src: binding.Relay, Dst: binding.Peer, Payload: d}.Marshal()
	if !bytes.Equal(res.Frame, want) {
		t.Fatalf("output\n got %x\nwant %x", res.Frame, want)
	}
	if res.Learned == nil || res.Learned.Addr != netip.MustParseAddr("10.100.0.1") {
		t.Fatalf("learned %+v, want 10.100.0.1", res.Learned)
	}
	if res.Counted == nil || *res.Counted != binding.Key() || res.DataLen != len(d) {
		t.Fatalf("counted %v/%d", res.Counted, res.DataLen)
	}
}

func TestPeerToClientWaitsForListener(t *testing.T) {
	m := newModel(t, binding)
	in := packet.Frame{SrcMAC: peerMAC, TTL: 9, Src: binding.Peer, Dst: binding.Relay, Payload: []byte{1, 2, 3}}
	if res := m.Process(3, in.Marshal()); res.Reason != bpf.RelayReasonREASON_CLIENT_ADDR_UNKNOWN {
		t.Fatalf("before learning: %v", res.Reason)
	}
	m.Process(2, clientFrame("192.0.2.10", packet.ChannelData(0x4000, nil, nil)).Marshal()) // a VIP
	res := m.Process(3, in.Marshal())
	want := packet.Frame{DstMAC: clientMAC, SrcMAC: aMAC, TTL: 8,
		Src: netip.MustParseAddrPort("192.0.2.10:3478"), Dst: binding.Client, Payload: packet.ChannelData(0x4000, []byte{1, 2, 3}, nil)}.Marshal()
	if res.Verdict != model.Redirect || !bytes.Equal(res.Frame, want) {
		t.Fatalf("after learning: %v %v\n got %x\nwant %x", res.Verdict, res.Reason, res.Frame, want)
	}
}

// TestNodePort: a destination the node DNATs to the listener with another
// port (a NodePort) takes the client's ChannelData on that port; the port is
// learned with the address, and the replies leave from both. A port no
// destination translates stays the kernel's.
func TestNodePort(t *testing.T) {
	env := testEnv()
	np := netip.MustParseAddrPort("10.100.0.1:31478")
	env.Destinations[np] = listener
	m, err := model.New(env, []channelmap.Binding{binding})
	if err != nil {
		t.Fatal(err)
	}
	to := func(port uint16) []byte {
		f := clientFrame("10.100.0.1", packet.ChannelData(0x4000, []byte{1}, nil))
		f.Dst = netip.AddrPortFrom(f.Dst.Addr(), port)
		return f.Marshal()
	}
	if res := m.Process(2, to(31479)); res.Reason != bpf.RelayReasonREASON_NOT_OURS || res.Learned != nil {
		t.Fatalf("to a port nothing translates: %v, learned %+v", res.Reason, res.Learned)
	}
	res := m.Process(2, to(np.Port()))
	if res.Verdict != model.Redirect || res.Learned == nil || res.Learned.Addr != np.Addr() || res.Learned.Port != np.Port() {
		t.Fatalf("to the NodePort: %v %v, learned %+v", res.Verdict, res.Reason, res.Learned)
	}
	in := packet.Frame{SrcMAC: peerMAC, TTL: 9, Src: binding.Peer, Dst: binding.Relay, Payload: []byte{1, 2, 3}}
	res = m.Process(3, in.Marshal())
	want := packet.Frame{DstMAC: clientMAC, SrcMAC: aMAC, TTL: 8,
		Src: np, Dst: binding.Client, Payload: packet.ChannelData(0x4000, []byte{1, 2, 3}, nil)}.Marshal()
	if res.Verdict != model.Redirect || !bytes.Equal(res.Frame, want) {
		t.Fatalf("reply: %v %v\n got %x\nwant %x", res.Verdict, res.Reason, res.Frame, want)
	}
	if got := m.Bindings()[0].ReplyFrom(); got != np {
		t.Fatalf("reply source %v, want %v", got, np)
	}
	// Back on the listener's own port: learned again.
	if res := m.Process(2, to(3478)); res.Learned == nil || res.Learned.Port != 3478 {
		t.Fatalf("back to the listener port: learned %+v", res.Learned)
	}
}

// A wrong UDP checksum stays wrong by the same amount; an absent one stays absent.
func TestChecksumErrorCarriedOver(t *testing.T) {
	m := newModel(t, binding)
	in := clientFrame("10.100.0.1", packet.ChannelData(0x4000, []byte("odd"), []byte{1}))
	good := m.Process(2, in.Marshal()).Frame
	if _, err := packet.Parse(good); err != nil {
		t.Fatal(err)
	}
	bad := in.Marshal()
	off := packet.EthLen + packet.IPv4Len + 6
	binary.BigEndian.PutUint16(bad[off:], binary.BigEndian.Uint16(bad[off:])^0x0100)
	if _, err := packet.Parse(m.Process(2, bad).Frame); err == nil {
		t.Fatal("a damaged datagram was relayed with a valid checksum")
	}
	in.NoUDPChecksum = true
	if out := m.Process(2, in.Marshal()).Frame; binary.BigEndian.Uint16(out[off:]) != 0 {
		t.Fatal("an absent checksum was filled in")
	}
}

func TestPassReasons(t *testing.T) {
	cd := packet.ChannelData(0x4000, make([]byte, 10), nil)
	ok := clientFrame("10.100.0.1", cd).Marshal()
	far := binding
	far.Channel, far.Peer, far.Relay = 0x4001, netip.MustParseAddrPort("10.200.0.200:5001"), netip.MustParseAddrPort("10.200.0.1:50001")
	big := binding
	big.Channel, big.Relay = 0x4002, netip.MustParseAddrPort("10.200.0.1:50002")
	big.Peer = netip.MustParseAddrPort("10.200.0.3:5001")
	for _, c := range []struct {
		name    string
		ingress int
		frame   []byte
		reason  bpf.RelayReason
	}{
		{"shorter than ethernet", 2, ok[:13], bpf.RelayReasonREASON_NOT_IP},
		{"empty", 2, nil, bpf.RelayReasonREASON_NOT_IP},
		{"trailer is not the message", 2, clientFrame("10.100.0.1", nil).Marshal(), bpf.RelayReasonREASON_MALFORMED_CHANNEL_DATA},
		{"forwarding off", 9, ok, bpf.RelayReasonREASON_FIB_FWD_DISABLED},
		{"unreachable beats connected", 2, clientFrame("10.100.0.1", packet.ChannelData(0x4001, nil, nil)).Marshal(), bpf.RelayReasonREASON_FIB_NOT_FORWARDED},
		{"mtu before neighbour", 2, clientFrame("10.100.0.1", packet.ChannelData(0x4002, make([]byte, 73), nil)).Marshal(), bpf.RelayReasonREASON_FIB_FRAG_NEEDED},
		{"no neighbour", 2, clientFrame("10.100.0.1", packet.ChannelData(0x4002, nil, nil)).Marshal(), bpf.RelayReasonREASON_FIB_NO_NEIGH},
	} {
		t.Run(c.name, func(t *testing.T) {
			m := newModel(t, binding, far, big)
			res := m.Process(c.ingress, c.frame)
			if res.Verdict != model.Pass || res.Reason != c.reason || !bytes.Equal(res.Frame, c.frame) {
				t.Fatalf("%v %v, want PASS %v untouched", res.Verdict, res.Reason, c.reason)
			}
		})
	}
}

func TestNewRejectsInconsistentBindings(t *testing.T) {
	dup := binding
	dup.Peer = netip.MustParseAddrPort("10.200.0.9:1")
	if _, err := model.New(testEnv(), []channelmap.Binding{binding, dup}); err == nil {
		t.Fatal("two bindings for one client key accepted")
	}
	v6 := binding
	v6.Peer = netip.MustParseAddrPort("[2001:db8::1]:1")
	if _, err := model.New(testEnv(), []channelmap.Binding{v6}); err == nil {
		t.Fatal("an IPv6 peer accepted")
	}
}

// IPv6 clients: a0 has fd00:100::1/64 with the client fd00:100::2 as a
// neighbour; relays and peers stay IPv4.

func testEnv6() model.Env {
	env := testEnv()
	env.Interfaces[0].Addr6 = netip.MustParsePrefix("fd00:100::1/64")
	env.Interfaces[0].Forwarding6 = true
	env.Interfaces[0].Neighbours[netip.MustParseAddr("fd00:100::2")] = clientMAC
	env.Interfaces[1].Forwarding6 = true // b0: no IPv6 address, forwarding on
	env.Unreachable = append(env.Unreachable, netip.MustParsePrefix("fd00:100::8000/113"))
	env.Destinations[netip.MustParseAddrPort("[fd00:100::1]:3478")] = wildcard6
	return env
}

var wildcard6 = netip.MustParseAddrPort("[::]:3478")

var binding6 = channelmap.Binding{
	Client: netip.MustParseAddrPort("[fd00:100::2]:40000"), Listener: wildcard6, Channel: 0x4000,
	Peer: netip.MustParseAddrPort("10.200.0.2:5002"), Relay: netip.MustParseAddrPort("10.200.0.1:50001"),
}

func newModel6(t *testing.T, bs ...channelmap.Binding) *model.Model {
	t.Helper()
	m, err := model.New(testEnv6(), bs)
	if err != nil {
		t.Fatal(err)
	}
	return m
}

func clientFrame6(dst string, payload []byte) packet.Frame {
	return packet.Frame{DstMAC: aMAC, SrcMAC: clientMAC, TTL: 9, TOS: 0xb9, FlowLabel: 0x12345,
		Src: binding6.Client, Dst: netip.AddrPortFrom(netip.MustParseAddr(dst), 3478), Payload: payload}
}

func TestClientToPeerIPv6(t *testing.T) {
	m := newModel6(t, binding6)
	d := []byte("hello from v6")
	in := clientFrame6("fd00:100::1", packet.ChannelData(0x4000, d, []byte{9, 8, 7}))
	in.Trailer = []byte{0xee, 0xee}
	res := m.Process(2, in.Marshal())
	if res.Verdict != model.Redirect || res.Reason != bpf.RelayReasonREASON_RELAY_C2P_REDIRECT {
		t.Fatalf("%v %v, want REDIRECT relay_c2p_redirect", res.Verdict, res.Reason)
	}
	// IPv4 out: TOS = traffic class, ID 0, DF, TTL = hop limit - 1.
	want := packet.Frame{DstMAC: peerMAC, SrcMAC: bMAC, TTL: 8, ID: 0, FragOff: 0x4000, TOS: 0xb9,
		Src: binding6.Relay, Dst: binding6.Peer, Payload: d}.Marshal()
	if !bytes.Equal(res.Frame, want) {
		t.Fatalf("output\n got %x\nwant %x", res.Frame, want)
	}
	if _, err := packet.Parse(res.Frame); err != nil {
		t.Fatal(err)
	}
	if res.Learned == nil || res.Learned.Addr != netip.MustParseAddr("fd00:100::1") {
		t.Fatalf("learned %+v, want fd00:100::1", res.Learned)
	}
	// An absent checksum is illegal on IPv6 (RFC 8200 §8.1): Linux drops it,
	// and so does the program, by passing it.
	in.NoUDPChecksum = true
	if res := m.Process(2, in.Marshal()); res.Verdict != model.Pass || res.Reason != bpf.RelayReasonREASON_NO_CHECKSUM {
		t.Fatalf("IPv6 ChannelData without a checksum: %v %v, want PASS no_checksum", res.Verdict, res.Reason)
	}
	// A wrong one stays wrong.
	in.NoUDPChecksum = false
	bad := in.Marshal()
	off := packet.EthLen + packet.IPv6Len + 6
	binary.BigEndian.PutUint16(bad[off:], binary.BigEndian.Uint16(bad[off:])^0x0100)
	if _, err := packet.Parse(m.Process(2, bad).Frame); err == nil {
		t.Fatal("a damaged IPv6 datagram was relayed with a valid checksum")
	}
}

func TestPeerToClientIPv6(t *testing.T) {
	m := newModel6(t, binding6)
	in := packet.Frame{SrcMAC: peerMAC, TTL: 9, TOS: 0x2e, ID: 77, Src: binding6.Peer, Dst: binding6.Relay, Payload: []byte{1, 2, 3}}
	if res := m.Process(3, in.Marshal()); res.Reason != bpf.RelayReasonREASON_CLIENT_ADDR_UNKNOWN {
		t.Fatalf("before learning: %v", res.Reason)
	}
	// Nothing a listener does not accept is learned: ::, a multicast group,
	// an address beyond the node, an IPv4-mapped one.
	for _, dst := range []string{"::", "ff02::1", "fd00:999::1", "::ffff:10.100.0.1"} {
		res := m.Process(2, clientFrame6(dst, packet.ChannelData(0x4000, nil, nil)).Marshal())
		if res.Learned != nil || res.Reason != bpf.RelayReasonREASON_NOT_LISTENER_ADDR {
			t.Fatalf("packet to %s: %v, learned %v", dst, res.Reason, res.Learned)
		}
	}
	m.Process(2, clientFrame6("fd00:100::1", packet.ChannelData(0x4000, nil, nil)).Marshal())
	res := m.Process(3, in.Marshal())
	want := packet.Frame{DstMAC: clientMAC, SrcMAC: aMAC, TTL: 8, TOS: 0x2e,
		Src: netip.MustParseAddrPort("[fd00:100::1]:3478"), Dst: binding6.Client, Payload: packet.ChannelData(0x4000, []byte{1, 2, 3}, nil)}.Marshal()
	if res.Verdict != model.Redirect || res.Reason != bpf.RelayReasonREASON_RELAY_P2C_REDIRECT || !bytes.Equal(res.Frame, want) {
		t.Fatalf("after learning: %v %v\n got %x\nwant %x", res.Verdict, res.Reason, res.Frame, want)
	}
	p, err := packet.Parse(res.Frame)
	if err != nil || !p.IPv6 || p.TOS != 0x2e || p.FlowLabel != 0 || p.TTL != 8 {
		t.Fatalf("parsed %+v, %v", p, err)
	}
	in.NoUDPChecksum = true
	if res := m.Process(3, in.Marshal()); res.Verdict != model.Pass || res.Reason != bpf.RelayReasonREASON_NO_CHECKSUM {
		t.Fatalf("no checksum: %v %v, want PASS no_checksum", res.Verdict, res.Reason)
	}
}

func TestPassReasonsIPv6(t *testing.T) {
	good := clientFrame6("fd00:100::1", packet.ChannelData(0x4000, make([]byte, 10), nil))
	ok := good.Marshal()
	withExt := func(typ uint8) []byte { f := good; f.Ext = []packet.ExtHeader{packet.Ext(typ)}; return f.Marshal() }
	set := func(off int, v uint16) []byte {
		b := good.Marshal()
		binary.BigEndian.PutUint16(b[off:], v)
		return b
	}
	const ip6, udp6 = packet.EthLen, packet.EthLen + packet.IPv6Len
	icmp := good
	icmp.Proto = 58
	noNeigh := binding6
	noNeigh.Client = netip.MustParseAddrPort("[fd00:100::9]:1")
	unreach := binding6
	unreach.Client, unreach.Peer, unreach.Relay = netip.MustParseAddrPort("[fd00:100::8001]:1"), netip.MustParseAddrPort("10.200.0.2:1"), netip.MustParseAddrPort("10.200.0.1:50009")
	peer := func(b channelmap.Binding, n int) []byte {
		return packet.Frame{SrcMAC: peerMAC, TTL: 64, Src: b.Peer, Dst: b.Relay, Payload: make([]byte, n)}.Marshal()
	}
	noNeigh.ReplySource, unreach.ReplySource = netip.MustParseAddr("fd00:100::1"), netip.MustParseAddr("fd00:100::1")
	noNeigh.Peer, noNeigh.Relay = netip.MustParseAddrPort("10.200.0.2:2"), netip.MustParseAddrPort("10.200.0.1:50010")
	mtu := binding6
	mtu.ReplySource = netip.MustParseAddr("fd00:100::1")
	for _, c := range []struct {
		name    string
		ingress int
		frame   []byte
		reason  bpf.RelayReason
	}{
		{"truncated header", 2, ok[:ip6+39], bpf.RelayReasonREASON_MALFORMED_IP},
		{"version 4", 2, func() []byte { b := good.Marshal(); b[ip6] = 0x40; return b }(), bpf.RelayReasonREASON_MALFORMED_IP},
		{"payload length beyond frame", 2, set(ip6+4, uint16(len(ok)-udp6+1)), bpf.RelayReasonREASON_MALFORMED_IP},
		{"payload length below udp", 2, set(ip6+4, 7), bpf.RelayReasonREASON_MALFORMED_IP},
		{"payload length short: udp length lies", 2, set(ip6+4, uint16(len(ok)-udp6-2)), bpf.RelayReasonREASON_MALFORMED_UDP},
		{"udp length long", 2, set(udp6+4, uint16(len(ok)-udp6+1)), bpf.RelayReasonREASON_MALFORMED_UDP},
		{"hop-by-hop", 2, withExt(0), bpf.RelayReasonREASON_IPV6EXTENSION},
		{"fragment", 2, withExt(44), bpf.RelayReasonREASON_IPV6EXTENSION},
		{"esp", 2, withExt(50), bpf.RelayReasonREASON_IPV6EXTENSION},
		{"icmpv6", 2, icmp.Marshal(), bpf.RelayReasonREASON_NOT_UDP},
		{"forwarding off (IPv4 lookup)", 9, ok, bpf.RelayReasonREASON_FIB_FWD_DISABLED},
		{"ipv6 to a relay port", 2, func() []byte { f := good; f.Dst = netip.MustParseAddrPort("[fd00:100::1]:50001"); return f.Marshal() }(), bpf.RelayReasonREASON_NO_PEER_BINDING},
		{"ipv4-mapped source is no IPv4 client", 2, func() []byte {
			f := good
			f.Src = netip.AddrPortFrom(netip.MustParseAddr("::ffff:10.100.0.2"), 40000)
			f.IPv6 = true
			return f.Marshal()
		}(), bpf.RelayReasonREASON_NO_CHANNEL},
		{"p2c no neighbour", 3, peer(noNeigh, 10), bpf.RelayReasonREASON_FIB_NO_NEIGH},
		{"p2c unreachable", 3, peer(unreach, 10), bpf.RelayReasonREASON_FIB_NOT_FORWARDED},
		{"p2c arriving on the client's interface: TX", 2, peer(mtu, 10), bpf.RelayReasonREASON_RELAY_P2C_TX},
		{"p2c 40+8+4+n above the MTU", 3, peer(mtu, 1500-52+1), bpf.RelayReasonREASON_FIB_FRAG_NEEDED},
	} {
		t.Run(c.name, func(t *testing.T) {
			v4 := binding
			v4.Channel = 0x4009
			m := newModel6(t, mtu, noNeigh, unreach, v4)
			res := m.Process(c.ingress, c.frame)
			if res.Reason != c.reason {
				t.Fatalf("%v %v, want %v", res.Verdict, res.Reason, c.reason)
			}
			if res.Verdict == model.Pass && !bytes.Equal(res.Frame, c.frame) {
				t.Fatal("passed frame changed")
			}
		})
	}
	// The MTU row's neighbour: fits exactly.
	m := newModel6(t, mtu)
	if res := m.Process(3, peer(mtu, 1500-52)); res.Reason != bpf.RelayReasonREASON_RELAY_P2C_REDIRECT {
		t.Fatalf("1448 bytes of data to an IPv6 client: %v", res.Reason)
	}
	env := testEnv6()
	env.Interfaces[1].Forwarding6 = false
	m, _ = model.New(env, []channelmap.Binding{mtu})
	if res := m.Process(3, peer(mtu, 10)); res.Reason != bpf.RelayReasonREASON_FIB_FWD_DISABLED {
		t.Fatalf("IPv6 forwarding off on the peer's ingress: %v", res.Reason)
	}
}

func TestNewIPv6Families(t *testing.T) {
	for _, c := range []struct {
		name string
		edit func(b *channelmap.Binding)
		ok   bool
	}{
		{"ipv6 client", func(b *channelmap.Binding) {}, true},
		{"ipv6 client and reply source", func(b *channelmap.Binding) { b.ReplySource = netip.MustParseAddr("fd00:100::1") }, true},
		{"ipv6 client, ipv4 reply source", func(b *channelmap.Binding) { b.ReplySource = netip.MustParseAddr("10.100.0.1") }, false},
		{"ipv4 client, ipv6 reply source", func(b *channelmap.Binding) {
			b.Client = binding.Client
			b.ReplySource = netip.MustParseAddr("fd00:100::1")
		}, false},
		{"ipv6 relay", func(b *channelmap.Binding) { b.Relay = netip.MustParseAddrPort("[fd00:100::1]:50000") }, false},
		{"ipv6 peer", func(b *channelmap.Binding) { b.Peer = netip.MustParseAddrPort("[fd00:100::3]:5000") }, false},
	} {
		b := binding6
		c.edit(&b)
		if _, err := model.New(testEnv6(), []channelmap.Binding{b}); (err == nil) != c.ok {
			t.Errorf("%s: error %v, want ok=%v", c.name, err, c.ok)
		}
	}
}

// TestListenerIsPartOfTheBinding: one client address:port with a channel 0x4000
// on each of two listeners of one port (issue 9, defect 1): each listener's
// ChannelData goes to its own peer.
func TestListenerIsPartOfTheBinding(t *testing.T) {
	other := binding
	other.Listener = listener2
	other.Peer, other.Relay = netip.MustParseAddrPort("10.200.0.3:5001"), netip.MustParseAddrPort("10.200.0.1:50001")
	env := testEnv()
	env.Interfaces[1].MTU = 1500
	env.Interfaces[1].Neighbours[other.Peer.Addr()] = peerMAC
	m, err := model.New(env, []channelmap.Binding{binding, other})
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		dst  string
		peer netip.AddrPort
	}{{"10.100.0.1", binding.Peer}, {"10.100.0.3", other.Peer}, {"192.0.2.10", binding.Peer}} {
		res := m.Process(2, clientFrame(c.dst, packet.ChannelData(0x4000, []byte("x"), nil)).Marshal())
		p, err := packet.Parse(res.Frame)
		if err != nil || res.Verdict != model.Redirect || p.Dst != c.peer {
			t.Fatalf("to %s: %v %v, out to %v (%v), want %v", c.dst, res.Verdict, res.Reason, p.Dst, err, c.peer)
		}
	}
}

// TestOnlyAcceptedDestinations: ChannelData of a bound client to an address no
// listener accepts (transit: beyond the node) is passed and teaches nothing
// (issue 9, defect 2).
func TestOnlyAcceptedDestinations(t *testing.T) {
	m := newModel(t, binding)
	m.Process(2, clientFrame("10.100.0.1", packet.ChannelData(0x4000, nil, nil)).Marshal())
	for _, dst := range []string{"10.200.0.2", "198.51.100.7", "10.100.0.255", "0.0.0.0", "224.0.0.1"} {
		in := clientFrame(dst, packet.ChannelData(0x4000, []byte("x"), nil)).Marshal()
		res := m.Process(2, in)
		if res.Verdict != model.Pass || res.Reason != bpf.RelayReasonREASON_NOT_LISTENER_ADDR || res.Learned != nil || !bytes.Equal(res.Frame, in) {
			t.Fatalf("to %s: %v %v learned %v", dst, res.Verdict, res.Reason, res.Learned)
		}
	}
	if got := m.Bindings()[0].ReplySource; got != netip.MustParseAddr("10.100.0.1") {
		t.Fatalf("reply source %v after the transit packets, want 10.100.0.1", got)
	}
}

// TestWhatTheKernelWouldNotTake: a bad IPv4 header checksum, an expiring TTL
// (issue 9, defects 5 and 6) pass untouched, in both directions.
func TestWhatTheKernelWouldNotTake(t *testing.T) {
	learned := binding
	learned.ReplySource = netip.MustParseAddr("10.100.0.1")
	env := testEnv()
	env.Interfaces[1].MTU = 1500
	cd := packet.ChannelData(0x4000, []byte("data"), nil)
	for _, c := range []struct {
		name    string
		ingress int
		frame   func() []byte
		reason  bpf.RelayReason
	}{
		{"c2p ttl 1", 2, func() []byte { f := clientFrame("10.100.0.1", cd); f.TTL = 1; return f.Marshal() }, bpf.RelayReasonREASON_TTL_EXPIRED},
		{"c2p ttl 0", 2, func() []byte { f := clientFrame("10.100.0.1", cd); f.TTL = 0; return f.Marshal() }, bpf.RelayReasonREASON_TTL_EXPIRED},
		{"c2p bad ip checksum", 2, func() []byte {
			b := clientFrame("10.100.0.1", cd).Marshal()
			b[packet.EthLen+10] ^= 0x40
			return b
		}, bpf.RelayReasonREASON_BAD_IP_CHECKSUM},
		{"p2c ttl 1", 3, func() []byte {
			return packet.Frame{SrcMAC: peerMAC, TTL: 1, Src: binding.Peer, Dst: binding.Relay, Payload: []byte{1}}.Marshal()
		}, bpf.RelayReasonREASON_TTL_EXPIRED},
		{"p2c bad ip checksum", 3, func() []byte {
			b := packet.Frame{SrcMAC: peerMAC, TTL: 9, Src: binding.Peer, Dst: binding.Relay, Payload: []byte{1}}.Marshal()
			b[packet.EthLen+11] ^= 0x01
			return b
		}, bpf.RelayReasonREASON_BAD_IP_CHECKSUM},
	} {
		m, err := model.New(env, []channelmap.Binding{learned})
		if err != nil {
			t.Fatal(err)
		}
		in := c.frame()
		if res := m.Process(c.ingress, in); res.Verdict != model.Pass || res.Reason != c.reason || !bytes.Equal(res.Frame, in) || res.Learned != nil {
			t.Errorf("%s: %v %v, want PASS %v untouched", c.name, res.Verdict, res.Reason, c.reason)
		}
	}
	// A TTL of 2 leaves as 1.
	m, _ := model.New(env, []channelmap.Binding{learned})
	f := clientFrame("10.100.0.1", cd)
	f.TTL = 2
	if p, err := packet.Parse(m.Process(2, f.Marshal()).Frame); err != nil || p.TTL != 1 {
		t.Fatalf("TTL 2: out %+v %v, want TTL 1", p, err)
	}
}

// TestPartialChecksum: a datagram whose checksum field holds the folded
// pseudo-header sum (CHECKSUM_PARTIAL from a veth sender with tx offload) is
// relayed with a full, correct checksum, both ways (issue 9, defect 4).
func TestPartialChecksum(t *testing.T) {
	learned := binding
	learned.ReplySource = netip.MustParseAddr("10.100.0.1")
	env := testEnv()
	env.Interfaces[1].MTU = 1500
	m, err := model.New(env, []channelmap.Binding{learned})
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range []int{0, 1, 2, 3, 4, 5, 63, 64, 511, 512, 513, 1200} {
		c2p := clientFrame("10.100.0.1", packet.ChannelData(0x4000, make([]byte, n), []byte{7, 7, 7}[:(4-n%4)%4]))
		c2p.PartialChecksum = true
		p2c := packet.Frame{SrcMAC: peerMAC, TTL: 9, Src: binding.Peer, Dst: binding.Relay, Payload: make([]byte, n), PartialChecksum: true}
		for _, f := range []packet.Frame{c2p, p2c} {
			in := f.Marshal()
			if _, err := packet.Parse(in); err == nil {
				t.Fatalf("%d bytes: the partial input verifies; the test frame is not partial", n)
			}
			ingress := 2
			if f.Src == binding.Peer {
				ingress = 3
			}
			res := m.Process(ingress, in)
			if res.Verdict == model.Pass {
				t.Fatalf("%d bytes: passed (%v)", n, res.Reason)
			}
			if _, err := packet.Parse(res.Frame); err != nil {
				t.Fatalf("%d bytes from %v: relayed with a bad checksum: %v", n, f.Src, err)
			}
		}
	}
}

// TestGatewayRouteAndInterfaceDown: a more specific route through a gateway
// sends to the gateway's MAC on its interface; an interface that is down has
// no routes, so nothing leaves through it.
func TestGatewayRouteAndInterfaceDown(t *testing.T) {
	gwMAC := [6]byte{2, 0, 0, 0, 0x10, 3}
	env := testEnv()
	env.Interfaces[0].Neighbours[netip.MustParseAddr("10.100.0.3")] = gwMAC
	env.Routes = []model.Route{{Dst: netip.MustParsePrefix("10.200.0.2/32"), Via: netip.MustParseAddr("10.100.0.3")}}
	m, err := model.New(env, []channelmap.Binding{binding})
	if err != nil {
		t.Fatal(err)
	}
	in := clientFrame("10.100.0.1", packet.ChannelData(0x4000, []byte("hi"), nil)).Marshal()
	res := m.Process(2, in)
	if res.Verdict != model.TX || len(res.Frame) < 12 || [6]byte(res.Frame[:6]) != gwMAC || [6]byte(res.Frame[6:12]) != aMAC {
		t.Fatalf("through the gateway: %v %v, frame %x", res.Verdict, res.Reason, res.Frame)
	}
	env.Routes = nil
	env.Interfaces[1].Down = true
	m.SetEnv(env)
	if res := m.Process(2, in); res.Verdict != model.Pass || res.Reason != bpf.RelayReasonREASON_FIB_NOT_FORWARDED {
		t.Fatalf("egress down: %v %v, want PASS pass_fib_not_forwarded", res.Verdict, res.Reason)
	}
}

// TestEgressThatCannotTakeXDPFrames: from a native ingress, a redirect needs an
// egress that transmits XDP frames and XDP_TX an ingress that does; from a
// generic one the skb path takes either; nothing known is the worst case.
func TestEgressThatCannotTakeXDPFrames(t *testing.T) {
	peer2 := netip.MustParseAddr("10.100.0.4")
	txBinding := channelmap.Binding{Client: binding.Client, Listener: listener, Channel: 0x4001,
		Peer: netip.AddrPortFrom(peer2, 5002), Relay: netip.MustParseAddrPort("10.100.0.1:50001")}
	for _, c := range []struct {
		name   string
		edit   func(env *model.Env)
		b      channelmap.Binding
		want   model.Verdict
		reason bpf.RelayReason
	}{
		{"redirect, egress transmits", func(*model.Env) {}, binding, model.Redirect, bpf.RelayReasonREASON_RELAY_C2P_REDIRECT},
		{"redirect, egress does not transmit", func(env *model.Env) { env.Interfaces[1].Caps.XDPXmit = false },
			binding, model.Pass, bpf.RelayReasonREASON_EGRESS_NO_XDP_XMIT},
		{"redirect, nothing known of the egress", func(env *model.Env) { env.Interfaces[1].Caps = nil },
			binding, model.Pass, bpf.RelayReasonREASON_EGRESS_NO_XDP_XMIT},
		{"redirect, nothing known of the ingress", func(env *model.Env) { env.Interfaces[0].Caps = nil },
			binding, model.Redirect, bpf.RelayReasonREASON_RELAY_C2P_REDIRECT},
		{"redirect from a generic ingress, egress does not transmit", func(env *model.Env) {
			env.Interfaces[0].Caps = &model.DevCaps{Generic: true, MTU: 1500}
			env.Interfaces[1].Caps.XDPXmit = false
		}, binding, model.Redirect, bpf.RelayReasonREASON_RELAY_C2P_REDIRECT},
		{"XDP_TX, ingress transmits", func(*model.Env) {}, txBinding, model.TX, bpf.RelayReasonREASON_RELAY_C2P_TX},
		{"XDP_TX, ingress does not transmit", func(env *model.Env) { env.Interfaces[0].Caps.XDPTX = false },
			txBinding, model.Pass, bpf.RelayReasonREASON_EGRESS_NO_XDP_XMIT},
		{"XDP_TX, the ingress's XDPXmit does not count", func(env *model.Env) {
			env.Interfaces[0].Caps.XDPTX, env.Interfaces[0].Caps.XDPXmit = false, true
		}, txBinding, model.Pass, bpf.RelayReasonREASON_EGRESS_NO_XDP_XMIT},
		{"XDP_TX, nothing known of the ingress", func(env *model.Env) { env.Interfaces[0].Caps = nil },
			txBinding, model.Pass, bpf.RelayReasonREASON_EGRESS_NO_XDP_XMIT},
		{"XDP_TX from a generic ingress", func(env *model.Env) { env.Interfaces[0].Caps = &model.DevCaps{Generic: true, MTU: 1500} },
			txBinding, model.TX, bpf.RelayReasonREASON_RELAY_C2P_TX},
	} {
		t.Run(c.name, func(t *testing.T) {
			env := testEnv()
			env.Interfaces[0].Neighbours[peer2] = peerMAC
			c.edit(&env)
			m, err := model.New(env, []channelmap.Binding{c.b})
			if err != nil {
				t.Fatal(err)
			}
			in := clientFrame("10.100.0.1", packet.ChannelData(c.b.Channel, []byte("data"), nil)).Marshal()
			res := m.Process(2, in)
			if res.Verdict != c.want || res.Reason != c.reason {
				t.Fatalf("%v %d, want %v %d", res.Verdict, res.Reason, c.want, c.reason)
			}
			if c.want == model.Pass && (!bytes.Equal(res.Frame, in) || res.Counted != nil) {
				t.Fatalf("a passed frame is the input, counted nowhere: %x counted %v", res.Frame, res.Counted)
			}
		})
	}
}

// TestIngressOverMTU: only packets above MTUCheckAbove are measured, against
// the ingress's MTU; with nothing known of the ingress, all of them pass.
func TestIngressOverMTU(t *testing.T) {
	for _, c := range []struct {
		name    string
		ipLen   int
		caps    *model.DevCaps
		overMTU bool
	}{
		{"1500 bytes, nothing known", 1500, nil, false},
		{"1501 bytes, nothing known", 1501, nil, true},
		{"1501 bytes, MTU 1500", 1501, nativeCaps(1500), true},
		{"1600 bytes, MTU 9000", 1600, nativeCaps(9000), false},
		{"1600 bytes, MTU 1600", 1600, nativeCaps(1600), false},
		{"1601 bytes, MTU 1600", 1601, nativeCaps(1600), true},
	} {
		t.Run(c.name, func(t *testing.T) {
			env := testEnv()
			env.Interfaces[0].Caps = c.caps
			m, err := model.New(env, []channelmap.Binding{binding})
			if err != nil {
				t.Fatal(err)
			}
			in := clientFrame("10.100.0.1", packet.ChannelData(0x4000, make([]byte, c.ipLen-20-8-4), nil)).Marshal()
			res := m.Process(2, in)
			if got := res.Reason == bpf.RelayReasonREASON_INGRESS_OVER_MTU; got != c.overMTU || res.Verdict != model.Pass {
				t.Fatalf("%v %d; want over the MTU: %v", res.Verdict, res.Reason, c.overMTU)
			}
			// The same from the peer's side.
			p := packet.Frame{DstMAC: bMAC, SrcMAC: peerMAC, TTL: 9, Src: binding.Peer, Dst: binding.Relay,
				Payload: make([]byte, c.ipLen-20-8)}.Marshal()
			m.SetEnv(func() model.Env { e := testEnv(); e.Interfaces[1].Caps = c.caps; return e }())
			if res := m.Process(3, p); (res.Reason == bpf.RelayReasonREASON_INGRESS_OVER_MTU) != c.overMTU {
				t.Fatalf("peer->client: %v %d; want over the MTU: %v", res.Verdict, res.Reason, c.overMTU)
			}
		})
	}
}

// TestReversePath: rule 11. The client's way back is a; the same datagram
// arriving on b is what the stack's strict filter drops, and it teaches
// nothing; loose takes it (a way back exists), but not from a client without
// a route back; IPv6 is never checked; with lo's forwarding off the lookup
// cannot be made.
func TestReversePath(t *testing.T) {
	rp := func(a, b model.RPFilter, loFwd bool) model.Env {
		env := testEnv()
		env.LoopbackForwarding = loFwd
		for i, mode := range []model.RPFilter{a, b} {
			c := *env.Interfaces[i].Caps
			c.RPFilter = mode
			env.Interfaces[i].Caps = &c
		}
		return env
	}
	stray := binding
	stray.Client = netip.MustParseAddrPort("198.51.100.7:40000") // no route back
	stray.Peer, stray.Relay = netip.MustParseAddrPort("10.200.0.2:5002"), netip.MustParseAddrPort("10.200.0.1:50001")
	in := clientFrame("10.100.0.1", packet.ChannelData(0x4000, []byte("hi"), nil)).Marshal()
	strayIn := clientFrame("10.100.0.1", packet.ChannelData(0x4000, []byte("hi"), nil))
	strayIn.Src = stray.Client
	for _, c := range []struct {
		name    string
		env     model.Env
		ingress int
		frame   []byte
		want    bpf.RelayReason
	}{
		{"strict/right-device", rp(model.RPStrict, model.RPStrict, true), 2, in, bpf.RelayReasonREASON_RELAY_C2P_REDIRECT},
		{"strict/other-device", rp(model.RPStrict, model.RPStrict, true), 3, in, bpf.RelayReasonREASON_RP_FILTER},
		{"off/other-device", rp(model.RPStrict, model.RPOff, true), 3, in, bpf.RelayReasonREASON_RELAY_C2P_TX},
		{"loose/other-device", rp(model.RPOff, model.RPLoose, true), 3, in, bpf.RelayReasonREASON_RELAY_C2P_TX},
		{"loose/no-route-back", rp(model.RPLoose, model.RPOff, true), 2, strayIn.Marshal(), bpf.RelayReasonREASON_RP_FILTER},
		{"off/no-route-back", rp(model.RPOff, model.RPOff, true), 2, strayIn.Marshal(), bpf.RelayReasonREASON_RELAY_C2P_REDIRECT},
		{"strict/lo-forwarding-off", rp(model.RPStrict, model.RPOff, false), 2, in, bpf.RelayReasonREASON_RP_UNCHECKED},
	} {
		t.Run(c.name, func(t *testing.T) {
			m, err := model.New(c.env, []channelmap.Binding{binding, stray})
			if err != nil {
				t.Fatal(err)
			}
			res := m.Process(c.ingress, c.frame)
			if res.Reason != c.want {
				t.Fatalf("%v, want %v", res.Reason, c.want)
			}
			filtered := c.want == bpf.RelayReasonREASON_RP_FILTER || c.want == bpf.RelayReasonREASON_RP_UNCHECKED
			if filtered && (res.Learned != nil || res.Verdict != model.Pass || !bytes.Equal(res.Frame, c.frame)) {
				t.Errorf("filtered, yet %v, learned %v", res.Verdict, res.Learned)
			}
		})
	}
}
