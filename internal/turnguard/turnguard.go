// Package turnguard checks the STUN requests of a pion/turn server before
// pion does, for the per-allocation rules pion/turn v4 leaves out:
//
//   - An allocation's credentials are bound to it (RFC 8656 section 5): a
//     request on an allocation's 5-tuple authenticated with another username
//     gets 441 (Wrong Credentials). pion accepts any valid credentials there,
//     so bob's Refresh(0) from alice's 5-tuple deleted alice's allocation.
//   - Nonces expire: pion/turn v4 accepts a nonce for an hour; here for
//     NonceLifetime (coturn's 600 s). A request with an older nonce has its
//     NONCE made unreadable in place, so that pion answers 438 (Stale Nonce)
//     with a fresh one, as for any nonce it rejects, and the client retries.
//   - An allocation holds at most MaxChannels channels: a ChannelBind for a
//     new channel beyond them gets 508 (Insufficient Capacity, RFC 8656
//     section 12.2); refreshes of its channels pass. pion has no hook that
//     sees a channel before it binds it, and one allocation bound 4,000.
//   - A CreatePermission or ChannelBind for a peer the policy refuses
//     (Peers) gets 403 (Forbidden, RFC 8656 sections 9.1 and 11.2): pion
//     answers its permission handler's refusal with an error response that
//     carries no error code, which clients cannot tell from a failure.
//
// A Guard serves one pion/turn server (one socket's or one TCP listener's
// allocations): the server's EventHandler tells it who allocated from where
// and which channels each allocation holds (Hooks), and its conns pass it
// each request (PacketConn for UDP, Filter for connlimit's TCP and TLS
// connections).
package turnguard

import (
	"encoding/binary"
	"math/big"
	"net"
	"net/netip"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/pion/stun/v3"
	"github.com/pion/turn/v4"
)

// NonceLifetime is how long a nonce is accepted, as coturn's default.
// pion stamps a nonce with the minute it was made, so one made in a minute
// expires 9 to 10 minutes after it was handed out.
const NonceLifetime = 600 * time.Second

// Guard is the check for one pion/turn server.
type Guard struct {
	auth turn.AuthHandler
	// Now is the clock (tests move it).
	Now           func() time.Time
	NonceLifetime time.Duration
	// MaxChannels bounds the channels of one allocation (0: no limit).
	MaxChannels int
	// Peers, when set, is the peer policy (pion's PermissionHandler): a
	// CreatePermission or ChannelBind naming a peer it refuses gets 403.
	Peers func(client net.Addr, peer net.IP) bool

	mu     sync.RWMutex
	allocs map[netip.AddrPort]*alloc // by the allocation's client address

	counts *Counts
}

// Counts are what Guards refused; one Counts may serve many Guards.
type Counts struct {
	// WrongCredentials got 441, ChannelsRefused 508, PeersRefused 403;
	// StaleNonces were handed to pion unreadable (438).
	WrongCredentials, StaleNonces, ChannelsRefused, PeersRefused atomic.Uint64
}

// alloc is what the Guard knows of one allocation.
type alloc struct {
	user     string
	channels map[uint16]struct{}
}

// New returns a Guard authenticating with auth, the server's AuthHandler,
// counting in counts (nil: its own).
func New(auth turn.AuthHandler, counts *Counts) *Guard {
	if counts == nil {
		counts = &Counts{}
	}
	return &Guard{auth: auth, Now: time.Now, NonceLifetime: NonceLifetime, allocs: map[netip.AddrPort]*alloc{}, counts: counts}
}

// Counts are what g refused (shared with the Guards that share its Counts).
func (g *Guard) Counts() *Counts { return g.counts }

func addrPort(a net.Addr) netip.AddrPort {
	switch a := a.(type) {
	case *net.UDPAddr:
		return a.AddrPort()
	case *net.TCPAddr:
		return a.AddrPort()
	}
	if a == nil {
		return netip.AddrPort{}
	}
	ap, _ := netip.ParseAddrPort(a.String())
	return ap
}

func norm(ap netip.AddrPort) netip.AddrPort {
	return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())
}

// Hooks records the username and the channels of each allocation of h's
// server while it lives; the hooks of h run after.
func (g *Guard) Hooks(h turn.EventHandler) turn.EventHandler {
	created, deleted := h.OnAllocationCreated, h.OnAllocationDeleted
	h.OnAllocationCreated = func(src, dst net.Addr, proto, user, realm string, relay net.Addr, port int) {
		g.mu.Lock()
		g.allocs[norm(addrPort(src))] = &alloc{user: user, channels: map[uint16]struct{}{}}
		g.mu.Unlock()
		if created != nil {
			created(src, dst, proto, user, realm, relay, port)
		}
	}
	h.OnAllocationDeleted = func(src, dst net.Addr, proto, user, realm string) {
		g.mu.Lock()
		delete(g.allocs, norm(addrPort(src)))
		g.mu.Unlock()
		if deleted != nil {
			deleted(src, dst, proto, user, realm)
		}
	}
	chCreated, chDeleted := h.OnChannelCreated, h.OnChannelDeleted
	h.OnChannelCreated = func(src, dst net.Addr, proto, user, realm string, relay, peer net.Addr, ch uint16) {
		g.channel(src, ch, true)
		if chCreated != nil {
			chCreated(src, dst, proto, user, realm, relay, peer, ch)
		}
	}
	h.OnChannelDeleted = func(src, dst net.Addr, proto, user, realm string, relay, peer net.Addr, ch uint16) {
		g.channel(src, ch, false)
		if chDeleted != nil {
			chDeleted(src, dst, proto, user, realm, relay, peer, ch)
		}
	}
	return h
}

func (g *Guard) channel(src net.Addr, ch uint16, bound bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	a := g.allocs[norm(addrPort(src))]
	switch {
	case a == nil:
	case bound:
		a.channels[ch] = struct{}{}
	default:
		delete(a.channels, ch)
	}
}

// Allocations is how many allocations the Guard knows the username of.
func (g *Guard) Allocations() int {
	g.mu.RLock()
	defer g.mu.RUnlock()
	return len(g.allocs)
}

const (
	magicCookie  = 0x2112a442
	headerSize   = 20
	attrUsername = 0x0006
	attrNonce    = 0x0015
	attrChannel  = 0x000c
	attrXORPeer  = 0x0012
)

// Check looks at one datagram or frame b from src before pion does. It may
// rewrite b's NONCE in place (a stale nonce); it returns a response for src
// when pion must not see b (441).
func (g *Guard) Check(src net.Addr, b []byte) (reply []byte) {
	// STUN requests only: the top bits zero, the magic cookie, class
	// request (C1 C0 = 0 0); ChannelData and indications pass at once.
	if len(b) < headerSize || b[0]&0xc0 != 0 || binary.BigEndian.Uint32(b[4:]) != magicCookie {
		return nil
	}
	typ := binary.BigEndian.Uint16(b)
	if typ&0x0110 != 0 {
		return nil
	}
	var username, nonce, channel []byte
	var peers [][]byte
	end := min(len(b), headerSize+int(binary.BigEndian.Uint16(b[2:])))
	for off := headerSize; off+4 <= end; {
		t, l := binary.BigEndian.Uint16(b[off:]), int(binary.BigEndian.Uint16(b[off+2:]))
		v := off + 4
		if v+l > end {
			break
		}
		switch t {
		case attrUsername:
			username = b[v : v+l]
		case attrNonce:
			nonce = b[v : v+l]
		case attrChannel:
			channel = b[v : v+l]
		case attrXORPeer:
			peers = append(peers, b[v:v+l])
		}
		off = v + (l+3)&^3
	}
	if nonce != nil && g.stale(nonce) {
		g.counts.StaleNonces.Add(1)
		// Not base36: pion's nonce check fails, it answers 438 with a
		// fresh nonce before it looks at the credentials.
		for i := range nonce {
			nonce[i] = '!'
		}
		return nil
	}
	// The method's bits, without the class bits woven between them.
	method := stun.Method(typ&0x000f | (typ&0x00e0)>>1 | (typ&0x3e00)>>2)
	if username == nil || (method != stun.MethodRefresh && method != stun.MethodCreatePermission && method != stun.MethodChannelBind) {
		return nil
	}
	g.mu.RLock()
	a := g.allocs[norm(addrPort(src))]
	var owner string
	full := false
	if a != nil {
		owner = a.user
		if method == stun.MethodChannelBind && g.MaxChannels > 0 && len(a.channels) >= g.MaxChannels && len(channel) >= 2 {
			_, bound := a.channels[binary.BigEndian.Uint16(channel)]
			full = !bound // a refresh of a bound channel passes
		}
	}
	g.mu.RUnlock()
	switch {
	case a == nil:
		return nil
	case owner != string(username):
		return g.refuse(src, b, method, stun.CodeWrongCredentials, "Wrong Credentials", &g.counts.WrongCredentials)
	case method != stun.MethodRefresh && g.refusedPeer(src, b, peers):
		return g.refuse(src, b, method, stun.CodeForbidden, "Forbidden", &g.counts.PeersRefused)
	case full:
		return g.refuse(src, b, method, stun.CodeInsufficientCapacity, "Channel limit of the allocation", &g.counts.ChannelsRefused)
	}
	return nil
}

// refusedPeer reports whether the policy refuses one of the XOR-PEER-ADDRESS
// values of request b. One that does not decode is left to pion (400).
func (g *Guard) refusedPeer(src net.Addr, b []byte, peers [][]byte) bool {
	if g.Peers == nil {
		return false
	}
	for _, v := range peers {
		ip, ok := xorPeerIP(b, v)
		if ok && !g.Peers(src, ip) {
			return true
		}
	}
	return false
}

// xorPeerIP decodes an XOR-PEER-ADDRESS value v of message b (RFC 8489
// section 14.2: the address XORed with the magic cookie, and for IPv6 with
// the transaction ID after it).
func xorPeerIP(b, v []byte) (net.IP, bool) {
	if len(v) < 4 {
		return nil, false
	}
	var n int
	switch v[1] {
	case 0x01:
		n = net.IPv4len
	case 0x02:
		n = net.IPv6len
	default:
		return nil, false
	}
	if len(v) < 4+n {
		return nil, false
	}
	ip := make(net.IP, n)
	for i := range ip {
		ip[i] = v[4+i] ^ b[4+i] // b[4:20]: the cookie, then the transaction ID
	}
	return ip, true
}

// refuse answers code to an authenticated request (441: valid credentials,
// but not its allocation's; 403: a refused peer; 508: over the channel limit), counting it in n;
// a request that does not authenticate goes to pion, which answers it as it
// would (400, 401, 438) without touching the allocation.
func (g *Guard) refuse(src net.Addr, b []byte, method stun.Method, code stun.ErrorCode, reason string, n *atomic.Uint64) []byte {
	m := &stun.Message{Raw: append([]byte(nil), b...)}
	if err := m.Decode(); err != nil {
		return nil
	}
	var user stun.Username
	var realm stun.Realm
	if user.GetFrom(m) != nil || realm.GetFrom(m) != nil {
		return nil
	}
	key, ok := g.auth(user.String(), realm.String(), src)
	if !ok || stun.MessageIntegrity(key).Check(m) != nil {
		return nil
	}
	n.Add(1)
	res, err := stun.Build(&stun.Message{TransactionID: m.TransactionID}, stun.NewType(method, stun.ClassErrorResponse),
		&stun.ErrorCodeAttribute{Code: code, Reason: []byte(reason)},
		stun.MessageIntegrity(key), stun.Fingerprint)
	if err != nil {
		return nil
	}
	return res.Raw
}

// stale says whether nonce is one of pion/turn v4's (base36 of a 4-byte
// minute stamp and a 12-byte HMAC) older than the lifetime. Anything else
// is left to pion.
func (g *Guard) stale(nonce []byte) bool {
	if len(nonce) == 0 || len(nonce) > 32 {
		return false
	}
	n, ok := new(big.Int).SetString(strings.ToLower(string(nonce)), 36)
	if !ok || n.Sign() < 0 || n.BitLen() > 16*8 {
		return false
	}
	var raw [16]byte
	n.FillBytes(raw[:])
	issued := time.Unix(int64(binary.BigEndian.Uint32(raw[:4]))*60, 0)
	return g.Now().Sub(issued) > g.NonceLifetime
}

// PacketConn puts the Guard in front of pion's reads from c, a UDP
// listener's socket: a 441 is sent from here and the request never reaches
// pion.
func (g *Guard) PacketConn(c net.PacketConn) net.PacketConn { return &packetConn{PacketConn: c, g: g} }

type packetConn struct {
	net.PacketConn
	g *Guard
}

func (c *packetConn) ReadFrom(p []byte) (int, net.Addr, error) {
	for {
		n, addr, err := c.PacketConn.ReadFrom(p)
		if err != nil || n == 0 {
			return n, addr, err
		}
		if reply := c.g.Check(addr, p[:n]); reply != nil {
			_, _ = c.PacketConn.WriteTo(reply, addr)
			continue
		}
		return n, addr, nil
	}
}

// Filter is the Guard as a connlimit.Filter, for a TCP or TLS connection's
// frames.
func (g *Guard) Filter(c net.Conn, frame []byte) bool {
	if reply := g.Check(c.RemoteAddr(), frame); reply != nil {
		_, _ = c.Write(reply)
		return false
	}
	return true
}
