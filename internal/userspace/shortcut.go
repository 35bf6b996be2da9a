package userspace

import (
	"encoding/binary"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"

	"github.com/pion/turn/v4"

	"github.com/l7mp/stunnerd-xdp/internal/udpio"
)

// Channels is one pion/turn server's channel bindings as its event hooks
// report them. ListenerConn relays ChannelData on them itself, exactly as
// pion/turn's handleChannelData would (the data, written to the allocation's
// relay socket, addressed to the channel's peer), and hands pion every other
// datagram. pion's own handling of a ChannelData datagram formats its source
// for three debug logs whether or not they are enabled: 7 heap allocations per
// datagram, a tenth of the userspace path's CPU.
//
// One Channels per server (read loop): pion keeps the allocations of each
// server apart, keyed by the client's address on that server's socket, and
// so does this table. The hooks run synchronously, in the goroutine that
// changes pion's state (the read loop for a ChannelBind, a timer for an
// expiry), so a binding is here once pion holds it and gone once pion drops
// it. A write that fails (a relay socket pion has just closed, a refused
// peer port) leaves the datagram to pion, which writes it and reports the
// error as it always does.
type Channels struct {
	relays   *RelaySockets
	counters *Counters // ShortcutPackets

	mu       sync.RWMutex
	routes   map[chanKey]route
	byClient map[netip.AddrPort]*clientRoutes

	cur current // the datagram the read loop is handling (see fields.go)
	// batch is the read loop's send batch (see batch.go); nil: every
	// datagram goes out as it is relayed.
	batch *sendBatch
}

// chanKey is pion's key of an allocation on one socket (the client's
// address: its IP in 16-byte form and port, no zone) and a channel number.
type chanKey struct {
	client netip.AddrPort
	ch     uint16
}

type route struct {
	relay net.PacketConn // the allocation's relay socket, as pion holds it
	peer  net.Addr       // the channel's peer, as pion holds it
	raw   *relayConn     // relay's innermost wrapper (nil: not ours)
	// conn is raw's socket when it can defer writes to peer into a batch
	// (nil: every write goes out at once).
	conn *udpio.Conn
}

// clientRoutes is what one allocation has here.
type clientRoutes struct {
	relay    net.PacketConn
	raw      *relayConn // the innermost wrapper of relay (nil: not ours)
	channels []uint16
}

// NewChannels returns an empty table over the listener's relay sockets that
// counts what it relays in counters.
func NewChannels(relays *RelaySockets, counters *Counters) *Channels {
	return &Channels{relays: relays, counters: counters, routes: map[chanKey]route{}, byClient: map[netip.AddrPort]*clientRoutes{}}
}

// clientKey is pion's five-tuple fingerprint of a source address (the IP's
// 16-byte form and the port): what pion tells apart, this tells apart.
func clientKey(a net.Addr) (netip.AddrPort, bool) {
	u, ok := a.(*net.UDPAddr)
	if !ok {
		return netip.AddrPort{}, false
	}
	ip := u.IP.To16()
	if ip == nil {
		return netip.AddrPort{}, false
	}
	return netip.AddrPortFrom(netip.AddrFrom16([16]byte(ip)), uint16(u.Port)), true
}

// EventHandler wraps h with the hooks that keep the table: h's hooks run first.
func (t *Channels) EventHandler(h turn.EventHandler) turn.EventHandler {
	created, deleted := h.OnAllocationCreated, h.OnAllocationDeleted
	chCreated, chDeleted := h.OnChannelCreated, h.OnChannelDeleted
	h.OnAllocationCreated = func(src, dst net.Addr, proto, user, realm string, relay net.Addr, port int) {
		if created != nil {
			created(src, dst, proto, user, realm, relay, port)
		}
		t.allocationCreated(src, relay)
	}
	h.OnAllocationDeleted = func(src, dst net.Addr, proto, user, realm string) {
		if deleted != nil {
			deleted(src, dst, proto, user, realm)
		}
		t.allocationDeleted(src)
	}
	h.OnChannelCreated = func(src, dst net.Addr, proto, user, realm string, relay, peer net.Addr, ch uint16) {
		if chCreated != nil {
			chCreated(src, dst, proto, user, realm, relay, peer, ch)
		}
		t.channelCreated(src, peer, ch)
	}
	h.OnChannelDeleted = func(src, dst net.Addr, proto, user, realm string, relay, peer net.Addr, ch uint16) {
		if chDeleted != nil {
			chDeleted(src, dst, proto, user, realm, relay, peer, ch)
		}
		t.channelDeleted(src, ch)
	}
	return h
}

func (t *Channels) allocationCreated(src, relay net.Addr) {
	k, ok := clientKey(src)
	if !ok {
		return
	}
	conn, raw := t.relays.get(relay)
	if raw != nil {
		raw.owner.Store(&owner{t: t, client: k})
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	t.dropClient(k)
	if conn != nil {
		t.byClient[k] = &clientRoutes{relay: conn, raw: raw}
	}
}

func (t *Channels) allocationDeleted(src net.Addr) {
	k, ok := clientKey(src)
	if !ok {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	t.dropClient(k)
}

// dropClient forgets an allocation and its channels; t.mu held.
func (t *Channels) dropClient(k netip.AddrPort) {
	c, ok := t.byClient[k]
	if !ok {
		return
	}
	for _, ch := range c.channels {
		delete(t.routes, chanKey{k, ch})
	}
	delete(t.byClient, k)
}

func (t *Channels) channelCreated(src, peer net.Addr, ch uint16) {
	k, ok := clientKey(src)
	if !ok {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	c, ok := t.byClient[k]
	if !ok {
		// No relay socket known for the allocation: pion relays it.
		return
	}
	ck := chanKey{k, ch}
	if _, ok := t.routes[ck]; !ok {
		c.channels = append(c.channels, ch)
	}
	r := route{relay: c.relay, peer: peer, raw: c.raw}
	if c.raw != nil {
		if uc, ok := c.raw.PacketConn.(*udpio.Conn); ok && c.raw.raw != nil && uc.Takes(peer) {
			r.conn = uc
		}
	}
	t.routes[ck] = r
}

func (t *Channels) channelDeleted(src net.Addr, ch uint16) {
	k, ok := clientKey(src)
	if !ok {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	ck := chanKey{k, ch}
	if _, ok := t.routes[ck]; !ok {
		return
	}
	delete(t.routes, ck)
	if c := t.byClient[k]; c != nil {
		for i, n := range c.channels {
			if n == ch {
				c.channels[i] = c.channels[len(c.channels)-1]
				c.channels = c.channels[:len(c.channels)-1]
				break
			}
		}
	}
}

// Len is the number of channels in the table.
func (t *Channels) Len() int {
	t.mu.RLock()
	defer t.mu.RUnlock()
	return len(t.routes)
}

// relay writes the data of ChannelData p from src to its channel's peer and
// reports whether it did; false leaves p to pion. It takes what pion's
// ChannelData decoding accepts: a length field at most the bytes that follow
// (the rest is padding, ignored), and a number pion bound.
func (t *Channels) relay(p []byte, src net.Addr) bool {
	if len(p) < 4 || p[0]&0xC0 != 0x40 {
		return false
	}
	length := int(binary.BigEndian.Uint16(p[2:4]))
	if length > len(p)-4 {
		return false
	}
	k, ok := clientKey(src)
	if !ok {
		return false
	}
	t.mu.RLock()
	r, ok := t.routes[chanKey{k, binary.BigEndian.Uint16(p[0:2])}]
	t.mu.RUnlock()
	if !ok {
		return false
	}
	if t.batch != nil && (t.batch.b.Len() > 0 || t.batch.listen.Buffered() > 0) {
		// More datagrams come without a wait: batch them. A datagram that
		// cannot join the batch goes to pion, after it (its order).
		if r.conn == nil || len(p) > slotSize {
			return false
		}
		return t.relayDeferred(p, src, r, length)
	}
	data := p[4 : 4+length]
	if n, err := r.relay.WriteTo(data, r.peer); err != nil || n != len(data) {
		return false
	}
	t.counters.ShortcutPackets.Add(1)
	return true
}

// RelaySockets are a listener's relay sockets by address, as its relay
// address generator made them (and as pion holds them), while they are open,
// each with its innermost wrapper (RelayAddressGenerator's, when its Sockets
// is this set).
type RelaySockets struct {
	mu sync.Mutex
	m  map[netip.AddrPort]*relaySocket
	// raw are the innermost wrappers by address, from their allocation until
	// the outermost closes.
	raw map[netip.AddrPort]*relayConn
}

// NewRelaySockets returns an empty set.
func NewRelaySockets() *RelaySockets {
	return &RelaySockets{m: map[netip.AddrPort]*relaySocket{}, raw: map[netip.AddrPort]*relayConn{}}
}

// addRaw records the innermost wrapper of the relay socket at a.
func (s *RelaySockets) addRaw(a net.Addr, c *relayConn) {
	k, ok := udpAddrPort(a)
	if !ok {
		return
	}
	s.mu.Lock()
	s.raw[k] = c
	s.mu.Unlock()
}

// udpAddrPort is a UDP address as the tables here key it: IPv4 unmapped,
// no zone (a relay socket, a peer).
func udpAddrPort(a net.Addr) (netip.AddrPort, bool) {
	u, ok := a.(*net.UDPAddr)
	if !ok {
		return netip.AddrPort{}, false
	}
	ip, ok := netip.AddrFromSlice(u.IP)
	if !ok {
		return netip.AddrPort{}, false
	}
	return netip.AddrPortFrom(ip.Unmap(), uint16(u.Port)), true
}

// get returns the relay socket at a as pion holds it and its innermost
// wrapper (nil: not known).
func (s *RelaySockets) get(a net.Addr) (net.PacketConn, *relayConn) {
	k, ok := udpAddrPort(a)
	if !ok {
		return nil, nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if c, ok := s.m[k]; ok {
		return c, s.raw[k]
	}
	return nil, s.raw[k]
}

// Generator wraps g so that the sockets it makes are in s while open.
func (s *RelaySockets) Generator(g turn.RelayAddressGenerator) turn.RelayAddressGenerator {
	return &socketsGenerator{RelayAddressGenerator: g, s: s}
}

type socketsGenerator struct {
	turn.RelayAddressGenerator
	s *RelaySockets
}

func (g *socketsGenerator) AllocatePacketConn(network string, requestedPort int) (net.PacketConn, net.Addr, error) {
	c, a, err := g.RelayAddressGenerator.AllocatePacketConn(network, requestedPort)
	if err != nil {
		return c, a, err
	}
	k, ok := udpAddrPort(a)
	if !ok {
		return c, a, nil
	}
	rs := &relaySocket{PacketConn: c, s: g.s, key: k}
	g.s.mu.Lock()
	g.s.m[k] = rs
	g.s.mu.Unlock()
	return rs, a, nil
}

// relaySocket leaves the set when closed. With a way back to its client
// (Replies), it relays what peers send itself.
type relaySocket struct {
	net.PacketConn
	s     *RelaySockets
	key   netip.AddrPort
	reply atomic.Pointer[reply]
}

func (c *relaySocket) ReadFrom(p []byte) (int, net.Addr, error) {
	if r := c.reply.Load(); r != nil {
		return r.readFrom(c.PacketConn, p)
	}
	return c.PacketConn.ReadFrom(p)
}

func (c *relaySocket) Close() error {
	c.s.mu.Lock()
	if c.s.m[c.key] == c {
		delete(c.s.m, c.key)
		delete(c.s.raw, c.key)
	}
	c.s.mu.Unlock()
	return c.PacketConn.Close()
}
