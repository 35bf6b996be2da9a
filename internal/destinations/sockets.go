package destinations

import (
	"encoding/binary"
	"fmt"
	"net/netip"

	"github.com/mdlayher/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// A DNAT that changes the port (a NodePort: nodeIP:31478 -> nodeIP:3478)
// makes the wire destination a port of the node's own. A socket bound there
// would receive the packets the DNAT rule does not take (a rule that matches
// only some sources, or none any more), and the destination table, which
// applies what one client's conntrack entry showed to every client of the
// listener, cannot tell those apart: with such a socket the destination has
// two claimants and stays with the kernel (not learned). Without one, the
// kernel has nowhere else to deliver it (a datagram to a port nobody binds
// is refused), so the DNAT is what gives it a receiver.

// sockDiag is a lazily dialled sock_diag socket, re-dialled after an error.
type sockDiag struct {
	netNS netns.NsHandle
	conn  *netlink.Conn
}

func (s *sockDiag) close() {
	if s.conn != nil {
		_ = s.conn.Close()
		s.conn = nil
	}
}

// Layout of the inet_diag messages (linux/inet_diag.h).
const (
	inetDiagReqLen  = 56 // struct inet_diag_req_v2
	inetDiagMsgLen  = 72 // struct inet_diag_msg
	inetDiagV6Only  = 11 // INET_DIAG_SKV6ONLY
	diagSportOffset = 4  // inet_diag_msg.id.idiag_sport
	diagSrcOffset   = 8  // inet_diag_msg.id.idiag_src
)

// bound reports a UDP socket of the namespace that would receive a datagram
// to wire if nothing translated it: bound to wire's port on wire's address or
// on a wildcard of its family (an IPv6 wildcard also takes IPv4 unless it is
// IPV6_V6ONLY), connected or not. It returns the socket's local address.
func (s *sockDiag) bound(wire netip.AddrPort) (netip.AddrPort, bool, error) {
	if s.conn == nil {
		cfg := &netlink.Config{}
		if s.netNS.IsOpen() {
			cfg.NetNS = int(s.netNS)
		}
		c, err := netlink.Dial(unix.NETLINK_SOCK_DIAG, cfg)
		if err != nil {
			return netip.AddrPort{}, false, fmt.Errorf("sock_diag: %w", err)
		}
		s.conn = c
	}
	families := []uint8{unix.AF_INET6}
	if wire.Addr().Is4() {
		families = []uint8{unix.AF_INET, unix.AF_INET6}
	}
	for _, family := range families {
		local, found, err := s.dump(family, wire)
		if err != nil {
			s.close()
			return netip.AddrPort{}, false, err
		}
		if found {
			return local, true, nil
		}
	}
	return netip.AddrPort{}, false, nil
}

// dump asks for the family's UDP sockets bound to wire's port (the kernel
// filters on idiag_sport: udp_diag.c, udp_dump) and looks for one that
// takes wire's address.
func (s *sockDiag) dump(family uint8, wire netip.AddrPort) (netip.AddrPort, bool, error) {
	req := make([]byte, inetDiagReqLen)
	req[0], req[1] = family, unix.IPPROTO_UDP
	binary.LittleEndian.PutUint32(req[4:], 0xffffffff) // every state
	binary.BigEndian.PutUint16(req[8:], wire.Port())   // id.idiag_sport
	// No cookie (INET_DIAG_NOCOOKIE).
	binary.LittleEndian.PutUint32(req[48:], 0xffffffff)
	binary.LittleEndian.PutUint32(req[52:], 0xffffffff)
	msgs, err := s.conn.Execute(netlink.Message{
		Header: netlink.Header{Type: unix.SOCK_DIAG_BY_FAMILY, Flags: netlink.Request | netlink.Dump},
		Data:   req,
	})
	if err != nil {
		return netip.AddrPort{}, false, fmt.Errorf("sock_diag: UDP sockets on port %d: %w", wire.Port(), err)
	}
	for _, m := range msgs {
		if len(m.Data) < inetDiagMsgLen || binary.BigEndian.Uint16(m.Data[diagSportOffset:]) != wire.Port() {
			continue
		}
		var local netip.Addr
		if m.Data[0] == unix.AF_INET {
			local = netip.AddrFrom4([4]byte(m.Data[diagSrcOffset : diagSrcOffset+4]))
		} else {
			local = netip.AddrFrom16([16]byte(m.Data[diagSrcOffset : diagSrcOffset+16]))
		}
		if takes(local, v6Only(m.Data[inetDiagMsgLen:]), wire.Addr()) {
			return netip.AddrPortFrom(local, wire.Port()), true, nil
		}
	}
	return netip.AddrPort{}, false, nil
}

// takes tells whether a socket bound to local receives datagrams to dst.
func takes(local netip.Addr, v6only bool, dst netip.Addr) bool {
	switch {
	case local.Unmap() == dst.Unmap():
		return true
	case local == netip.IPv4Unspecified():
		return dst.Unmap().Is4()
	case local == netip.IPv6Unspecified():
		return !dst.Unmap().Is4() || !v6only
	}
	return false
}

// v6Only reads INET_DIAG_SKV6ONLY from a message's attributes (the kernel
// puts it on every IPv6 socket's).
func v6Only(attrs []byte) bool {
	ad, err := netlink.NewAttributeDecoder(attrs)
	if err != nil {
		return false
	}
	for ad.Next() {
		if ad.Type() == inetDiagV6Only {
			return ad.Uint8() != 0
		}
	}
	return false
}
