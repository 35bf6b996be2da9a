// Package destinations computes and maintains the destinations the UDP
// listeners accept: for every address:port a client's datagram may carry on
// the wire, the listener socket the kernel delivers it to. The XDP program
// relays ChannelData only to a destination in this table, so that transit
// traffic (the node forwards) and spoofed destinations go to the kernel, which
// drops or forwards them as it would without XDP.
//
// The table holds
//   - each specific listener's own address;
//   - for a wildcard listener, every local unicast address of its family at
//     its port, except those a specific listener on that port binds (the
//     kernel's socket lookup prefers the exact bind); loopback addresses
//     never arrive from the wire, and the kernel drops them as martians;
//   - VIPs the node DNATs to a listener, learned from conntrack when an
//     allocation arrives through one, also with another port (a NodePort
//     31478 in front of listener port 3478: the XDP program takes the port
//     too, and replies from it).
//
// A destination with two claimants is left out, so its packets go to
// userspace where the kernel decides per flow: a VIP learned for two
// listeners, a listener's own destination DNATed to another (a NodePort on
// another listener's port at an address it takes), and a NodePort a local
// socket is bound to (not learned: sockets.go). What stays on the userspace
// path, and why learned VIPs outlive their DNAT rule: docs/internals.md.
package destinations

import (
	"net/netip"
	"slices"
)

// Table maps a wire destination to the listener socket address the kernel
// delivers it to.
type Table = map[netip.AddrPort]netip.AddrPort

// Learned is a destination the kernel was seen translating to a listener.
type Learned struct {
	Dest, Listener netip.AddrPort
}

// Compute returns the table for the given listener socket addresses, the
// node's local addresses and the learned VIPs. Addresses are unmapped and
// stripped of zones; duplicates and invalid entries are ignored.
func Compute(listeners []netip.AddrPort, local []netip.Addr, learned []Learned) Table {
	t := Table{}
	specific := map[netip.AddrPort]bool{}
	var wildcards []netip.AddrPort
	for _, l := range listeners {
		l = normalize(l)
		switch {
		case !l.IsValid() || l.Port() == 0:
		case l.Addr().IsUnspecified():
			wildcards = append(wildcards, l)
		case acceptable(l.Addr()):
			specific[l] = true
			t[l] = l
		}
	}
	for _, w := range wildcards {
		for _, a := range local {
			a = a.Unmap().WithZone("")
			if a.Is4() != w.Addr().Is4() || !acceptable(a) {
				continue
			}
			if d := netip.AddrPortFrom(a, w.Port()); !specific[d] {
				t[d] = w
			}
		}
	}
	known := func(l netip.AddrPort) bool { return specific[l] || slices.Contains(wildcards, l) }
	conflict := map[netip.AddrPort]bool{}
	claims := map[netip.AddrPort]netip.AddrPort{}
	for _, e := range learned {
		d, l := normalize(e.Dest), normalize(e.Listener)
		if !known(l) || !d.IsValid() || d.Port() == 0 || d.Addr().Is4() != l.Addr().Is4() || !acceptable(d.Addr()) {
			continue
		}
		if prev, ok := claims[d]; ok && prev != l {
			conflict[d] = true
		}
		claims[d] = l
	}
	for d, l := range claims {
		if s, ok := t[d]; ok && s != l {
			conflict[d] = true
		}
		if !conflict[d] {
			t[d] = l
		}
	}
	for d := range conflict {
		delete(t, d)
	}
	return t
}

func normalize(ap netip.AddrPort) netip.AddrPort {
	return netip.AddrPortFrom(ap.Addr().Unmap().WithZone(""), ap.Port())
}

// acceptable says whether a datagram to a may be relayed from the wire:
// unicast, and not loopback (a martian the kernel drops).
func acceptable(a netip.Addr) bool {
	return a.IsValid() && !a.IsUnspecified() && !a.IsLoopback() && !a.IsMulticast() &&
		!(a.Is4() && a == netip.AddrFrom4([4]byte{255, 255, 255, 255}))
}
