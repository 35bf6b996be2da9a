package daemon

import (
	"net"
	"sync"
	"testing"
	"time"

	"github.com/pion/stun/v3"
	"github.com/pion/turn/v4"

	"github.com/l7mp/stunnerd-xdp/internal/config"
)

// tap is a client's PacketConn shared by a pion/turn client and the test:
// responses to the transactions the test sent (Send) go to the test, the
// rest to the client.
type tap struct {
	net.PacketConn
	mu   sync.Mutex
	mine map[[stun.TransactionIDSize]byte]chan *stun.Message
}

func newTap(c net.PacketConn) *tap {
	return &tap{PacketConn: c, mine: map[[stun.TransactionIDSize]byte]chan *stun.Message{}}
}

func (t *tap) ReadFrom(p []byte) (int, net.Addr, error) {
	for {
		n, addr, err := t.PacketConn.ReadFrom(p)
		if err != nil || !stun.IsMessage(p[:n]) {
			return n, addr, err
		}
		m := &stun.Message{Raw: append([]byte(nil), p[:n]...)}
		if m.Decode() != nil {
			return n, addr, nil
		}
		t.mu.Lock()
		ch, ok := t.mine[m.TransactionID]
		t.mu.Unlock()
		if !ok {
			return n, addr, nil
		}
		ch <- m
	}
}

// do sends m to server from the client's 5-tuple and returns the answer.
func (t *tap) do(tb testing.TB, m *stun.Message, server net.Addr) *stun.Message {
	tb.Helper()
	ch := make(chan *stun.Message, 1)
	t.mu.Lock()
	t.mine[m.TransactionID] = ch
	t.mu.Unlock()
	if _, err := t.WriteTo(m.Raw, server); err != nil {
		tb.Fatal(err)
	}
	select {
	case res := <-ch:
		return res
	case <-time.After(3 * time.Second):
		tb.Fatalf("no answer to %v", m.Type)
		return nil
	}
}

// Issue 24: pion/turn accepted bob's valid credentials on alice's allocation,
// and bob's Refresh(0) from alice's 5-tuple deleted it. RFC 8656 binds the
// credentials to the allocation: bob gets 441 Wrong Credentials, over UDP
// and TCP alike, and alice's allocation lives (she still refreshes it);
// bob with a wrong password gets pion's own answer.
func TestWrongCredentialsOnAllocation(t *testing.T) {
	d, listen := startQuota(t, 0, 0)
	server := net.TCPAddrFromAddrPort(listen)
	for _, tcp := range []bool{false, true} {
		name := "udp"
		if tcp {
			name = "tcp"
		}
		t.Run(name, func(t *testing.T) {
			var c net.PacketConn
			if tcp {
				tc, err := net.Dial("tcp4", listen.String())
				if err != nil {
					t.Fatal(err)
				}
				c = turn.NewSTUNConn(tc)
			} else {
				uc, err := net.ListenPacket("udp4", "127.0.0.1:0")
				if err != nil {
					t.Fatal(err)
				}
				c = uc
			}
			tp := newTap(c)
			alice, err := turn.NewClient(&turn.ClientConfig{TURNServerAddr: listen.String(), STUNServerAddr: listen.String(),
				Username: "alice", Password: "a", Realm: config.DefaultRealm, Conn: tp})
			if err != nil {
				t.Fatal(err)
			}
			defer alice.Close()
			if err := alice.Listen(); err != nil {
				t.Fatal(err)
			}
			relay, err := alice.Allocate()
			if err != nil {
				t.Fatal(err)
			}
			defer relay.Close()
			before := d.AllocationCount()

			// bob learns a nonce as any client does: a 401.
			var to net.Addr = net.UDPAddrFromAddrPort(listen)
			if tcp {
				to = server
			}
			res := tp.do(t, stun.MustBuild(stun.TransactionID, stun.NewType(stun.MethodRefresh, stun.ClassRequest)), to)
			var nonce stun.Nonce
			if err := nonce.GetFrom(res); err != nil {
				t.Fatalf("no nonce in %v", res)
			}
			refresh := func(user, pass string, lifetime byte) *stun.Message {
				return tp.do(t, stun.MustBuild(stun.TransactionID, stun.NewType(stun.MethodRefresh, stun.ClassRequest),
					stun.RawAttribute{Type: stun.AttrLifetime, Value: []byte{0, 0, 0, lifetime}}, stun.NewUsername(user), stun.NewRealm(config.DefaultRealm), nonce,
					stun.NewLongTermIntegrity(user, config.DefaultRealm, pass), stun.Fingerprint), to)
			}
			res = refresh("bob", "b", 0)
			var code stun.ErrorCodeAttribute
			if res.Type.Class != stun.ClassErrorResponse || code.GetFrom(res) != nil || code.Code != stun.CodeWrongCredentials {
				t.Fatalf("bob's Refresh(0) on alice's allocation: %v %v, want 441 Wrong Credentials", res.Type, code)
			}
			// The 441 is bob's: it carries his integrity.
			if err := stun.NewLongTermIntegrity("bob", config.DefaultRealm, "b").Check(res); err != nil {
				t.Errorf("the 441 does not carry bob's message integrity: %v", err)
			}
			if res = refresh("bob", "wrong", 0); res.Type.Class != stun.ClassErrorResponse || code.GetFrom(res) != nil || code.Code == stun.CodeWrongCredentials {
				t.Fatalf("bob with a wrong password: %v %v, want pion's own error", res.Type, code)
			}
			time.Sleep(100 * time.Millisecond)
			if got := d.AllocationCount(); got != before {
				t.Fatalf("%d allocations after bob's requests, want %d", got, before)
			}
			if res = refresh("alice", "a", 200); res.Type != stun.NewType(stun.MethodRefresh, stun.ClassSuccessResponse) {
				t.Fatalf("alice's Refresh after bob's Refresh(0): %v, want a success", res)
			}
			// alice's own Refresh(0) still ends it.
			relay.Close()
			for deadline := time.Now().Add(2 * time.Second); d.AllocationCount() != before-1; time.Sleep(10 * time.Millisecond) {
				if time.Now().After(deadline) {
					t.Fatalf("alice's Refresh(0): %d allocations, want %d", d.AllocationCount(), before-1)
				}
			}
		})
	}
}
