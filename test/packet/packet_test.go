package packet

import (
	"bytes"
	"encoding/binary"
	"net/netip"
	"testing"
)

// sumsToZero verifies a UDP checksum the way a receiver does: the sum over the
// pseudo header and the whole datagram, checksum included, is all ones.
func sumsToZero(src, dst []byte, udp []byte) bool {
	var s uint32
	for _, b := range [][]byte{src, dst} {
		for i := 0; i < len(b); i += 2 {
			s += uint32(binary.BigEndian.Uint16(b[i:]))
		}
	}
	s += 17 + uint32(len(udp))
	return Checksum(udp, s) == 0
}

func TestIPv6RoundTrip(t *testing.T) {
	for n := 0; n < 8; n++ {
		f := Frame{DstMAC: [6]byte{1}, SrcMAC: [6]byte{2}, TOS: 0xb8, TTL: 7, FlowLabel: 0xabcde,
			Src: netip.MustParseAddrPort("[fd00::2]:40000"), Dst: netip.MustParseAddrPort("[fd00::1]:3478"),
			Payload: bytes.Repeat([]byte{0xa5}, n), Trailer: []byte{0xee}}
		b := f.Marshal()
		if len(b) != EthLen+IPv6Len+UDPLen+n+1 || binary.BigEndian.Uint16(b[12:]) != EtherTypeIPv6 {
			t.Fatalf("len %d, ethertype %#x", len(b), binary.BigEndian.Uint16(b[12:]))
		}
		ip := b[EthLen : len(b)-1]
		if got := binary.BigEndian.Uint32(ip); got != 0x6b8abcde {
			t.Fatalf("version/class/flow %#08x", got)
		}
		if !sumsToZero(ip[8:24], ip[24:40], ip[IPv6Len:]) {
			t.Fatalf("len %d: UDP checksum does not verify", n)
		}
		p, err := Parse(b[:len(b)-1])
		if err != nil {
			t.Fatal(err)
		}
		if !p.IPv6 || p.TOS != 0xb8 || p.FlowLabel != 0xabcde || p.TTL != 7 || p.Src != f.Src || p.Dst != f.Dst || !bytes.Equal(p.Payload, f.Payload) {
			t.Fatalf("parsed %+v", p)
		}
		if _, err := Parse(b); err == nil {
			t.Fatal("a trailer passed as payload")
		}
	}
}

func TestIPv6ParseRejects(t *testing.T) {
	f := Frame{Src: netip.MustParseAddrPort("[fd00::2]:1"), Dst: netip.MustParseAddrPort("[fd00::1]:2"), Payload: []byte("x")}
	mod := func(g func(b []byte)) []byte { b := f.Marshal(); g(b); return b }
	zero := f
	zero.NoUDPChecksum = true
	ext := f
	ext.Ext = []ExtHeader{Ext(0)}
	for name, b := range map[string][]byte{
		"zero checksum":     zero.Marshal(),
		"bad checksum":      mod(func(b []byte) { b[EthLen+IPv6Len+6] ^= 1 }),
		"version":           mod(func(b []byte) { b[EthLen] = 0x40 }),
		"payload length":    mod(func(b []byte) { b[EthLen+5]++ }),
		"udp length":        mod(func(b []byte) { b[EthLen+IPv6Len+5]++ }),
		"extension header":  ext.Marshal(),
		"short":             f.Marshal()[:EthLen+IPv6Len],
		"not ip":            mod(func(b []byte) { b[12] = 0x81 }),
		"address corrupted": mod(func(b []byte) { b[EthLen+8] ^= 0x80 }),
	} {
		if _, err := Parse(b); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
}

// The extension header chain: each names the next, the last one UDP; the
// payload length covers them; the UDP checksum is still over the datagram.
func TestIPv6ExtensionChain(t *testing.T) {
	f := Frame{Src: netip.MustParseAddrPort("[fd00::2]:1"), Dst: netip.MustParseAddrPort("[fd00::1]:2"), Payload: []byte("abc"),
		Ext: []ExtHeader{Ext(0), Ext(44), Ext(51)}}
	b := f.Marshal()
	ip := b[EthLen:]
	if ip[6] != 0 || ip[IPv6Len] != 44 || ip[IPv6Len+8] != 51 || ip[IPv6Len+16] != 17 {
		t.Fatalf("chain % x", ip[:IPv6Len+20])
	}
	if plen := binary.BigEndian.Uint16(ip[4:]); int(plen) != 8+8+16+UDPLen+3 {
		t.Fatalf("payload length %d", plen)
	}
	udp := ip[IPv6Len+32:]
	if !sumsToZero(ip[8:24], ip[24:40], udp) {
		t.Fatal("UDP checksum does not verify")
	}
	esp := Frame{Src: f.Src, Dst: f.Dst, Ext: []ExtHeader{Ext(50)}}.Marshal()
	if esp[EthLen+6] != 50 || len(esp) != EthLen+IPv6Len+8+UDPLen {
		t.Fatalf("ESP frame % x", esp)
	}
}

func TestIPv4Unchanged(t *testing.T) {
	f := Frame{TOS: 0xb8, TTL: 64, ID: 9, FragOff: 0x4000, Src: netip.MustParseAddrPort("10.0.0.2:1"),
		Dst: netip.MustParseAddrPort("10.0.0.1:2"), Payload: []byte("odd")}
	b := f.Marshal()
	p, err := Parse(b)
	if err != nil || p.IPv6 || p.TOS != 0xb8 || p.ID != 9 || p.FragOff != 0x4000 || p.TTL != 64 {
		t.Fatalf("%+v %v", p, err)
	}
	if !sumsToZero(b[EthLen+12:EthLen+16], b[EthLen+16:EthLen+20], b[EthLen+IPv4Len:]) {
		t.Fatal("UDP checksum does not verify")
	}
	f.NoUDPChecksum = true
	if _, err := Parse(f.Marshal()); err != nil {
		t.Fatalf("zero checksum over IPv4: %v", err)
	}
	// An IPv4-mapped pair stays IPv4 unless asked for IPv6.
	f.Src, f.Dst = netip.MustParseAddrPort("[::ffff:10.0.0.2]:1"), netip.MustParseAddrPort("[::ffff:10.0.0.1]:2")
	if f.Is6() || !(Frame{IPv6: true, Src: f.Src, Dst: f.Dst}).Is6() {
		t.Fatal("Is6")
	}
}
