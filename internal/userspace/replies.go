package userspace

import (
	"crypto/rand"
	"encoding/binary"
	"net"
	"net/netip"

	"github.com/pion/turn/v4"
)

// Replies is the peer->client half of the shortcut: a relay socket relays
// what a peer sends to it itself, as pion/turn's packet handler would (RFC
// 8656 section 11.7 and 10.3): as ChannelData when a channel is bound to the
// peer's address, else as a Data indication when the peer's IP has a
// permission, written to the allocation's client on the server's listener
// socket. pion's handler makes 9 heap allocations per datagram on the way
// (debug-log arguments formatted with debug off, the ChannelData's buffer,
// stun.Build's message and the XOR-PEER-ADDRESS value); this path makes none.
//
// The relay socket is read exactly as pion reads it: the relay socket's
// outermost wrapper (RelaySockets.Generator's) reads through every wrapper
// below it (the peer port filter, the traffic counters, the rate limit's
// charge, the TTL check) into a buffer as long as pion's, and writes through
// the listener socket as pion holds it (the turn guard, ListenerConn's
// counters, the traffic counters, the IP header fields), so that what is
// counted, charged, filtered and carried is what it is with pion alone. What
// it does not relay (a peer with neither a channel nor a permission, a write
// that fails) goes on to pion's handler, which drops it with its log line or
// writes it and logs the error, as it always does.
//
// Which peers pion relays from is the relay socket's peer set, which follows
// pion's own permission and channel events (RelaySockets.PeerHooks): those
// hooks must be installed for the shortcut to relay anything.
type Replies struct {
	sockets  *RelaySockets
	turn     net.PacketConn
	counters *Counters
}

// NewReplies returns the peer->client shortcut of one pion/turn server: the
// relay sockets of sockets (its listener's, made through sockets.Generator
// with RelayAddressGenerator.Sockets set to it), and turnSocket, the listener
// socket as the server is given it (its PacketConnConfig's PacketConn: pion
// writes its ChannelData and Data indications there). Relayed datagrams are
// counted in counters.PeerShortcutPackets.
func NewReplies(sockets *RelaySockets, turnSocket net.PacketConn, counters *Counters) *Replies {
	return &Replies{sockets: sockets, turn: turnSocket, counters: counters}
}

// EventHandler wraps h (whose hooks run first) with the hook that gives an
// allocation's relay socket its way to the client: the client's address as
// pion reports it, which is the address pion's handler writes to. pion
// reports an allocation before it starts reading its relay socket.
func (r *Replies) EventHandler(h turn.EventHandler) turn.EventHandler {
	created := h.OnAllocationCreated
	h.OnAllocationCreated = func(src, dst net.Addr, proto, user, realm string, relay net.Addr, port int) {
		if created != nil {
			created(src, dst, proto, user, realm, relay, port)
		}
		r.allocationCreated(src, relay)
	}
	return h
}

func (r *Replies) allocationCreated(client, relay net.Addr) {
	k, ok := udpAddrPort(relay)
	if !ok {
		return
	}
	r.sockets.mu.Lock()
	defer r.sockets.mu.Unlock()
	s, raw := r.sockets.m[k], r.sockets.raw[k]
	if s == nil || raw == nil {
		return // not a socket of the set, or without the peer set: pion's
	}
	s.reply.Store(&reply{turn: r.turn, client: client, peers: &raw.peers, counters: r.counters})
}

// reply is one allocation's way back to its client. Only the allocation's
// packet handler (one goroutine) uses buf.
type reply struct {
	turn     net.PacketConn
	client   net.Addr
	peers    *peers
	counters *Counters
	buf      []byte // headroom, then the data as long as pion's buffer, then padding
}

const (
	// headroom is the room before the data for the longest header it goes
	// out with: a Data indication's with an IPv6 XOR-PEER-ADDRESS (the STUN
	// header, the 24-byte attribute and DATA's attribute header).
	headroom = stunHeader + 4 + 20 + 4
	// stunHeader: type, length, magic cookie, transaction id.
	stunHeader  = 20
	magicCookie = 0x2112A442

	typeDataIndication = 0x0017 // method Data, class indication
	attrXORPeerAddress = 0x0012
	attrData           = 0x0013
)

// readFrom is relaySocket.ReadFrom with the shortcut: it reads datagrams of
// at most len(p) bytes (what pion's buffer takes; longer ones are cut as in
// pion's buffer) and relays them until one is not relayed here, which it
// returns as pion's own read would.
func (r *reply) readFrom(c net.PacketConn, p []byte) (int, net.Addr, error) {
	if need := headroom + len(p) + 3; len(r.buf) < need {
		r.buf = make([]byte, need)
	}
	data := r.buf[headroom : headroom+len(p)]
	for {
		n, addr, err := c.ReadFrom(data)
		if err != nil {
			return n, addr, err
		}
		if !r.relay(n, addr) {
			return copy(p, data[:n]), addr, nil
		}
	}
}

// relay sends the n bytes of data at r.buf[headroom:] from peer to the client
// as pion would, and reports whether it did.
func (r *reply) relay(n int, peer net.Addr) bool {
	k, ok := udpAddrPort(peer)
	if !ok {
		return false
	}
	set := r.peers.set.Load()
	if set == nil {
		return false
	}
	var msg []byte
	if ch, ok := set.chans[k]; ok {
		msg = channelData(r.buf, n, ch)
	} else if _, ok := set.perms[k.Addr()]; ok {
		if msg, ok = dataIndication(r.buf, n, k); !ok {
			return false
		}
	} else {
		return false // pion drops it and logs that no permission exists
	}
	if w, err := r.turn.WriteTo(msg, r.client); err != nil || w != len(msg) {
		return false
	}
	r.counters.PeerShortcutPackets.Add(1)
	return true
}

// padded is n rounded up to a multiple of 4.
func padded(n int) int { return (n + 3) &^ 3 }

// channelData frames the n bytes of data at buf[headroom:] as ChannelData on
// channel ch, as pion's proto.ChannelData.Encode does: padded with zeros to a
// multiple of 4.
func channelData(buf []byte, n int, ch uint16) []byte {
	msg := buf[headroom-4 : headroom+padded(n)]
	binary.BigEndian.PutUint16(msg[0:2], ch)
	binary.BigEndian.PutUint16(msg[2:4], uint16(n))
	clear(msg[4+n:])
	return msg
}

// dataIndication frames the n bytes of data at buf[headroom:] from peer as a
// Data indication, as pion's stun.Build of it does: a random transaction id,
// XOR-PEER-ADDRESS then DATA, zero padding. false: the random source failed
// (pion's build panics; pion then gets the datagram).
func dataIndication(buf []byte, n int, peer netip.AddrPort) ([]byte, bool) {
	ip := peer.Addr()
	addrLen, family := 4, byte(1)
	if !ip.Is4() {
		addrLen, family = 16, 2
	}
	start := headroom - 4 - (4 + 4 + addrLen) - stunHeader
	msg := buf[start : headroom+padded(n)]
	binary.BigEndian.PutUint16(msg[0:2], typeDataIndication)
	binary.BigEndian.PutUint16(msg[2:4], uint16(len(msg)-stunHeader))
	binary.BigEndian.PutUint32(msg[4:8], magicCookie)
	if _, err := rand.Read(msg[8:stunHeader]); err != nil {
		return nil, false
	}
	a := msg[stunHeader:]
	binary.BigEndian.PutUint16(a[0:2], attrXORPeerAddress)
	binary.BigEndian.PutUint16(a[2:4], uint16(4+addrLen))
	a[4], a[5] = 0, family
	binary.BigEndian.PutUint16(a[6:8], peer.Port()^magicCookie>>16)
	raw := ip.As16()
	src := raw[16-addrLen:]
	// The address XORed with the magic cookie and, for IPv6, the
	// transaction id: the 16 bytes from the message's offset 4.
	for i := range addrLen {
		a[8+i] = src[i] ^ msg[4+i]
	}
	d := a[8+addrLen:]
	binary.BigEndian.PutUint16(d[0:2], attrData)
	binary.BigEndian.PutUint16(d[2:4], uint16(n))
	clear(d[4+n:])
	return msg, true
}
