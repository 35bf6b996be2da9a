package userspace

import (
	"net"
	"net/netip"
	"sync/atomic"

	"github.com/l7mp/stunnerd-xdp/internal/udpio"
)

// IP header fields on the userspace path (RFC 8656 section 14, preferred
// behaviour, as the XDP program does): what is relayed leaves with the TTL
// (hop limit) of the datagram it came in less one and with its TOS byte
// (traffic class: DSCP and ECN); a datagram whose TTL would reach 0 is
// dropped (TTLExpired).
//
// pion/turn reads and writes with net.PacketConn, one datagram per call, so
// the fields cannot travel with the data through pion; they travel beside
// it, along the two paths pion takes, each of them one goroutine that reads
// a datagram and writes what it relays before it reads the next:
//
//   - client->peer: a server's read loop reads the listener socket
//     (listenerSocket records the datagram's source and fields in the
//     server's Channels) and relays ChannelData and Send indications by
//     writing to the allocation's relay socket (relayConn takes the fields
//     when the datagram being handled is its own client's);
//   - peer->client: an allocation's packet handler reads its relay socket
//     (relayConn records the datagram's length and fields) and writes a
//     ChannelData or Data indication of it to the client (listenerSocket takes
//     the fields of the client's allocation when the data is as long as what
//     it read last).
//
// A write that matches nothing (a datagram from another source, a relay
// socket the hooks do not know yet) goes with the socket's defaults (TTL 64,
// TOS 0), as pion alone sends everything. DF is not carried: Linux has no
// per-datagram DF control for IPv4 sends (IP_MTU_DISCOVER is per socket; its
// default, IP_PMTUDISC_WANT, sets DF and fragments only what exceeds a known
// path MTU), so everything pion relays leaves with DF set, where the XDP
// program copies DF from an IPv4 datagram (and sets it for IPv6->IPv4).

// current is the client datagram a server's read loop is handling: its
// source (as the listener socket returned it) and fields. Only the read
// loop writes it, and what reads it runs in the read loop too; the atomics
// keep any other reader from a torn value.
type current struct {
	src    atomic.Pointer[net.UDPAddr]
	fields atomic.Uint32 // udpio.Fields.Pack
}

func (c *current) set(src net.Addr, f udpio.Fields) {
	u, _ := src.(*net.UDPAddr)
	c.src.Store(u)
	c.fields.Store(f.Pack())
}

// of returns the fields of the datagram being handled when it is from
// client; ok is false otherwise.
func (c *current) of(client netip.AddrPort) (udpio.Fields, bool) {
	src := c.src.Load()
	if src == nil {
		return udpio.Fields{}, false
	}
	k, ok := clientKey(src)
	if !ok || k != client {
		return udpio.Fields{}, false
	}
	return udpio.UnpackFields(c.fields.Load()), true
}

// owner is the allocation a relay socket serves: the server's table and the
// client's key there.
type owner struct {
	t      *Channels
	client netip.AddrPort
}

// ListenerSocket wraps a listener socket of the server whose hooks t keeps
// (the innermost wrapper, on the udpio socket): it records the fields of what
// the read loop reads and sends what pion relays to a client with the fields
// of the peer's datagram. Any other conn is returned as it is (no fields).
func (t *Channels) ListenerSocket(c net.PacketConn) net.PacketConn {
	b, ok := c.(*udpio.BatchConn)
	if !ok {
		return c
	}
	t.batch = newSendBatch(b)
	return &listenerSocket{BatchConn: b, t: t}
}

type listenerSocket struct {
	*udpio.BatchConn
	t *Channels
}

func (s *listenerSocket) ReadFrom(p []byte) (int, net.Addr, error) {
	n, addr, f, err := s.ReadFromFields(p)
	if err == nil {
		s.t.cur.set(addr, f)
	}
	return n, addr, err
}

func (s *listenerSocket) WriteTo(p []byte, addr net.Addr) (int, error) {
	return s.WriteToFields(p, addr, s.t.peerFields(p, addr))
}

// peerFields are the fields a datagram pion writes to a client goes with: for
// relayed data as long as what the client's relay socket read last, that
// datagram's, forwarded; otherwise none (the socket's own).
func (t *Channels) peerFields(p []byte, addr net.Addr) udpio.Fields {
	data, ok := relayedData(p)
	if !ok {
		return udpio.Fields{}
	}
	k, ok := clientKey(addr)
	if !ok {
		return udpio.Fields{}
	}
	t.mu.RLock()
	c := t.byClient[k]
	t.mu.RUnlock()
	if c == nil || c.raw == nil {
		return udpio.Fields{}
	}
	last := c.raw.last.Load()
	if int(last&0xFFFF) != data || last>>32 == 0 {
		return udpio.Fields{}
	}
	f, _ := udpio.UnpackFields(uint32(last >> 32)).Forwarded()
	return f
}

// packLast is what relayConn records of a datagram it read: its length and
// fields (0: nothing known).
func packLast(n int, f udpio.Fields) uint64 {
	if n > 0xFFFF {
		return 0
	}
	return uint64(f.Pack())<<32 | uint64(n)
}
