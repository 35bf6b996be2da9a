// Package fallback wraps pion/turn's sockets on the userspace path: pion/turn
// relays whatever the XDP program passes (and everything when XDP is off), and
// the wrappers here count what it relays.
package fallback

import (
	"encoding/binary"
	"fmt"
	"net"
	"sync/atomic"

	"github.com/pion/stun/v3"
	"github.com/pion/turn/v4"

	"github.com/l7mp/stunnerd-xdp/internal/udpio"
)

// Counters count packets and application-data bytes relayed in userspace.
type Counters struct {
	ClientToPeerPackets, ClientToPeerBytes atomic.Uint64
	PeerToClientPackets, PeerToClientBytes atomic.Uint64
	// RateLimited counts the datagrams dropped over the allocation rate limit.
	RateLimited atomic.Uint64
	// ShortcutPackets counts the ChannelData datagrams the read loops relayed
	// themselves (Channels), not pion/turn's handler: a part of
	// ClientToPeerPackets.
	ShortcutPackets atomic.Uint64
}

// ListenerConn wraps pion's listener socket: what pion writes to clients as
// ChannelData or Data indications is peer->client traffic it relayed. With
// Channels, it relays the ChannelData of the channels there itself (see
// Channels) and hands pion the rest.
type ListenerConn struct {
	net.PacketConn
	Counters *Counters
	Channels *Channels // nil: pion relays everything
}

// ReadFrom returns the next datagram that is not relayed here.
func (c *ListenerConn) ReadFrom(p []byte) (int, net.Addr, error) {
	for {
		n, addr, err := c.PacketConn.ReadFrom(p)
		// pion drops a datagram that fills its buffer (possibly truncated).
		if err != nil || c.Channels == nil || n >= len(p) || !c.Channels.relay(p[:n], addr) {
			return n, addr, err
		}
	}
}

func (c *ListenerConn) WriteTo(p []byte, addr net.Addr) (int, error) {
	n, err := c.PacketConn.WriteTo(p, addr)
	if err == nil {
		if data, ok := relayedData(p); ok {
			c.Counters.PeerToClientPackets.Add(1)
			c.Counters.PeerToClientBytes.Add(uint64(data))
		}
	}
	return n, err
}

// relayedData reports whether p carries relayed peer data, and how much.
func relayedData(p []byte) (int, bool) {
	if len(p) >= 4 && p[0]&0xC0 == 0x40 {
		return int(binary.BigEndian.Uint16(p[2:4])), true
	}
	// A Data indication: method Data (0x007), class indication: type 0x0017.
	if len(p) >= 20 && binary.BigEndian.Uint16(p[0:2]) == 0x0017 {
		m := &stun.Message{Raw: append([]byte(nil), p...)}
		if err := m.Decode(); err != nil {
			return 0, false
		}
		v, err := m.Get(stun.AttrData)
		if err != nil {
			return 0, false
		}
		return len(v), true
	}
	return 0, false
}

// relayConn wraps a relay socket: what pion writes there is client->peer
// traffic it relayed (from ChannelData or Send indications), what it reads
// peer->client traffic; both are charged to the allocation's rate limit.
type relayConn struct {
	net.PacketConn
	counters *Counters
	budget   allocBucket
}

func (c *relayConn) WriteTo(p []byte, addr net.Addr) (int, error) {
	if !c.budget.allow(len(p)) {
		// Over the limit: lost as the network loses a datagram.
		return len(p), nil
	}
	n, err := c.PacketConn.WriteTo(p, addr)
	if err == nil {
		c.counters.ClientToPeerPackets.Add(1)
		c.counters.ClientToPeerBytes.Add(uint64(n))
	}
	return n, err
}

// ReadFrom skips the peers' datagrams that are over the allocation's limit.
func (c *relayConn) ReadFrom(p []byte) (int, net.Addr, error) {
	for {
		n, addr, err := c.PacketConn.ReadFrom(p)
		if err != nil || c.budget.allow(n) {
			return n, addr, err
		}
	}
}

// RelayAddressGenerator allocates relay sockets bound to the relay address in
// the configured port range and counts what pion relays through them.
type RelayAddressGenerator struct {
	turn.RelayAddressGeneratorPortRange
	Counters *Counters
	// RateLimiter limits each allocation (nil: no limit).
	RateLimiter *RateLimiter
}

// AllocatePacketConn implements turn.RelayAddressGenerator.
func (g *RelayAddressGenerator) AllocatePacketConn(network string, requestedPort int) (net.PacketConn, net.Addr, error) {
	conn, addr, err := g.RelayAddressGeneratorPortRange.AllocatePacketConn(network, requestedPort)
	if err != nil {
		return nil, nil, fmt.Errorf("allocate relay socket: %w", err)
	}
	// pion reads and writes a relay socket one datagram per system call:
	// raw ones (udpio.Conn) spare the scheduler's handoffs and the address
	// allocated per datagram read.
	if w, err := udpio.NewConn(conn); err == nil {
		conn = w
	}
	return &relayConn{PacketConn: conn, counters: g.Counters, budget: allocBucket{limiter: g.RateLimiter}}, addr, nil
}
