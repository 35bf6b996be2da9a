package bpf_test

import (
	"encoding/binary"
	"fmt"
	"testing"

	"github.com/l7mp/stunnerd-xdp/bpf"
	"github.com/l7mp/stunnerd-xdp/internal/packet"
)

// TestHostileInput: frames an attacker or a broken stack can send, each with the
// verdict and reason it must get. What the program does not own passes
// untouched; the few hostile-looking frames that are valid (TTL 1, trailing
// bytes after a consistent IP packet) are relayed. The model must agree on
// every row. (The well-formed relays and the next-hop outcomes are in
// TestGoldenPackets.)
func TestHostileInput(t *testing.T) {
	e := newEnv(t)
	m := e.install(t)
	runTable(t, e, m, hostileCases(e))
}

// Offsets into an option-less frame.
const (
	offIP     = packet.EthLen
	offTotLen = offIP + 2
	offUDP    = offIP + packet.IPv4Len
	offUDPLen = offUDP + 4
	offCD     = offUDP + packet.UDPLen
)

func hostileCases(e *env) []golden {
	var cases []golden
	pass := func(name, ingress string, in []byte, reason bpf.RelayReason) {
		cases = append(cases, golden{name: name, ingress: ingress, in: in, verdict: xdpPass, reason: reason})
	}
	redirect := bindings["redirect"]
	b0 := e.ifaces["b0"]
	good := fromClient(redirect, "10.100.0.1", packet.ChannelData(redirect.Channel, data(100), nil))
	// edit returns a copy of the good frame with f applied to its bytes.
	edit := func(f func(b []byte) []byte) []byte { return f(good.Marshal()) }

	// Link layer. BPF_PROG_RUN refuses frames shorter than an Ethernet header,
	// so those are covered by the model's own tests only.
	pass("eth/header-only", "a0", good.Marshal()[:packet.EthLen], bpf.RelayReasonREASON_MALFORMED_IP)
	pass("eth/ipv6-ethertype", "a0", edit(func(b []byte) []byte {
		binary.BigEndian.PutUint16(b[12:], 0x86DD)
		return b
	}), bpf.RelayReasonREASON_NOT_IPV4)
	pass("eth/vlan-tagged", "a0", edit(func(b []byte) []byte {
		return append(append(append([]byte{}, b[:12]...), 0x81, 0x00, 0x00, 0x64), b[12:]...)
	}), bpf.RelayReasonREASON_NOT_IPV4)
	pass("eth/qinq-tagged", "a0", edit(func(b []byte) []byte {
		return append(append(append([]byte{}, b[:12]...), 0x88, 0xa8, 0x00, 0x64, 0x81, 0x00, 0x00, 0x65), b[12:]...)
	}), bpf.RelayReasonREASON_NOT_IPV4)
	pass("eth/ipv6-hop-by-hop-udp-channel-data", "a0", ipv6ChannelData(redirect.Channel, data(16)), bpf.RelayReasonREASON_NOT_IPV4)

	// IPv4 header.
	pass("ip/truncated-header", "a0", good.Marshal()[:offIP+19], bpf.RelayReasonREASON_MALFORMED_IP)
	pass("ip/version-6-under-ipv4-ethertype", "a0", edit(func(b []byte) []byte { b[offIP] = 0x65; return b }), bpf.RelayReasonREASON_MALFORMED_IP)
	pass("ip/ihl-4", "a0", edit(func(b []byte) []byte { b[offIP] = 0x44; return b }), bpf.RelayReasonREASON_MALFORMED_IP)
	pass("ip/ihl-0", "a0", edit(func(b []byte) []byte { b[offIP] = 0x40; return b }), bpf.RelayReasonREASON_MALFORMED_IP)
	// IHL 15 claims 60 bytes of header in a frame that ends after 20: it has
	// options either way, and options are the kernel's.
	pass("ip/ihl-15-beyond-frame", "a0", edit(func(b []byte) []byte { b[offIP] = 0x4f; return b[:offUDP] }), bpf.RelayReasonREASON_IP_OPTIONS)
	pass("ip/ihl-15-beyond-total-length", "a0", edit(func(b []byte) []byte {
		b[offIP] = 0x4f
		binary.BigEndian.PutUint16(b[offTotLen:], 40)
		return b
	}), bpf.RelayReasonREASON_IP_OPTIONS)
	f := good
	f.Options = []byte{0x01, 0x01, 0x01, 0x00} // NOPs and end of options
	pass("ip/options", "a0", f.Marshal(), bpf.RelayReasonREASON_IP_OPTIONS)
	f = good
	f.Proto = 6
	pass("ip/tcp", "a0", f.Marshal(), bpf.RelayReasonREASON_NOT_UDP)
	f = good
	f.FragOff = 0x2000 // MF: first fragment
	pass("ip/fragment-first", "a0", f.Marshal(), bpf.RelayReasonREASON_IP_FRAGMENT)
	f = good
	f.FragOff = 0x0010 // a later fragment
	pass("ip/fragment-later", "a0", f.Marshal(), bpf.RelayReasonREASON_IP_FRAGMENT)
	f = good
	f.FragOff = 0x4010 // DF and an offset: still a fragment
	pass("ip/fragment-later-df", "a0", f.Marshal(), bpf.RelayReasonREASON_IP_FRAGMENT)
	pass("ip/total-length-beyond-frame", "a0", edit(func(b []byte) []byte {
		binary.BigEndian.PutUint16(b[offTotLen:], uint16(len(b)-offIP+1))
		return b
	}), bpf.RelayReasonREASON_MALFORMED_IP)
	pass("ip/total-length-below-udp", "a0", edit(func(b []byte) []byte {
		binary.BigEndian.PutUint16(b[offTotLen:], 27)
		return b
	}), bpf.RelayReasonREASON_MALFORMED_IP)
	pass("ip/total-length-below-udp-header-frame-cut", "a0", edit(func(b []byte) []byte {
		binary.BigEndian.PutUint16(b[offTotLen:], packet.IPv4Len+4)
		return b[:offUDP+4]
	}), bpf.RelayReasonREASON_MALFORMED_IP)
	pass("ip/udp-header-cut-by-frame-end", "a0", good.Marshal()[:offUDP+4], bpf.RelayReasonREASON_MALFORMED_IP)
	// A total length shorter than the frame makes the rest an Ethernet trailer:
	// then the UDP length no longer agrees, or the ChannelData no longer fits.
	pass("ip/total-length-shorter-than-frame", "a0", edit(func(b []byte) []byte {
		binary.BigEndian.PutUint16(b[offTotLen:], uint16(len(b)-offIP-4))
		return b
	}), bpf.RelayReasonREASON_MALFORMED_UDP)
	pass("ip/total-length-and-udp-length-cut-the-data", "a0", edit(func(b []byte) []byte {
		binary.BigEndian.PutUint16(b[offTotLen:], uint16(len(b)-offIP-4))
		binary.BigEndian.PutUint16(b[offUDPLen:], uint16(len(b)-offUDP-4))
		return b
	}), bpf.RelayReasonREASON_MALFORMED_CHANNEL_DATA)

	// UDP header.
	pass("udp/length-short", "a0", edit(func(b []byte) []byte {
		binary.BigEndian.PutUint16(b[offUDPLen:], uint16(packet.UDPLen+len(good.Payload)-4))
		return b
	}), bpf.RelayReasonREASON_MALFORMED_UDP)
	pass("udp/length-long", "a0", edit(func(b []byte) []byte {
		binary.BigEndian.PutUint16(b[offUDPLen:], uint16(packet.UDPLen+len(good.Payload)+4))
		return b
	}), bpf.RelayReasonREASON_MALFORMED_UDP)
	pass("udp/length-below-header", "a0", edit(func(b []byte) []byte {
		binary.BigEndian.PutUint16(b[offUDPLen:], 4)
		return b
	}), bpf.RelayReasonREASON_MALFORMED_UDP)
	f = good
	f.Dst = ap("10.100.0.1:3479")
	pass("udp/not-ours/other-port", "a0", f.Marshal(), bpf.RelayReasonREASON_NOT_OURS)
	f = good
	f.Dst = ap("10.200.0.1:49151")
	pass("udp/not-ours/below-relay-range", "b0", f.Marshal(), bpf.RelayReasonREASON_NOT_OURS)

	// ChannelData on the listener port (RFC 8656 §12.4-12.5).
	withPayload := func(p []byte) []byte { f := good; f.Payload = p; return f.Marshal() }
	pass("cd/stun-binding-request", "a0", withPayload([]byte{0x00, 0x01, 0x00, 0x00, 0x21, 0x12, 0xA4, 0x42,
		1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}), bpf.RelayReasonREASON_STUN)
	pass("cd/channel-0x3fff-is-stun-space", "a0", withPayload(packet.ChannelData(0x3FFF, data(10), nil)), bpf.RelayReasonREASON_STUN)
	pass("cd/channel-0x8000", "a0", withPayload(packet.ChannelData(0x8000, data(10), nil)), bpf.RelayReasonREASON_STUN)
	pass("cd/channel-0xc000", "a0", withPayload(packet.ChannelData(0xC000, data(10), nil)), bpf.RelayReasonREASON_STUN)
	pass("cd/empty-payload", "a0", withPayload(nil), bpf.RelayReasonREASON_MALFORMED_CHANNEL_DATA)
	pass("cd/short-header", "a0", withPayload([]byte{0x40, 0x00, 0x00}), bpf.RelayReasonREASON_MALFORMED_CHANNEL_DATA)
	pass("cd/length-beyond-payload", "a0", withPayload(append(packet.ChannelData(redirect.Channel, data(10), nil)[:4], data(9)...)),
		bpf.RelayReasonREASON_MALFORMED_CHANNEL_DATA)
	pass("cd/length-0xffff", "a0", withPayload(append([]byte{0x40, 0x00, 0xff, 0xff}, data(10)...)), bpf.RelayReasonREASON_MALFORMED_CHANNEL_DATA)
	for _, n := range []int{4, 5, 100} {
		pass(fmt.Sprintf("cd/padding-%d", n), "a0", withPayload(packet.ChannelData(redirect.Channel, data(10), make([]byte, n))),
			bpf.RelayReasonREASON_MALFORMED_CHANNEL_DATA)
	}
	pass("cd/zero-length-padding-4", "a0", withPayload(packet.ChannelData(redirect.Channel, nil, make([]byte, 4))),
		bpf.RelayReasonREASON_MALFORMED_CHANNEL_DATA)
	// A short ChannelData followed by an Ethernet trailer: only the datagram
	// counts, never the bytes after it.
	f = good
	f.Payload = []byte{0x40, 0x00}
	f.Trailer = []byte{0x40, 0x00, 0x00, 0x00, 0, 0, 0, 0}
	pass("cd/short-header-then-trailer", "a0", f.Marshal(), bpf.RelayReasonREASON_MALFORMED_CHANNEL_DATA)
	f.Payload, f.Trailer = nil, make([]byte, 18)
	pass("cd/empty-then-zero-trailer", "a0", f.Marshal(), bpf.RelayReasonREASON_MALFORMED_CHANNEL_DATA)

	// Bindings.
	for _, ch := range []uint16{0x4FFF, 0x5000, 0x7FFF} { // 0x5000-0x7FFF: reserved by RFC 8656, pion binds them
		pass(fmt.Sprintf("binding/unbound-channel-%#04x", ch), "a0", withPayload(packet.ChannelData(ch, data(10), nil)), bpf.RelayReasonREASON_NO_CHANNEL)
	}
	f = good
	f.Src = ap("10.100.0.2:40009")
	pass("binding/other-client-port", "a0", f.Marshal(), bpf.RelayReasonREASON_NO_CHANNEL)
	f = good
	f.Src = ap("10.100.0.9:40000")
	pass("binding/other-client-address", "a0", f.Marshal(), bpf.RelayReasonREASON_NO_CHANNEL)
	p := fromPeer(redirect, data(10))
	p.Src = ap("10.200.0.2:5009")
	pass("binding/peer-right-ip-wrong-port", "b0", p.Marshal(), bpf.RelayReasonREASON_NO_PEER_BINDING)
	p = fromPeer(redirect, data(10))
	p.Src = ap("10.200.0.77:5001")
	pass("binding/unbound-peer-to-relay-port", "b0", p.Marshal(), bpf.RelayReasonREASON_NO_PEER_BINDING)
	p = fromPeer(redirect, data(10))
	p.Dst = ap("10.200.0.99:50000")
	pass("binding/peer-to-other-local-address", "b0", p.Marshal(), bpf.RelayReasonREASON_NO_PEER_BINDING)
	p = fromPeer(redirect, data(10))
	p.Dst = ap("10.200.0.1:50001")
	pass("binding/peer-to-other-relay-port", "b0", p.Marshal(), bpf.RelayReasonREASON_NO_PEER_BINDING)

	// Valid although unusual: relayed, as pion/turn would.
	for _, ttl := range []uint8{0, 1} {
		// The relay originates the packet (TTL 64); it does not forward it.
		in := fromClient(redirect, "10.100.0.1", packet.ChannelData(redirect.Channel, data(20), nil))
		in.TTL = ttl
		cases = append(cases, golden{name: fmt.Sprintf("relay/c2p-ttl-%d", ttl), ingress: "a0", in: in.Marshal(),
			verdict: xdpRedirect, reason: bpf.RelayReasonREASON_RELAY_C2P_REDIRECT,
			out: toPeer(in, redirect, b0.mac, peerMAC, data(20)).Marshal()})
	}
	{
		// Padding that does not round to 4 is still at most 3 bytes: dropped.
		in := fromClient(redirect, "10.100.0.1", packet.ChannelData(redirect.Channel, data(4), []byte{1, 2, 3}))
		cases = append(cases, golden{name: "relay/c2p-unaligned-padding", ingress: "a0", in: in.Marshal(),
			verdict: xdpRedirect, reason: bpf.RelayReasonREASON_RELAY_C2P_REDIRECT,
			out: toPeer(in, redirect, b0.mac, peerMAC, data(4)).Marshal()})
	}
	{
		// A peer datagram that looks like STUN or ChannelData is just data.
		in := fromPeer(redirect, packet.ChannelData(0x4000, data(8), nil))
		cases = append(cases, golden{name: "relay/p2c-payload-looks-like-channel-data", ingress: "b0", in: in.Marshal(),
			verdict: xdpRedirect, reason: bpf.RelayReasonREASON_RELAY_P2C_REDIRECT,
			out: toClient(in, redirect, redirect.ListenerAddr, e.ifaces["a0"].mac, clientMAC, in.Payload).Marshal()})
	}
	return cases
}

// ipv6ChannelData is an IPv6 frame with a hop-by-hop extension header in front
// of UDP to the listener port carrying ChannelData: IPv6 is not in the program.
func ipv6ChannelData(channel uint16, d []byte) []byte {
	cd := packet.ChannelData(channel, d, nil)
	udp := make([]byte, 8+len(cd))
	binary.BigEndian.PutUint16(udp[0:], 40000)
	binary.BigEndian.PutUint16(udp[2:], listenerPort)
	binary.BigEndian.PutUint16(udp[4:], uint16(len(udp)))
	copy(udp[8:], cd)
	hbh := []byte{17, 0, 1, 4, 0, 0, 0, 0} // next header UDP, PadN
	ip := make([]byte, 40)
	ip[0] = 0x60
	binary.BigEndian.PutUint16(ip[4:], uint16(len(hbh)+len(udp)))
	ip[6], ip[7] = 0, 64 // next header hop-by-hop, hop limit
	copy(ip[8:24], []byte{0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2})
	copy(ip[24:40], []byte{0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1})
	frame := append([]byte{0x02, 0xaa, 0, 0, 0, 0, 0x02, 0, 0, 0, 0x10, 0x02, 0x86, 0xdd}, ip...)
	return append(append(frame, hbh...), udp...)
}

// TestChecksumErrorCarriedOver: a datagram whose UDP checksum was already wrong
// when it arrived must arrive wrong at the other end, by the same amount; the
// relay must not launder it into a valid one.
func TestChecksumErrorCarriedOver(t *testing.T) {
	e := newEnv(t)
	m := e.install(t)
	redirect := bindings["redirect"]
	for _, dir := range []struct {
		name, ingress string
		in            packet.Frame
	}{
		{"c2p", "a0", fromClient(redirect, "10.100.0.1", packet.ChannelData(redirect.Channel, data(33), []byte{7, 7, 7}))},
		{"p2c", "b0", fromPeer(redirect, data(33))},
	} {
		t.Run(dir.name, func(t *testing.T) {
			good := dir.in.Marshal()
			gotGood, _ := e.check(t, m, dir.ingress, good)
			bad := append([]byte{}, good...)
			cs := binary.BigEndian.Uint16(bad[offUDP+6:])
			binary.BigEndian.PutUint16(bad[offUDP+6:], onesAdd(cs, 1))
			gotBad, _ := e.check(t, m, dir.ingress, bad)
			if gotGood.verdict != xdpRedirect || gotBad.verdict != xdpRedirect {
				t.Fatalf("verdicts %d and %d, want REDIRECT", gotGood.verdict, gotBad.verdict)
			}
			want := onesAdd(binary.BigEndian.Uint16(gotGood.out[offUDP+6:]), 1)
			if got := binary.BigEndian.Uint16(gotBad.out[offUDP+6:]); got != want {
				t.Fatalf("checksum %#04x, want %#04x (the good one's plus the same error)", got, want)
			}
			if _, err := packet.Parse(gotBad.out); err == nil {
				t.Fatalf("a damaged datagram left the relay with a valid checksum")
			}
		})
	}
}

// onesAdd is ones' complement addition of 16-bit words.
func onesAdd(a, b uint16) uint16 {
	s := uint32(a) + uint32(b)
	return uint16(s&0xffff + s>>16)
}
