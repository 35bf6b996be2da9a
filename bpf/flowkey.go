package bpf

import (
	"net/netip"

	"golang.org/x/sys/unix"

	"github.com/l7mp/stunnerd-xdp/internal/byteorder"
)

// FlowGroup is the group (flow.h) of a socket bound to l for the protocol
// (unix.IPPROTO_UDP or IPPROTO_TCP): the listener steering's steer_flows and
// the relay's alloc_flows and listener_dsts spell a listener socket so.
func FlowGroup(protocol uint8, l netip.AddrPort) SteerGroup {
	a := l.Addr()
	g := SteerGroup{Addr: a.Unmap().As16(), Port: l.Port(), Protocol: protocol, Family: unix.AF_INET}
	if a.Is6() && !a.Is4In6() {
		g.Family = unix.AF_INET6
	}
	return g
}

// FlowKey is the key (flow.h struct flow) of a client of a group: the
// 5-tuple of a UDP allocation.
func FlowKey(g SteerGroup, client netip.AddrPort) SteerFlow {
	return SteerFlow{Group: g, ClientAddr: client.Addr().Unmap().As16(), ClientPort: byteorder.Htons(client.Port())}
}
