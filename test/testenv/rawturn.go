package testenv

import (
	"encoding/binary"
	"net"
	"testing"
	"time"

	"github.com/pion/stun/v3"
)

// RawTURN is a client that sends the requests turn.Client cannot (a short
// LIFETIME, an Allocate again on the same socket).
type RawTURN struct {
	T      testing.TB
	Conn   net.PacketConn
	Server net.Addr
	User   string
	Key    stun.MessageIntegrity
	// Realm and Nonce are learned from the first 401.
	Realm stun.Realm
	Nonce stun.Nonce
}

// Do sends a request of method with attrs (authenticated once a nonce is
// known) and returns the response.
func (c *RawTURN) Do(method stun.Method, attrs ...stun.Setter) *stun.Message {
	c.T.Helper()
	setters := append([]stun.Setter{stun.TransactionID, stun.NewType(method, stun.ClassRequest)}, attrs...)
	if c.Nonce != nil {
		setters = append(setters, stun.NewUsername(c.User), c.Realm, c.Nonce, c.Key)
	}
	req := stun.MustBuild(append(setters, stun.Fingerprint)...)
	if _, err := c.Conn.WriteTo(req.Raw, c.Server); err != nil {
		c.T.Fatal(err)
	}
	buf := make([]byte, 1500)
	for {
		if err := c.Conn.SetReadDeadline(time.Now().Add(Timeout(5 * time.Second))); err != nil {
			c.T.Fatal(err)
		}
		n, _, err := c.Conn.ReadFrom(buf)
		if err != nil {
			c.T.Fatalf("%v response: %v", method, err)
		}
		res := &stun.Message{Raw: append([]byte(nil), buf[:n]...)}
		if err := res.Decode(); err != nil || res.TransactionID != req.TransactionID {
			continue
		}
		return res
	}
}

// Allocate allocates for lifetime and returns the relayed address.
func (c *RawTURN) Allocate(lifetime time.Duration) net.Addr {
	c.T.Helper()
	transport := stun.RawAttribute{Type: stun.AttrRequestedTransport, Value: []byte{17, 0, 0, 0}}
	lt := make([]byte, 4)
	binary.BigEndian.PutUint32(lt, uint32(lifetime/time.Second))
	attrs := []stun.Setter{transport, stun.RawAttribute{Type: stun.AttrLifetime, Value: lt}}
	res := c.Do(stun.MethodAllocate, attrs...)
	if c.Nonce == nil { // 401: learn the realm and nonce, then authenticate
		c.Nonce, c.Realm = stun.Nonce{}, stun.Realm{}
		if err := c.Nonce.GetFrom(res); err != nil {
			c.T.Fatalf("Allocate: no nonce in %v", res)
		}
		if err := c.Realm.GetFrom(res); err != nil {
			c.T.Fatalf("Allocate: no realm in %v", res)
		}
		res = c.Do(stun.MethodAllocate, attrs...)
	}
	var relay stun.XORMappedAddress
	if res.Type.Class != stun.ClassSuccessResponse || relay.GetFromAs(res, stun.AttrXORRelayedAddress) != nil {
		c.T.Fatalf("Allocate: %v", res)
	}
	return &net.UDPAddr{IP: relay.IP, Port: relay.Port}
}

// PeerAddress is an XOR-PEER-ADDRESS attribute of a.
func PeerAddress(a stun.XORMappedAddress) stun.Setter { return &peerAttr{a} }

// peerAttr adds an XOR-PEER-ADDRESS.
type peerAttr struct{ a stun.XORMappedAddress }

func (p *peerAttr) AddTo(m *stun.Message) error { return p.a.AddToAs(m, stun.AttrXORPeerAddress) }
