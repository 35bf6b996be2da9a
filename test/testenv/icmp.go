package testenv

import (
	"encoding/binary"
	"net/netip"

	"golang.org/x/sys/unix"
)

// FragNeeded is an ICMP destination unreachable, fragmentation needed (type 3
// code 4) with the next-hop MTU, quoting the IP and UDP headers of a
// 1,400-byte datagram with DF from src to dst, as a router on the path sends
// it. The kernel that sent to dst from src makes a path-MTU exception of it
// when a UDP socket holds src.
func FragNeeded(src, dst netip.AddrPort, mtu uint16) []byte {
	icmp := make([]byte, 8+20+8)
	icmp[0], icmp[1] = 3, 4
	binary.BigEndian.PutUint16(icmp[6:], mtu)
	ip := icmp[8:]
	ip[0] = 0x45
	binary.BigEndian.PutUint16(ip[2:], 1400)
	binary.BigEndian.PutUint16(ip[6:], 0x4000) // DF
	ip[8], ip[9] = 64, unix.IPPROTO_UDP
	s, d := src.Addr().As4(), dst.Addr().As4()
	copy(ip[12:], s[:])
	copy(ip[16:], d[:])
	binary.BigEndian.PutUint16(ip[10:], ^onesSum(ip[:20]))
	udp := ip[20:]
	binary.BigEndian.PutUint16(udp[0:], src.Port())
	binary.BigEndian.PutUint16(udp[2:], dst.Port())
	binary.BigEndian.PutUint16(udp[4:], 1380)
	binary.BigEndian.PutUint16(icmp[2:], ^onesSum(icmp))
	return icmp
}

// SendICMP sends an ICMP message to the IPv4 address to through a raw socket
// of the caller's network namespace.
func SendICMP(to netip.Addr, msg []byte) error {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.IPPROTO_ICMP)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	return unix.Sendto(fd, msg, 0, &unix.SockaddrInet4{Addr: to.As4()})
}

// onesSum is the folded 16-bit one's complement sum of b (even length).
func onesSum(b []byte) uint16 {
	var s uint32
	for i := 0; i+1 < len(b); i += 2 {
		s += uint32(binary.BigEndian.Uint16(b[i:]))
	}
	for s > 0xFFFF {
		s = s>>16 + s&0xFFFF
	}
	return uint16(s)
}
