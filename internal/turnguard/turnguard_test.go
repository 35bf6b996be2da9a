package turnguard

import (
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pion/stun/v3"
	"github.com/pion/turn/v4"
)

const realm = "test"

// clockOffset moves the Guards' clock in tests.
var clockOffset atomic.Int64

// server is a pion/turn server on loopback with the Guard in front, as the
// daemon runs it; configure sets the Guard's
// limits before the server starts (its goroutines read them unsynchronised).
func server(t *testing.T, configure ...func(*Guard)) (*Guard, net.Addr) {
	t.Helper()
	c, err := net.ListenPacket("udp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	key := turn.GenerateAuthKey("alice", realm, "a")
	auth := func(user, _ string, _ net.Addr) ([]byte, bool) { return key, user == "alice" }
	g := New(auth, nil)
	// The clock tests move: an offset read atomically, since the server's
	// goroutines read it and UDP gives the race detector no order.
	g.Now = func() time.Time { return time.Now().Add(time.Duration(clockOffset.Load())) }
	for _, f := range configure {
		f(g)
	}
	srv, err := turn.NewServer(turn.ServerConfig{Realm: realm, AuthHandler: auth, EventHandler: g.Hooks(turn.EventHandler{}),
		PacketConnConfigs: []turn.PacketConnConfig{{PacketConn: g.PacketConn(c),
			RelayAddressGenerator: &turn.RelayAddressGeneratorStatic{RelayAddress: net.IPv4(127, 0, 0, 1), Address: "127.0.0.1"}}}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close() })
	return g, c.LocalAddr()
}

func exchange(t *testing.T, c net.PacketConn, to net.Addr, setters ...stun.Setter) *stun.Message {
	t.Helper()
	m := stun.MustBuild(append([]stun.Setter{stun.TransactionID}, setters...)...)
	if _, err := c.WriteTo(m.Raw, to); err != nil {
		t.Fatal(err)
	}
	_ = c.SetReadDeadline(time.Now().Add(2 * time.Second))
	buf := make([]byte, 1500)
	for {
		n, _, err := c.ReadFrom(buf)
		if err != nil {
			t.Fatal(err)
		}
		res := &stun.Message{Raw: append([]byte(nil), buf[:n]...)}
		if res.Decode() == nil && res.TransactionID == m.TransactionID {
			return res
		}
	}
}

func code(m *stun.Message) stun.ErrorCode {
	var e stun.ErrorCodeAttribute
	if m.Type.Class != stun.ClassErrorResponse || e.GetFrom(m) != nil {
		return 0
	}
	return e.Code
}

// A nonce pion hands out is refused with 438 once NonceLifetime has passed
// (pion accepts it for an hour), and accepted before; the 438 carries a fresh
// nonce, with which the request succeeds.
func TestNonceExpires(t *testing.T) {
	g, addr := server(t)
	c, err := net.ListenPacket("udp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	res := exchange(t, c, addr, stun.NewType(stun.MethodAllocate, stun.ClassRequest))
	var nonce stun.Nonce
	if code(res) != stun.CodeUnauthorized || nonce.GetFrom(res) != nil {
		t.Fatalf("first Allocate: %v", res)
	}
	issued := time.Now()
	defer clockOffset.Store(0)
	at := func(d time.Duration) { clockOffset.Store(int64(time.Until(issued.Add(d)))) }
	auth := func(n stun.Nonce) []stun.Setter {
		return []stun.Setter{stun.NewUsername("alice"), stun.NewRealm(realm), n, stun.NewLongTermIntegrity("alice", realm, "a"), stun.Fingerprint}
	}
	alloc := append([]stun.Setter{stun.NewType(stun.MethodAllocate, stun.ClassRequest),
		stun.RawAttribute{Type: stun.AttrRequestedTransport, Value: []byte{17, 0, 0, 0}}}, auth(nonce)...)
	if res := exchange(t, c, addr, alloc...); res.Type.Class != stun.ClassSuccessResponse {
		t.Fatalf("Allocate with a fresh nonce: %v", res)
	}
	refresh := func(n stun.Nonce) *stun.Message {
		return exchange(t, c, addr, append([]stun.Setter{stun.NewType(stun.MethodRefresh, stun.ClassRequest)}, auth(n)...)...)
	}
	at(8 * time.Minute)
	if res := refresh(nonce); res.Type.Class != stun.ClassSuccessResponse {
		t.Fatalf("Refresh with an 8-minute-old nonce: %v, want a success", res)
	}
	at(NonceLifetime + time.Second)
	res = refresh(nonce)
	var fresh stun.Nonce
	if code(res) != stun.CodeStaleNonce || fresh.GetFrom(res) != nil {
		t.Fatalf("Refresh with a nonce older than %v: %v, want 438 Stale Nonce", NonceLifetime, res)
	}
	clockOffset.Store(0)
	if res := refresh(fresh); res.Type.Class != stun.ClassSuccessResponse {
		t.Fatalf("Refresh with the 438's nonce: %v", res)
	}
	if stale := g.Counts().StaleNonces.Load(); stale != 1 {
		t.Fatalf("%d stale nonces counted, want 1", stale)
	}
	if g.Allocations() != 1 {
		t.Fatalf("the guard knows %d allocations, want 1", g.Allocations())
	}
}

// An allocation binds at most MaxChannels channels: a ChannelBind for one
// more gets 508 (pion would bind up to 0x7FFF-0x4000), a refresh of a bound
// one passes, and another allocation has its own count.
func TestChannelLimit(t *testing.T) {
	g, addr := server(t, func(g *Guard) { g.MaxChannels = 2 })
	allocate := func() (net.PacketConn, stun.Nonce) {
		c, err := net.ListenPacket("udp4", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		res := exchange(t, c, addr, stun.NewType(stun.MethodAllocate, stun.ClassRequest))
		var nonce stun.Nonce
		if nonce.GetFrom(res) != nil {
			t.Fatalf("first Allocate: %v", res)
		}
		if res := exchange(t, c, addr, stun.NewType(stun.MethodAllocate, stun.ClassRequest),
			stun.RawAttribute{Type: stun.AttrRequestedTransport, Value: []byte{17, 0, 0, 0}},
			stun.NewUsername("alice"), stun.NewRealm(realm), nonce, stun.NewLongTermIntegrity("alice", realm, "a"), stun.Fingerprint); res.Type.Class != stun.ClassSuccessResponse {
			t.Fatalf("Allocate: %v", res)
		}
		return c, nonce
	}
	bind := func(c net.PacketConn, nonce stun.Nonce, ch uint16) *stun.Message {
		peer := stun.XORMappedAddress{IP: net.IPv4(192, 0, 2, 1), Port: int(ch)}
		return exchange(t, c, addr, stun.NewType(stun.MethodChannelBind, stun.ClassRequest),
			stun.RawAttribute{Type: stun.AttrChannelNumber, Value: []byte{byte(ch >> 8), byte(ch), 0, 0}},
			stun.RawAttribute{Type: stun.AttrXORPeerAddress, Value: xorPeer(t, peer)},
			stun.NewUsername("alice"), stun.NewRealm(realm), nonce, stun.NewLongTermIntegrity("alice", realm, "a"), stun.Fingerprint)
	}
	c, nonce := allocate()
	for ch := uint16(0x4000); ch < 0x4002; ch++ {
		if res := bind(c, nonce, ch); res.Type.Class != stun.ClassSuccessResponse {
			t.Fatalf("ChannelBind %#x: %v", ch, res)
		}
	}
	res := bind(c, nonce, 0x4002)
	if code(res) != stun.CodeInsufficientCapacity {
		t.Fatalf("a third channel: %v, want 508", res)
	}
	if err := stun.NewLongTermIntegrity("alice", realm, "a").Check(res); err != nil {
		t.Errorf("the 508 carries no integrity: %v", err)
	}
	if res := bind(c, nonce, 0x4001); res.Type.Class != stun.ClassSuccessResponse {
		t.Fatalf("a refresh of a bound channel: %v", res)
	}
	other, nonce2 := allocate()
	if res := bind(other, nonce2, 0x4000); res.Type.Class != stun.ClassSuccessResponse {
		t.Fatalf("another allocation's first channel: %v", res)
	}
	if refused := g.Counts().ChannelsRefused.Load(); refused != 1 {
		t.Fatalf("%d ChannelBinds refused, want 1", refused)
	}
}

// xorPeer is the value of an XOR-PEER-ADDRESS attribute for a.
func xorPeer(t *testing.T, a stun.XORMappedAddress) []byte {
	t.Helper()
	m := new(stun.Message)
	m.TransactionID = [stun.TransactionIDSize]byte{}
	if err := a.AddToAs(m, stun.AttrXORPeerAddress); err != nil {
		t.Fatal(err)
	}
	v, err := m.Get(stun.AttrXORPeerAddress)
	if err != nil {
		t.Fatal(err)
	}
	return v
}

// peerAttr is an XOR-PEER-ADDRESS setter: added after the transaction ID, it
// is XORed with it as an IPv6 peer must be.
type peerAttr stun.XORMappedAddress

func (p peerAttr) AddTo(m *stun.Message) error {
	return stun.XORMappedAddress(p).AddToAs(m, stun.AttrXORPeerAddress)
}

// A CreatePermission or ChannelBind naming a peer the policy refuses gets
// 403 with integrity, for IPv4 and IPv6 peers and when any one of several
// peers is refused; pion alone answers an error without a code. An admitted
// peer passes.
func TestRefusedPeerGets403(t *testing.T) {
	refused := []net.IPNet{
		{IP: net.IPv4(10, 0, 0, 0), Mask: net.CIDRMask(8, 32)},
		{IP: net.ParseIP("fc00::"), Mask: net.CIDRMask(7, 128)},
	}
	g, addr := server(t, func(g *Guard) {
		g.Peers = func(_ net.Addr, peer net.IP) bool {
			for _, n := range refused {
				if n.Contains(peer) {
					return false
				}
			}
			return true
		}
	})
	c, err := net.ListenPacket("udp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	var nonce stun.Nonce
	if res := exchange(t, c, addr, stun.NewType(stun.MethodAllocate, stun.ClassRequest)); nonce.GetFrom(res) != nil {
		t.Fatalf("first Allocate: %v", res)
	}
	auth := []stun.Setter{stun.NewUsername("alice"), stun.NewRealm(realm), nonce, stun.NewLongTermIntegrity("alice", realm, "a"), stun.Fingerprint}
	if res := exchange(t, c, addr, append([]stun.Setter{stun.NewType(stun.MethodAllocate, stun.ClassRequest),
		stun.RawAttribute{Type: stun.AttrRequestedTransport, Value: []byte{17, 0, 0, 0}}}, auth...)...); res.Type.Class != stun.ClassSuccessResponse {
		t.Fatalf("Allocate: %v", res)
	}
	permit := func(peers ...string) *stun.Message {
		s := []stun.Setter{stun.NewType(stun.MethodCreatePermission, stun.ClassRequest)}
		for _, p := range peers {
			s = append(s, peerAttr{IP: net.ParseIP(p), Port: 5000})
		}
		return exchange(t, c, addr, append(s, auth...)...)
	}
	for _, peers := range [][]string{{"10.1.2.3"}, {"fd00::7"}, {"192.0.2.1", "10.9.9.9"}} {
		res := permit(peers...)
		if code(res) != stun.CodeForbidden {
			t.Fatalf("CreatePermission %v: %v, want 403", peers, res)
		}
		if err := stun.NewLongTermIntegrity("alice", realm, "a").Check(res); err != nil {
			t.Errorf("the 403 carries no integrity: %v", err)
		}
	}
	if res := permit("192.0.2.1"); res.Type.Class != stun.ClassSuccessResponse {
		t.Fatalf("CreatePermission to an admitted peer: %v", res)
	}
	bind := exchange(t, c, addr, append([]stun.Setter{stun.NewType(stun.MethodChannelBind, stun.ClassRequest),
		stun.RawAttribute{Type: stun.AttrChannelNumber, Value: []byte{0x40, 0, 0, 0}},
		peerAttr{IP: net.IPv4(10, 1, 2, 3), Port: 5000}}, auth...)...)
	if code(bind) != stun.CodeForbidden {
		t.Fatalf("ChannelBind to a refused peer: %v, want 403", bind)
	}
	if n := g.Counts().PeersRefused.Load(); n != 4 {
		t.Fatalf("%d requests refused for their peer, want 4", n)
	}
}
