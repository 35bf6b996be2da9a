package bpf_test

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"testing"

	"github.com/l7mp/stunnerd-xdp/bpf"
	"github.com/l7mp/stunnerd-xdp/test/model"
	"github.com/l7mp/stunnerd-xdp/test/packet"
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
	// An IPv4 packet under the IPv6 ethertype: version 4 is no IPv6 header.
	pass("eth/ipv4-under-ipv6-ethertype", "a0", edit(func(b []byte) []byte {
		binary.BigEndian.PutUint16(b[12:], 0x86DD)
		return b
	}), bpf.RelayReasonREASON_MALFORMED_IP)
	pass("eth/vlan-tagged", "a0", edit(func(b []byte) []byte {
		return append(append(append([]byte{}, b[:12]...), 0x81, 0x00, 0x00, 0x64), b[12:]...)
	}), bpf.RelayReasonREASON_NOT_IP)
	pass("eth/qinq-tagged", "a0", edit(func(b []byte) []byte {
		return append(append(append([]byte{}, b[:12]...), 0x88, 0xa8, 0x00, 0x64, 0x81, 0x00, 0x00, 0x65), b[12:]...)
	}), bpf.RelayReasonREASON_NOT_IP)
	pass("eth/ipv6-hop-by-hop-udp-channel-data", "a0", ipv6ChannelData(redirect.Channel, data(16)), bpf.RelayReasonREASON_IPV6EXTENSION)
	pass("eth/arp", "a0", edit(func(b []byte) []byte {
		binary.BigEndian.PutUint16(b[12:], 0x0806)
		return b
	}), bpf.RelayReasonREASON_NOT_IP)

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

	// What would leave with TTL 0: pion/turn's (it relays with its own TTL).
	for _, ttl := range []uint8{0, 1} {
		in := fromClient(redirect, "10.100.0.1", packet.ChannelData(redirect.Channel, data(20), nil))
		in.TTL = ttl
		pass(fmt.Sprintf("ttl/c2p-%d", ttl), "a0", in.Marshal(), bpf.RelayReasonREASON_TTL_EXPIRED)
		p := fromPeer(redirect, data(20))
		p.TTL = ttl
		pass(fmt.Sprintf("ttl/p2c-%d", ttl), "b0", p.Marshal(), bpf.RelayReasonREASON_TTL_EXPIRED)
	}
	{
		// A TTL of 2 leaves as 1.
		in := fromClient(redirect, "10.100.0.1", packet.ChannelData(redirect.Channel, data(20), nil))
		in.TTL = 2
		cases = append(cases, golden{name: "relay/c2p-ttl-2", ingress: "a0", in: in.Marshal(),
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
			out: toClient(in, redirect, redirect.ReplySource, e.ifaces["a0"].mac, clientMAC, in.Payload).Marshal()})
	}
	return append(cases, hostileCases6(e)...)
}

// Offsets into an IPv6 frame without extension headers.
const (
	offPlen6   = offIP + 4
	offNH6     = offIP + 6
	offUDP6    = offIP + packet.IPv6Len
	offUDPLen6 = offUDP6 + 4
	offUDPCs6  = offUDP6 + 6
)

// hostileCases6 are the hostile rows for IPv6: the same attacks on the IPv6
// header, extension headers, and what crosses the families.
func hostileCases6(e *env) []golden {
	var cases []golden
	pass := func(name, ingress string, in []byte, reason bpf.RelayReason) {
		cases = append(cases, golden{name: "v6/" + name, ingress: ingress, in: in, verdict: xdpPass, reason: reason})
	}
	redirect := bindings["v6redirect"]
	good := fromClient(redirect, "fd00:100::1", packet.ChannelData(redirect.Channel, data(100), nil))
	edit := func(f func(b []byte) []byte) []byte { return f(good.Marshal()) }
	set16 := func(off int, v uint16) []byte {
		return edit(func(b []byte) []byte { binary.BigEndian.PutUint16(b[off:], v); return b })
	}
	plen := packet.UDPLen + len(good.Payload)

	// Link layer.
	pass("eth/header-only", "a0", good.Marshal()[:packet.EthLen], bpf.RelayReasonREASON_MALFORMED_IP)
	pass("eth/vlan-tagged", "a0", edit(func(b []byte) []byte {
		return append(append(append([]byte{}, b[:12]...), 0x81, 0x00, 0x00, 0x64), b[12:]...)
	}), bpf.RelayReasonREASON_NOT_IP)
	// An IPv6 packet under the IPv4 ethertype: version 6 is no IPv4 header.
	pass("eth/ipv6-under-ipv4-ethertype", "a0", edit(func(b []byte) []byte {
		binary.BigEndian.PutUint16(b[12:], 0x0800)
		return b
	}), bpf.RelayReasonREASON_MALFORMED_IP)

	// IPv6 header.
	pass("ip/truncated-header", "a0", good.Marshal()[:offIP+39], bpf.RelayReasonREASON_MALFORMED_IP)
	pass("ip/header-only", "a0", good.Marshal()[:offUDP6], bpf.RelayReasonREASON_MALFORMED_IP)
	for _, v := range []byte{0x4, 0x0, 0x7, 0xf} {
		pass(fmt.Sprintf("ip/version-%d", v), "a0", edit(func(b []byte) []byte { b[offIP] = v<<4 | b[offIP]&0x0f; return b }),
			bpf.RelayReasonREASON_MALFORMED_IP)
	}
	pass("ip/payload-length-beyond-frame", "a0", set16(offPlen6, uint16(plen+1)), bpf.RelayReasonREASON_MALFORMED_IP)
	pass("ip/payload-length-0xffff", "a0", set16(offPlen6, 0xffff), bpf.RelayReasonREASON_MALFORMED_IP)
	pass("ip/payload-length-0-jumbo", "a0", set16(offPlen6, 0), bpf.RelayReasonREASON_MALFORMED_IP)
	pass("ip/payload-length-below-udp", "a0", set16(offPlen6, 7), bpf.RelayReasonREASON_MALFORMED_IP)
	pass("ip/udp-header-cut-by-frame-end", "a0", good.Marshal()[:offUDP6+4], bpf.RelayReasonREASON_MALFORMED_IP)
	// A payload length shorter than the frame makes the rest a trailer.
	pass("ip/payload-length-shorter-than-frame", "a0", set16(offPlen6, uint16(plen-4)), bpf.RelayReasonREASON_MALFORMED_UDP)
	pass("ip/payload-length-8", "a0", set16(offPlen6, 8), bpf.RelayReasonREASON_MALFORMED_UDP)
	pass("ip/payload-length-and-udp-length-cut-the-data", "a0", edit(func(b []byte) []byte {
		binary.BigEndian.PutUint16(b[offPlen6:], uint16(plen-4))
		binary.BigEndian.PutUint16(b[offUDPLen6:], uint16(plen-4))
		return b
	}), bpf.RelayReasonREASON_MALFORMED_CHANNEL_DATA)
	// Extension headers are not walked: every type passes as such, whatever
	// follows (here UDP with bound ChannelData).
	for _, typ := range []uint8{0, 43, 44, 50, 51, 60, 135, 139, 140, 253, 254} {
		f := good
		f.Ext = []packet.ExtHeader{packet.Ext(typ)}
		pass(fmt.Sprintf("ext/%d", typ), "a0", f.Marshal(), bpf.RelayReasonREASON_IPV6EXTENSION)
	}
	{
		f := good
		f.Ext = []packet.ExtHeader{packet.Ext(60), packet.Ext(44)}
		pass("ext/dest-opts-then-fragment", "a0", f.Marshal(), bpf.RelayReasonREASON_IPV6EXTENSION)
		// Only the next header decides: a truncated extension header too.
		pass("ext/hop-by-hop-header-only", "a0", edit(func(b []byte) []byte { b[offNH6] = 0; return b[:offUDP6] }),
			bpf.RelayReasonREASON_IPV6EXTENSION)
	}
	for _, proto := range []uint8{58, 6, 59, 1, 132} { // ICMPv6, TCP, no next header, ICMP, SCTP
		f := good
		f.Proto = proto
		pass(fmt.Sprintf("ip/next-header-%d", proto), "a0", f.Marshal(), bpf.RelayReasonREASON_NOT_UDP)
	}

	// UDP header.
	pass("udp/length-short", "a0", set16(offUDPLen6, uint16(plen-4)), bpf.RelayReasonREASON_MALFORMED_UDP)
	pass("udp/length-long", "a0", set16(offUDPLen6, uint16(plen+4)), bpf.RelayReasonREASON_MALFORMED_UDP)
	pass("udp/length-below-header", "a0", set16(offUDPLen6, 4), bpf.RelayReasonREASON_MALFORMED_UDP)
	pass("udp/length-0-jumbogram", "a0", set16(offUDPLen6, 0), bpf.RelayReasonREASON_MALFORMED_UDP)
	f := good
	f.Dst = ap("[fd00:100::1]:3479")
	pass("udp/not-ours/other-port", "a0", f.Marshal(), bpf.RelayReasonREASON_NOT_OURS)
	// Relays are IPv4: an IPv6 datagram to a relay port has no binding, not
	// even from a bound peer's IPv4-mapped address to the mapped relay.
	f = good
	f.Dst = ap("[fd00:100::1]:50010")
	pass("udp/to-relay-port", "a0", f.Marshal(), bpf.RelayReasonREASON_NO_PEER_BINDING)
	p := fromPeer(redirect, data(10))
	p.IPv6 = true
	p.Src, p.Dst = ap("[::ffff:10.200.0.2]:5010"), ap("[::ffff:10.200.0.1]:50010")
	pass("udp/to-relay-port-from-ipv4-mapped-peer", "b0", p.Marshal(), bpf.RelayReasonREASON_NO_PEER_BINDING)

	// ChannelData.
	withPayload := func(p []byte) []byte { f := good; f.Payload = p; return f.Marshal() }
	pass("cd/stun-binding-request", "a0", withPayload([]byte{0x00, 0x01, 0x00, 0x00, 0x21, 0x12, 0xA4, 0x42,
		1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}), bpf.RelayReasonREASON_STUN)
	pass("cd/short-header", "a0", withPayload([]byte{0x40, 0x00, 0x00}), bpf.RelayReasonREASON_MALFORMED_CHANNEL_DATA)
	pass("cd/padding-4", "a0", withPayload(packet.ChannelData(redirect.Channel, data(10), make([]byte, 4))),
		bpf.RelayReasonREASON_MALFORMED_CHANNEL_DATA)
	pass("cd/length-beyond-payload", "a0", withPayload(append(packet.ChannelData(redirect.Channel, data(10), nil)[:4], data(9)...)),
		bpf.RelayReasonREASON_MALFORMED_CHANNEL_DATA)

	// Bindings: the IPv6 key is the whole address and port.
	pass("binding/unbound-channel", "a0", withPayload(packet.ChannelData(0x4FFF, data(10), nil)), bpf.RelayReasonREASON_NO_CHANNEL)
	f = good
	f.Src = ap("[fd00:100::2]:40009")
	pass("binding/other-client-port", "a0", f.Marshal(), bpf.RelayReasonREASON_NO_CHANNEL)
	f = good
	f.Src = ap("[fd00:100::3]:40000")
	pass("binding/other-client-address", "a0", f.Marshal(), bpf.RelayReasonREASON_NO_CHANNEL)
	f = good
	f.Src = ap("[fd00:101::2]:40000") // same low 64 bits, other prefix
	pass("binding/other-client-prefix", "a0", f.Marshal(), bpf.RelayReasonREASON_NO_CHANNEL)
	f = good
	f.Src = ap("[fd00:100::2:0:0:2]:40000")
	pass("binding/other-client-middle-word", "a0", f.Marshal(), bpf.RelayReasonREASON_NO_CHANNEL)
	{
		// An IPv4 frame from the IPv6 client's low 32 bits (fd00:100::2 ends
		// in 0.0.0.2): no binding.
		f := fromClient(bindings["redirect"], "10.100.0.1", packet.ChannelData(redirect.Channel, data(10), nil))
		f.Src = ap("0.0.0.2:40000")
		pass("binding/ipv4-from-ipv6-client-low-bits", "a0", f.Marshal(), bpf.RelayReasonREASON_NO_CHANNEL)
	}

	// Valid although unusual: relayed.
	b0 := e.ifaces["b0"]
	{
		// Illegal (RFC 8200 8.1): Linux drops it, so the kernel path passes it.
		in := fromClient(redirect, "fd00:100::1", packet.ChannelData(redirect.Channel, data(20), nil))
		in.NoUDPChecksum = true
		cases = append(cases, golden{name: "v6/pass/c2p-zero-udp-checksum", ingress: "a0", in: in.Marshal(),
			verdict: xdpPass, reason: bpf.RelayReasonREASON_NO_CHECKSUM})
		in = fromClient(redirect, "fd00:100::1", packet.ChannelData(redirect.Channel, data(20), nil))
		in.FlowLabel = 0xfffff
		in.TTL = 2
		cases = append(cases, golden{name: "v6/relay/c2p-hop-limit-2-flow-label-max", ingress: "a0", in: in.Marshal(),
			verdict: xdpRedirect, reason: bpf.RelayReasonREASON_RELAY_C2P_REDIRECT,
			out: toPeer(in, redirect, b0.mac, peerMAC, data(20)).Marshal()})
	}
	return cases
}

// TestIPv6MappedSourceIsNoIPv4Client: the maps store the IPv4 client
// 10.100.0.2 as ::ffff:10.100.0.2, which is also what an IPv6 packet from
// ::ffff:10.100.0.2 carries. Such a packet (RFC 4291 §2.5.5.2: not on the wire;
// Linux's ip6_rcv_core drops it, so pion/turn never sees it) is no IPv4 client's:
// it must pass, and must not teach the IPv4 binding an IPv6 listener address,
// whose low 32 bits would then become the source of the IPv4 client's replies.
func TestIPv6MappedSourceIsNoIPv4Client(t *testing.T) {
	e := newEnv(t)
	m := e.install(t)
	b := bindings["redirect"]
	f := fromClient(bindings["v6redirect"], "fd00:100::1", packet.ChannelData(b.Channel, data(100), nil))
	f.Src = ap("[::ffff:10.100.0.2]:40000")
	got, _ := e.check(t, m, "a0", f.Marshal())
	if got.verdict != xdpPass || got.reason != bpf.RelayReasonREASON_NO_CHANNEL {
		t.Errorf("IPv6 from ::ffff:10.100.0.2: %v %s, want PASS pass_no_channel", model.Verdict(got.verdict), reasonName(got.reason))
	}
	// The IPv4 client's replies still come from the IPv4 listener address.
	in := fromPeer(b, data(10))
	want := toClient(in, b, b.ReplySource, e.ifaces["a0"].mac, clientMAC, data(10)).Marshal()
	if got, _ := e.check(t, m, "b0", in.Marshal()); !bytes.Equal(got.out, want) {
		t.Errorf("reply to the IPv4 client afterwards\n got %x\nwant %x", got.out, want)
	}
}

// ipv6ChannelData is an IPv6 frame with a hop-by-hop extension header in front
// of UDP to the listener port carrying ChannelData: extension headers are not
// walked, so it passes.
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
		inCs, outCs   int // offsets of the UDP checksums
	}{
		{"c2p", "a0", fromClient(redirect, "10.100.0.1", packet.ChannelData(redirect.Channel, data(33), []byte{7, 7, 7})), offUDP + 6, offUDP + 6},
		{"p2c", "b0", fromPeer(redirect, data(33)), offUDP + 6, offUDP + 6},
		{"v6/c2p", "a0", fromClient(bindings["v6redirect"], "fd00:100::1", packet.ChannelData(0x4000, data(33), []byte{7, 7, 7})), offUDPCs6, offUDP + 6},
		{"v6/p2c", "b0", fromPeer(bindings["v6redirect"], data(33)), offUDP + 6, offUDPCs6},
	} {
		t.Run(dir.name, func(t *testing.T) {
			good := dir.in.Marshal()
			gotGood, _ := e.check(t, m, dir.ingress, good)
			bad := append([]byte{}, good...)
			cs := binary.BigEndian.Uint16(bad[dir.inCs:])
			binary.BigEndian.PutUint16(bad[dir.inCs:], onesAdd(cs, 1))
			gotBad, _ := e.check(t, m, dir.ingress, bad)
			if gotGood.verdict != xdpRedirect || gotBad.verdict != xdpRedirect {
				t.Fatalf("verdicts %d and %d, want REDIRECT", gotGood.verdict, gotBad.verdict)
			}
			if _, err := packet.Parse(gotGood.out); err != nil {
				t.Fatalf("good datagram: %v", err)
			}
			want := onesAdd(binary.BigEndian.Uint16(gotGood.out[dir.outCs:]), 1)
			if got := binary.BigEndian.Uint16(gotBad.out[dir.outCs:]); got != want {
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
