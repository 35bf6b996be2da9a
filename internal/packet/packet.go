// Package packet builds and checks Ethernet/IPv4/UDP frames and TURN ChannelData
// for tests, benchmarks and the demo: golden packets are made here, and every
// output of the XDP program is checked here with checksums computed from scratch.
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
	UDPLen  = 8
)

// Frame describes an Ethernet/IPv4/UDP frame.
type Frame struct {
	DstMAC, SrcMAC [6]byte
	EtherType      uint16 // 0 means IPv4
	TOS, TTL       uint8
	ID             uint16
	FragOff        uint16 // flags and fragment offset as on the wire
	Options        []byte // IPv4 options, a multiple of 4 bytes
	Proto          uint8  // 0 means UDP
	Src, Dst       netip.AddrPort
	Payload        []byte
	// NoUDPChecksum sends the UDP checksum as zero (legal on IPv4).
	NoUDPChecksum bool
	// Trailer is appended after the IP packet (an Ethernet minimum-size pad).
	Trailer []byte
}

// Marshal serializes the frame with correct lengths and checksums.
func (f Frame) Marshal() []byte {
	ihl := IPv4Len + len(f.Options)
	totLen := ihl + UDPLen + len(f.Payload)
	b := make([]byte, EthLen+totLen, EthLen+totLen+len(f.Trailer))
	copy(b[0:6], f.DstMAC[:])
	copy(b[6:12], f.SrcMAC[:])
	et := f.EtherType
	if et == 0 {
		et = 0x0800
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
	if !f.NoUDPChecksum {
		binary.BigEndian.PutUint16(udp[6:8], UDPChecksum(src4, dst4, udp))
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

// UDPChecksum computes the UDP checksum over the pseudo header and the datagram
// (whose checksum field is treated as zero).
func UDPChecksum(src, dst [4]byte, udp []byte) uint16 {
	var sum uint32
	sum += uint32(src[0])<<8 | uint32(src[1])
	sum += uint32(src[2])<<8 | uint32(src[3])
	sum += uint32(dst[0])<<8 | uint32(dst[1])
	sum += uint32(dst[2])<<8 | uint32(dst[3])
	sum += 17
	sum += uint32(len(udp))
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
	TTL            uint8
	Src, Dst       netip.AddrPort
	Payload        []byte
	UDPChecksum    uint16
}

// Parse reads an option-less Ethernet/IPv4/UDP frame and verifies the IPv4
// header checksum, the lengths and (unless zero) the UDP checksum.
func Parse(b []byte) (Parsed, error) {
	var p Parsed
	if len(b) < EthLen+IPv4Len+UDPLen {
		return p, fmt.Errorf("frame of %d bytes is too short", len(b))
	}
	if et := binary.BigEndian.Uint16(b[12:14]); et != 0x0800 {
		return p, fmt.Errorf("ethertype %#04x is not IPv4", et)
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

// ChannelData encodes a ChannelData message with the given padding bytes after
// the data (RFC 8656 §12.4).
func ChannelData(channel uint16, data []byte, padding []byte) []byte {
	b := make([]byte, 4, 4+len(data)+len(padding))
	binary.BigEndian.PutUint16(b[0:2], channel)
	binary.BigEndian.PutUint16(b[2:4], uint16(len(data)))
	b = append(b, data...)
	return append(b, padding...)
}
