// Package packet builds and checks Ethernet/IPv4/UDP and Ethernet/IPv6/UDP
// frames and TURN ChannelData for tests, benchmarks and the demo: golden packets
// are made here, and every output of the XDP program is checked here with
// checksums computed from scratch.
package packet

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
)

// Header sizes.
const (
	EthLen  = 14
	IPv4Len = 20
	IPv6Len = 40
	UDPLen  = 8
)

// EtherTypes.
const (
	EtherTypeIPv4 = 0x0800
	EtherTypeIPv6 = 0x86DD
)

// Frame describes an Ethernet/IPv4/UDP or Ethernet/IPv6/UDP frame. It is IPv6
// when IPv6 is set or Src or Dst is an IPv6 address that is not IPv4-mapped; then TOS
// is the traffic class, TTL the hop limit, and ID, FragOff and Options are not
// used.
type Frame struct {
	DstMAC, SrcMAC [6]byte
	EtherType      uint16 // 0 means IPv4 or IPv6, after the addresses
	TOS, TTL       uint8
	ID             uint16
	FragOff        uint16 // flags and fragment offset as on the wire
	Options        []byte // IPv4 options, a multiple of 4 bytes
	Proto          uint8  // 0 means UDP; on IPv6 the header after the extension headers
	Src, Dst       netip.AddrPort
	Payload        []byte
	// NoUDPChecksum sends the UDP checksum as zero (legal on IPv4, not on IPv6).
	NoUDPChecksum bool
	// PartialChecksum writes the UDP checksum field as a sender with checksum
	// offload hands the frame over (CHECKSUM_PARTIAL, as a veth delivers it):
	// the folded pseudo-header sum, not complemented, the rest left undone.
	PartialChecksum bool
	// Trailer is appended after the IP packet (an Ethernet minimum-size pad).
	Trailer []byte

	// IPv6 builds an IPv6 packet whatever the addresses (IPv4 addresses are
	// written IPv4-mapped).
	IPv6 bool
	// FlowLabel is the IPv6 flow label (20 bits).
	FlowLabel uint32
	// Ext are IPv6 extension headers between the IPv6 header and Proto.
	Ext []ExtHeader
}

// ExtHeader is an IPv6 extension header. Marshal writes the type of the header
// that follows it as its first byte, then Body; an ESP header (50) has no
// next-header byte and is written as Body alone.
type ExtHeader struct {
	Type uint8
	Body []byte
}

// Ext returns a well-formed minimal extension header of the given type: 8 bytes
// (a PadN option for the option headers), 16 for AH (a 4-byte ICV).
func Ext(typ uint8) ExtHeader {
	switch typ {
	case 44: // fragment: offset 0, M 0, an identification
		return ExtHeader{Type: typ, Body: []byte{0, 0, 0, 0, 0, 0, 0x42}}
	case 51: // AH: payload length in 4-byte units minus 2
		return ExtHeader{Type: typ, Body: []byte{2, 0, 0, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 0}}
	case 50: // ESP: SPI and sequence number, then ciphertext
		return ExtHeader{Type: typ, Body: []byte{0, 0, 1, 0, 0, 0, 0, 1}}
	case 43: // routing: type 4 (segment routing), no segments left
		return ExtHeader{Type: typ, Body: []byte{0, 4, 0, 0, 0, 0, 0}}
	}
	return ExtHeader{Type: typ, Body: []byte{0, 1, 4, 0, 0, 0, 0}} // length 0, PadN(4)
}

func (e ExtHeader) len() int {
	if e.Type == 50 {
		return len(e.Body)
	}
	return 1 + len(e.Body)
}

// Is6 reports whether Marshal builds an IPv6 packet.
func (f Frame) Is6() bool {
	v6 := func(a netip.Addr) bool { return a.Is6() && !a.Is4In6() }
	return f.IPv6 || v6(f.Src.Addr()) || v6(f.Dst.Addr())
}

// Marshal serializes the frame with correct lengths and checksums.
func (f Frame) Marshal() []byte {
	if f.Is6() {
		return f.marshal6()
	}
	ihl := IPv4Len + len(f.Options)
	totLen := ihl + UDPLen + len(f.Payload)
	b := make([]byte, EthLen+totLen, EthLen+totLen+len(f.Trailer))
	copy(b[0:6], f.DstMAC[:])
	copy(b[6:12], f.SrcMAC[:])
	et := f.EtherType
	if et == 0 {
		et = EtherTypeIPv4
	}
	binary.BigEndian.PutUint16(b[12:14], et)
	ip := b[EthLen:]
	ip[0] = 0x40 | byte(ihl/4)
	ip[1] = f.TOS
	binary.BigEndian.PutUint16(ip[2:4], uint16(totLen))
	binary.BigEndian.PutUint16(ip[4:6], f.ID)
	binary.BigEndian.PutUint16(ip[6:8], f.FragOff)
	ip[8] = f.TTL
	proto := f.Proto
	if proto == 0 {
		proto = 17
	}
	ip[9] = proto
	src4, dst4 := f.Src.Addr().As4(), f.Dst.Addr().As4()
	copy(ip[12:16], src4[:])
	copy(ip[16:20], dst4[:])
	copy(ip[20:ihl], f.Options)
	binary.BigEndian.PutUint16(ip[10:12], Checksum(ip[:ihl], 0))
	udp := ip[ihl:]
	binary.BigEndian.PutUint16(udp[0:2], f.Src.Port())
	binary.BigEndian.PutUint16(udp[2:4], f.Dst.Port())
	binary.BigEndian.PutUint16(udp[4:6], uint16(UDPLen+len(f.Payload)))
	copy(udp[UDPLen:], f.Payload)
	switch {
	case f.PartialChecksum:
		binary.BigEndian.PutUint16(udp[6:8], ^UDPChecksum(src4, dst4, make([]byte, len(udp))))
	case !f.NoUDPChecksum:
		binary.BigEndian.PutUint16(udp[6:8], UDPChecksum(src4, dst4, udp))
	}
	return append(b, f.Trailer...)
}

func (f Frame) marshal6() []byte {
	extLen := 0
	for _, e := range f.Ext {
		extLen += e.len()
	}
	udpLen := UDPLen + len(f.Payload)
	plen := extLen + udpLen
	b := make([]byte, EthLen+IPv6Len+plen, EthLen+IPv6Len+plen+len(f.Trailer))
	copy(b[0:6], f.DstMAC[:])
	copy(b[6:12], f.SrcMAC[:])
	et := f.EtherType
	if et == 0 {
		et = EtherTypeIPv6
	}
	binary.BigEndian.PutUint16(b[12:14], et)
	ip := b[EthLen:]
	binary.BigEndian.PutUint32(ip[0:4], 6<<28|uint32(f.TOS)<<20|f.FlowLabel&0xfffff)
	binary.BigEndian.PutUint16(ip[4:6], uint16(plen))
	proto := f.Proto
	if proto == 0 {
		proto = 17
	}
	ip[7] = f.TTL
	src, dst := f.Src.Addr().As16(), f.Dst.Addr().As16()
	copy(ip[8:24], src[:])
	copy(ip[24:40], dst[:])
	// The chain: the IPv6 header names the first extension header, each
	// extension header the next, the last one Proto.
	next := &ip[6]
	off := IPv6Len
	for _, e := range f.Ext {
		*next = e.Type
		if e.Type == 50 {
			copy(ip[off:], e.Body)
			next = new(byte) // ESP hides what follows
		} else {
			next = &ip[off]
			copy(ip[off+1:], e.Body)
		}
		off += e.len()
	}
	*next = proto
	udp := ip[off:]
	binary.BigEndian.PutUint16(udp[0:2], f.Src.Port())
	binary.BigEndian.PutUint16(udp[2:4], f.Dst.Port())
	binary.BigEndian.PutUint16(udp[4:6], uint16(udpLen))
	copy(udp[UDPLen:], f.Payload)
	switch {
	case f.PartialChecksum:
		binary.BigEndian.PutUint16(udp[6:8], ^UDPChecksum6(src, dst, make([]byte, len(udp))))
	case !f.NoUDPChecksum:
		binary.BigEndian.PutUint16(udp[6:8], UDPChecksum6(src, dst, udp))
	}
	return append(b, f.Trailer...)
}

// Checksum is the RFC 1071 Internet checksum of b, starting from an unfolded sum.
func Checksum(b []byte, sum uint32) uint16 {
	for i := 0; i+1 < len(b); i += 2 {
		sum += uint32(b[i])<<8 | uint32(b[i+1])
	}
	if len(b)%2 == 1 {
		sum += uint32(b[len(b)-1]) << 8
	}
	for sum > 0xffff {
		sum = sum&0xffff + sum>>16
	}
	return ^uint16(sum)
}

// UDPChecksum computes the UDP checksum over the IPv4 pseudo header and the
// datagram (whose checksum field is treated as zero).
func UDPChecksum(src, dst [4]byte, udp []byte) uint16 {
	var sum uint32
	sum += uint32(src[0])<<8 | uint32(src[1])
	sum += uint32(src[2])<<8 | uint32(src[3])
	sum += uint32(dst[0])<<8 | uint32(dst[1])
	sum += uint32(dst[2])<<8 | uint32(dst[3])
	sum += 17
	sum += uint32(len(udp))
	return udpChecksum(sum, udp)
}

// UDPChecksum6 computes the UDP checksum over the IPv6 pseudo header (RFC 8200
// §8.1) and the datagram (whose checksum field is treated as zero).
func UDPChecksum6(src, dst [16]byte, udp []byte) uint16 {
	var sum uint32
	for i := 0; i < 16; i += 2 {
		sum += uint32(src[i])<<8 | uint32(src[i+1])
		sum += uint32(dst[i])<<8 | uint32(dst[i+1])
	}
	sum += 17
	sum += uint32(len(udp)) // a 32-bit length: the high word is zero here
	return udpChecksum(sum, udp)
}

func udpChecksum(sum uint32, udp []byte) uint16 {
	c := make([]byte, len(udp))
	copy(c, udp)
	c[6], c[7] = 0, 0
	cs := Checksum(c, sum)
	if cs == 0 {
		cs = 0xffff
	}
	return cs
}

// Parsed is what Parse reads back from a frame.
type Parsed struct {
	DstMAC, SrcMAC [6]byte
	TTL            uint8 // the hop limit on IPv6
	Src, Dst       netip.AddrPort
	Payload        []byte
	UDPChecksum    uint16

	IPv6      bool
	TOS       uint8 // the traffic class on IPv6
	ID        uint16
	FragOff   uint16 // flags and fragment offset as on the wire
	FlowLabel uint32
}

// Parse reads an option-less Ethernet/IPv4/UDP or extension-header-less
// Ethernet/IPv6/UDP frame and verifies the lengths, the IPv4 header checksum
// and the UDP checksum, which may be zero (absent) on IPv4 only.
func Parse(b []byte) (Parsed, error) {
	var p Parsed
	if len(b) < EthLen {
		return p, fmt.Errorf("frame of %d bytes is too short", len(b))
	}
	switch et := binary.BigEndian.Uint16(b[12:14]); et {
	case EtherTypeIPv4:
	case EtherTypeIPv6:
		return parse6(b)
	default:
		return p, fmt.Errorf("ethertype %#04x is neither IPv4 nor IPv6", et)
	}
	if len(b) < EthLen+IPv4Len+UDPLen {
		return p, fmt.Errorf("frame of %d bytes is too short", len(b))
	}
	copy(p.DstMAC[:], b[0:6])
	copy(p.SrcMAC[:], b[6:12])
	ip := b[EthLen:]
	if ip[0] != 0x45 {
		return p, fmt.Errorf("IPv4 version/IHL %#02x", ip[0])
	}
	if Checksum(ip[:IPv4Len], 0) != 0 {
		return p, errors.New("bad IPv4 header checksum")
	}
	totLen := int(binary.BigEndian.Uint16(ip[2:4]))
	if totLen != len(ip) {
		return p, fmt.Errorf("IPv4 total length %d != %d bytes after the Ethernet header", totLen, len(ip))
	}
	if ip[9] != 17 {
		return p, fmt.Errorf("IP protocol %d is not UDP", ip[9])
	}
	p.TOS = ip[1]
	p.ID = binary.BigEndian.Uint16(ip[4:6])
	p.FragOff = binary.BigEndian.Uint16(ip[6:8])
	p.TTL = ip[8]
	var src, dst [4]byte
	copy(src[:], ip[12:16])
	copy(dst[:], ip[16:20])
	udp := ip[IPv4Len:]
	if ulen := int(binary.BigEndian.Uint16(udp[4:6])); ulen != len(udp) {
		return p, fmt.Errorf("UDP length %d != %d", ulen, len(udp))
	}
	p.UDPChecksum = binary.BigEndian.Uint16(udp[6:8])
	if p.UDPChecksum != 0 {
		if want := UDPChecksum(src, dst, udp); want != p.UDPChecksum {
			return p, fmt.Errorf("bad UDP checksum %#04x, want %#04x", p.UDPChecksum, want)
		}
	}
	p.Src = netip.AddrPortFrom(netip.AddrFrom4(src), binary.BigEndian.Uint16(udp[0:2]))
	p.Dst = netip.AddrPortFrom(netip.AddrFrom4(dst), binary.BigEndian.Uint16(udp[2:4]))
	p.Payload = udp[UDPLen:]
	return p, nil
}

func parse6(b []byte) (Parsed, error) {
	p := Parsed{IPv6: true}
	if len(b) < EthLen+IPv6Len+UDPLen {
		return p, fmt.Errorf("IPv6 frame of %d bytes is too short", len(b))
	}
	copy(p.DstMAC[:], b[0:6])
	copy(p.SrcMAC[:], b[6:12])
	ip := b[EthLen:]
	vtf := binary.BigEndian.Uint32(ip[0:4])
	if vtf>>28 != 6 {
		return p, fmt.Errorf("IPv6 version %d", vtf>>28)
	}
	p.TOS, p.FlowLabel = uint8(vtf>>20), vtf&0xfffff
	if plen := int(binary.BigEndian.Uint16(ip[4:6])); plen != len(ip)-IPv6Len {
		return p, fmt.Errorf("IPv6 payload length %d != %d bytes after the IPv6 header", plen, len(ip)-IPv6Len)
	}
	if ip[6] != 17 {
		return p, fmt.Errorf("IPv6 next header %d is not UDP", ip[6])
	}
	p.TTL = ip[7]
	src, dst := [16]byte(ip[8:24]), [16]byte(ip[24:40])
	udp := ip[IPv6Len:]
	if ulen := int(binary.BigEndian.Uint16(udp[4:6])); ulen != len(udp) {
		return p, fmt.Errorf("UDP length %d != %d", ulen, len(udp))
	}
	p.UDPChecksum = binary.BigEndian.Uint16(udp[6:8])
	if p.UDPChecksum == 0 {
		return p, errors.New("zero UDP checksum over IPv6 (RFC 8200 §8.1)")
	}
	if want := UDPChecksum6(src, dst, udp); want != p.UDPChecksum {
		return p, fmt.Errorf("bad UDP checksum %#04x, want %#04x", p.UDPChecksum, want)
	}
	p.Src = netip.AddrPortFrom(netip.AddrFrom16(src), binary.BigEndian.Uint16(udp[0:2]))
	p.Dst = netip.AddrPortFrom(netip.AddrFrom16(dst), binary.BigEndian.Uint16(udp[2:4]))
	p.Payload = udp[UDPLen:]
	return p, nil
}

// ChannelData encodes a ChannelData message with the given padding bytes after
// the data (RFC 8656 §12.4).
func ChannelData(channel uint16, data []byte, padding []byte) []byte {
	b := make([]byte, 4, 4+len(data)+len(padding))
	binary.BigEndian.PutUint16(b[0:2], channel)
	binary.BigEndian.PutUint16(b[2:4], uint16(len(data)))
	b = append(b, data...)
	return append(b, padding...)
}
