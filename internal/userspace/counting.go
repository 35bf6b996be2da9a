// Package userspace wraps pion/turn's sockets on the userspace path: pion/turn
// relays whatever the XDP program passes (and everything when XDP is off), and
// the wrappers here count what it relays.
package userspace

import (
	"encoding/binary"
	"fmt"
	"net"
	"sync/atomic"

	"github.com/pion/turn/v4"

	"github.com/l7mp/stunnerd-xdp/internal/shield"
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
	// PeerShortcutPackets counts the datagrams from peers the relay sockets
	// relayed to clients themselves (Replies), not pion/turn's handler: a
	// part of PeerToClientPackets.
	PeerShortcutPackets atomic.Uint64
	// TTLExpired counts the datagrams dropped, in either direction, because
	// they arrived with a TTL (hop limit) of 1 or 0 (see fields.go).
	TTLExpired atomic.Uint64
	// Shield counts what the listeners' shield dropped before pion/turn.
	Shield shield.Counts
}

// ListenerConn wraps pion's listener socket: what pion writes to clients as
// ChannelData or Data indications is peer->client traffic it relayed. With
// Channels, it relays the ChannelData of the channels there itself (see
// Channels) and hands pion the rest.
type ListenerConn struct {
	net.PacketConn
	Counters *Counters
	Channels *Channels // nil: pion relays everything
	// NoShortcut hands pion every datagram, Channels or not (the table then
	// only carries the IP header fields: Channels.ListenerSocket).
	NoShortcut bool
	// Shield drops what pion/turn would discard unanswered before it parses
	// it (nil: nothing).
	Shield *shield.Listener
}

// ReadFrom returns the next datagram that is not relayed here. What the
// shortcut relays in batches goes out before a read that may wait and before
// anything goes to pion (see batch.go).
func (c *ListenerConn) ReadFrom(p []byte) (int, net.Addr, error) {
	t := c.Channels
	if t == nil || c.NoShortcut {
		for {
			n, addr, err := c.PacketConn.ReadFrom(p)
			if err == nil && n < len(p) && c.Shield.Drop(p[:n], addr) {
				continue
			}
			return n, addr, err
		}
	}
	for {
		if n, addr, ok, err := t.handBack(p); ok {
			return n, addr, err
		}
		if t.mustFlush() {
			t.flush()
			continue
		}
		n, addr, err := c.PacketConn.ReadFrom(p)
		// pion drops a datagram that fills its buffer (possibly truncated).
		if err == nil && n < len(p) && (t.relay(p[:n], addr) || c.Shield.Drop(p[:n], addr)) {
			continue
		}
		if t.pending() {
			t.flush()
			if t.handingBack() {
				t.queueBack(p[:n], addr, err)
				continue
			}
		}
		return n, addr, err
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
	if len(p) >= stunHeader && binary.BigEndian.Uint16(p[0:2]) == typeDataIndication {
		return dataAttrLen(p)
	}
	return 0, false
}

// dataAttrLen is the length of the first DATA attribute of the STUN message
// p, where stun.Message's Decode then Get(AttrData) would find it (false:
// Decode fails or there is none), without their copy of the message.
func dataAttrLen(p []byte) (int, bool) {
	size := int(binary.BigEndian.Uint16(p[2:4]))
	if binary.BigEndian.Uint32(p[4:8]) != magicCookie || len(p) < stunHeader+size {
		return 0, false
	}
	b := p[stunHeader : stunHeader+size]
	found := -1
	for offset := 0; offset < size; {
		if len(b) < 4 {
			return 0, false
		}
		typ, l := binary.BigEndian.Uint16(b[0:2]), int(binary.BigEndian.Uint16(b[2:4]))
		b = b[4:]
		if len(b) < padded(l) {
			return 0, false
		}
		if typ == attrData && found < 0 {
			found = l
		}
		b = b[padded(l):]
		offset += 4 + padded(l)
	}
	if found < 0 {
		return 0, false
	}
	return found, true
}

// relayConn wraps a relay socket (the innermost wrapper): what pion writes
// there is client->peer traffic it relayed (from ChannelData or Send
// indications, after its permission check), what it reads peer->client
// traffic; both are charged to the allocation's rate limit (what it reads
// only when pion will relay it: permissions.go), and both carry the IP header
// fields across (see fields.go).
type relayConn struct {
	net.PacketConn
	raw      fieldsConn // PacketConn when it takes fields, else nil
	counters *Counters
	budget   allocBucket
	peers    peers // what pion relays from (PeerHooks)

	owner atomic.Pointer[owner] // set when pion reports the allocation
	last  atomic.Uint64         // packLast of the datagram ReadFrom returned
}

// fieldsConn is a UDP socket that reads and writes datagrams with their IP
// header fields (udpio.Conn).
type fieldsConn interface {
	ReadFromFields(p []byte) (int, net.Addr, udpio.Fields, error)
	WriteToFields(p []byte, addr net.Addr, f udpio.Fields) (int, error)
}

// newRelayConn wraps c, the relay socket of the allocation relayed at relay
// (as pion reports it).
func newRelayConn(c net.PacketConn, relay net.Addr, counters *Counters, limiter *RateLimiter) *relayConn {
	r := &relayConn{PacketConn: c, counters: counters, budget: allocBucket{limiter: limiter}}
	r.budget.relay, _ = udpAddrPort(relay)
	r.raw, _ = c.(fieldsConn)
	return r
}

// Close closes the socket and lets go of the allocation's kernel bucket.
func (c *relayConn) Close() error {
	err := c.PacketConn.Close()
	c.budget.release()
	return err
}

// charge charges a datagram of n bytes read from src to the allocation's
// budget when pion will relay it, and tells whether it may go on to pion; a
// datagram pion drops (no permission for src) costs nothing.
func (c *relayConn) charge(src net.Addr, n int) bool {
	return !c.peers.relays(src) || c.budget.allow(n)
}

func (c *relayConn) WriteTo(p []byte, addr net.Addr) (int, error) {
	var f udpio.Fields
	if o := c.owner.Load(); o != nil && c.raw != nil {
		// Unknown fields (another source's datagram) forward as unknown.
		in, _ := o.t.cur.of(o.client)
		var ok bool
		if f, ok = in.Forwarded(); !ok {
			c.counters.TTLExpired.Add(1)
			return len(p), nil
		}
	}
	if !c.budget.allow(len(p)) {
		// Over the limit: lost as the network loses a datagram.
		return len(p), nil
	}
	var n int
	var err error
	if c.raw != nil {
		n, err = c.raw.WriteToFields(p, addr, f)
	} else {
		n, err = c.PacketConn.WriteTo(p, addr)
	}
	if err == nil {
		c.counters.ClientToPeerPackets.Add(1)
		c.counters.ClientToPeerBytes.Add(uint64(n))
	}
	return n, err
}

// ReadFrom skips the peers' datagrams that are over the allocation's limit
// or whose TTL is expiring.
func (c *relayConn) ReadFrom(p []byte) (int, net.Addr, error) {
	if c.raw == nil {
		for {
			n, addr, err := c.PacketConn.ReadFrom(p)
			if err != nil || c.charge(addr, n) {
				return n, addr, err
			}
		}
	}
	for {
		n, addr, f, err := c.raw.ReadFromFields(p)
		if err != nil {
			return n, addr, err
		}
		if _, ok := f.Forwarded(); !ok {
			c.counters.TTLExpired.Add(1)
			continue
		}
		if c.charge(addr, n) {
			c.last.Store(packLast(n, f))
			return n, addr, nil
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
	// Sockets, when set, learns each socket's innermost wrapper: the set
	// the outermost generator (Sockets.Generator) keeps, whose Channels
	// carry the IP header fields across pion (see fields.go).
	Sockets *RelaySockets
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
	rc := newRelayConn(conn, addr, g.Counters, g.RateLimiter)
	if g.Sockets != nil {
		g.Sockets.addRaw(addr, rc)
	}
	return rc, addr, nil
}
