package daemon

import (
	"encoding/binary"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pion/stun/v3"
	"github.com/pion/turn/v4"

	"github.com/l7mp/stunnerd-xdp/internal/logging"
	"github.com/l7mp/stunnerd-xdp/internal/mirror"
	"github.com/l7mp/stunnerd-xdp/internal/quota"
	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// TestReplacedAllocation replays what pion reports when a five-tuple
// allocates again while its previous allocation is being closed: Created
// (old), Created (new, the old one already out of pion's map), the old one's
// permission deleted and Deleted (late), then the new one's Deleted. The
// hooks are stacked as in startListener; the quota, the steering flows, the
// permission limit and the mirror must follow the live allocation.
func TestReplacedAllocation(t *testing.T) {
	d := &Daemon{quota: quota.New(quota.Limits{}), perms: quota.NewPermissions(0)}
	d.auth.Store(&authState{})
	m := mirror.New(slog.New(slog.NewTextHandler(io.Discard, nil)))
	t.Cleanup(m.Close)
	// The steering map: AddFlow writes the client's entry, RemoveFlow
	// deletes it.
	flows := map[netip.AddrPort]bool{}
	inner := onAllocations(m.EventHandler(),
		func(c netip.AddrPort) { flows[c] = true },
		func(c netip.AddrPort) { delete(flows, c) })
	qs := d.quota.NewServer()
	h := new(replacements).wrap(d.withQuota(qs, d.hooks.wrap(inner)))

	client := &net.UDPAddr{IP: net.IPv4(10, 100, 0, 2), Port: 40000}
	server := &net.UDPAddr{IP: net.IPv4(10, 100, 0, 1), Port: 3478}
	oldRelay := &net.UDPAddr{IP: net.IPv4(10, 200, 0, 1), Port: 50000}
	newRelay := &net.UDPAddr{IP: net.IPv4(10, 200, 0, 1), Port: 50001}
	oldPeer, newPeer := net.IPv4(10, 200, 0, 2), net.IPv4(10, 200, 0, 3)
	c := client.AddrPort()
	allocate := func(relay net.Addr, peer net.IP) {
		t.Helper()
		if r := d.quota.Reserve(qs, client, "u"); r != quota.Granted {
			t.Fatalf("Reserve: %v", r)
		}
		h.OnAllocationCreated(client, server, "UDP", "u", "r", relay, 0)
		h.OnPermissionCreated(client, server, "UDP", "u", "r", relay, peer)
	}
	check := func(when string, allocs int, flow bool, held int) {
		t.Helper()
		m.Sync()
		if got := d.quota.Stats().Allocations; got != allocs {
			t.Errorf("%s: quota counts %d allocations, want %d", when, got, allocs)
		}
		if flows[c] != flow {
			t.Errorf("%s: steering entry for the client: %v, want %v", when, flows[c], flow)
		}
		if got := d.perms.Held(qs, client); got != held {
			t.Errorf("%s: permission limit counts %d permissions, want %d", when, got, held)
		}
		if got, _ := m.Counts(); got != allocs {
			t.Errorf("%s: mirror holds %d allocations, want %d", when, got, allocs)
		}
	}

	allocate(oldRelay, oldPeer)
	check("old allocation", 1, true, 1)
	// pion has taken the old allocation out of its map and is closing it;
	// the client allocates again.
	allocate(newRelay, newPeer)
	check("new allocation", 1, true, 1)
	// The old allocation's close reports come late.
	h.OnPermissionDeleted(client, server, "UDP", "u", "r", oldRelay, oldPeer)
	h.OnAllocationDeleted(client, server, "UDP", "u", "r")
	check("old allocation's late Deleted", 1, true, 1)
	h.OnPermissionDeleted(client, server, "UDP", "u", "r", newRelay, newPeer)
	h.OnAllocationDeleted(client, server, "UDP", "u", "r")
	check("new allocation deleted", 0, false, 0)
}

// rawTURN is a client that sends the requests turn.Client cannot (a short
// LIFETIME, an Allocate again on the same socket).
type rawTURN struct {
	t      *testing.T
	conn   net.PacketConn
	server net.Addr
	user   string
	key    stun.MessageIntegrity
	realm  stun.Realm
	nonce  stun.Nonce
}

// do sends a request of method with attrs (authenticated once a nonce is
// known) and returns the response.
func (c *rawTURN) do(method stun.Method, attrs ...stun.Setter) *stun.Message {
	c.t.Helper()
	setters := append([]stun.Setter{stun.TransactionID, stun.NewType(method, stun.ClassRequest)}, attrs...)
	if c.nonce != nil {
		setters = append(setters, stun.NewUsername(c.user), c.realm, c.nonce, c.key)
	}
	req := stun.MustBuild(append(setters, stun.Fingerprint)...)
	if _, err := c.conn.WriteTo(req.Raw, c.server); err != nil {
		c.t.Fatal(err)
	}
	buf := make([]byte, 1500)
	for {
		if err := c.conn.SetReadDeadline(time.Now().Add(5 * time.Second)); err != nil {
			c.t.Fatal(err)
		}
		n, _, err := c.conn.ReadFrom(buf)
		if err != nil {
			c.t.Fatalf("%v response: %v", method, err)
		}
		res := &stun.Message{Raw: append([]byte(nil), buf[:n]...)}
		if err := res.Decode(); err != nil || res.TransactionID != req.TransactionID {
			continue
		}
		return res
	}
}

// allocate allocates for lifetime and returns the relayed address.
func (c *rawTURN) allocate(lifetime time.Duration) net.Addr {
	c.t.Helper()
	transport := stun.RawAttribute{Type: stun.AttrRequestedTransport, Value: []byte{17, 0, 0, 0}}
	lt := make([]byte, 4)
	binary.BigEndian.PutUint32(lt, uint32(lifetime/time.Second))
	attrs := []stun.Setter{transport, stun.RawAttribute{Type: stun.AttrLifetime, Value: lt}}
	res := c.do(stun.MethodAllocate, attrs...)
	if c.nonce == nil { // 401: learn the realm and nonce, then authenticate
		c.nonce, c.realm = stun.Nonce{}, stun.Realm{}
		if err := c.nonce.GetFrom(res); err != nil {
			c.t.Fatalf("Allocate: no nonce in %v", res)
		}
		if err := c.realm.GetFrom(res); err != nil {
			c.t.Fatalf("Allocate: no realm in %v", res)
		}
		res = c.do(stun.MethodAllocate, attrs...)
	}
	var relay stun.XORMappedAddress
	if res.Type.Class != stun.ClassSuccessResponse || relay.GetFromAs(res, stun.AttrXORRelayedAddress) != nil {
		c.t.Fatalf("Allocate: %v", res)
	}
	return &net.UDPAddr{IP: relay.IP, Port: relay.Port}
}

// TestReplacedAllocationPion makes the race of TestReplacedAllocation happen
// in a real pion/turn server: the client's allocation expires, pion's close
// of it is held in its permission hook until the same client has allocated
// again, then both allocations end. The quota must count none, as pion holds
// none.
func TestReplacedAllocationPion(t *testing.T) {
	lf, err := logging.New("all:WARN", "text", &testenv.LockedBuffer{})
	if err != nil {
		t.Fatal(err)
	}
	d := &Daemon{quota: quota.New(quota.Limits{}), perms: quota.NewPermissions(0), strangerLog: lf.Slog("test")}
	d.auth.Store(&authState{})
	qs := d.quota.NewServer()
	// The old allocation's close waits in its permission hook (as it may
	// wait for the scheduler) until the client has allocated again.
	var created atomic.Int32
	again, closing := make(chan struct{}), make(chan struct{})
	var closingOnce sync.Once
	inner := turn.EventHandler{
		OnAllocationCreated: func(_, _ net.Addr, _, _, _ string, _ net.Addr, _ int) {
			if created.Add(1) == 2 {
				close(again)
			}
		},
		OnPermissionDeleted: func(_, _ net.Addr, _, _, _ string, _ net.Addr, _ net.IP) {
			if created.Load() == 1 {
				closingOnce.Do(func() { close(closing) })
				select {
				case <-again:
				case <-time.After(5 * time.Second):
				}
			}
		},
	}
	conn, err := net.ListenPacket("udp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	key := turn.GenerateAuthKey("u", "r", "p")
	srv, err := turn.NewServer(turn.ServerConfig{
		Realm:         "r",
		AuthHandler:   func(user, _ string, _ net.Addr) ([]byte, bool) { return key, user == "u" },
		QuotaHandler:  d.quotaHandler(qs),
		EventHandler:  new(replacements).wrap(d.withQuota(qs, inner)),
		LoggerFactory: lf.LimitedFactory(),
		PacketConnConfigs: []turn.PacketConnConfig{{
			PacketConn: conn,
			RelayAddressGenerator: &turn.RelayAddressGeneratorStatic{
				RelayAddress: net.IPv4(127, 0, 0, 1), Address: "127.0.0.1",
			},
		}},
	})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	cc, err := net.ListenPacket("udp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	c := &rawTURN{t: t, conn: cc, server: conn.LocalAddr(), user: "u", key: stun.NewLongTermIntegrity("u", "r", "p")}

	c.allocate(time.Second)
	peer := stun.XORMappedAddress{IP: net.IPv4(127, 0, 0, 1), Port: 9}
	if res := c.do(stun.MethodCreatePermission, &peerAttr{peer}); res.Type.Class != stun.ClassSuccessResponse {
		t.Fatalf("CreatePermission: %v", res)
	}
	select {
	case <-closing:
	case <-time.After(5 * time.Second):
		t.Fatal("the allocation did not expire")
	}
	c.allocate(time.Second) // pion has taken the old one out of its map
	deadline := time.Now().Add(5 * time.Second)
	for srv.AllocationCount() != 0 || d.quota.Stats().Allocations != 0 {
		if time.Now().After(deadline) {
			t.Fatalf("pion holds %d allocations, the quota counts %d", srv.AllocationCount(), d.quota.Stats().Allocations)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// peerAttr adds an XOR-PEER-ADDRESS.
type peerAttr struct{ a stun.XORMappedAddress }

func (p *peerAttr) AddTo(m *stun.Message) error { return p.a.AddToAs(m, stun.AttrXORPeerAddress) }

// TestQuotaCountCheck: the periodic check warns of a server whose quota
// count exceeds what pion holds, once the excess has lasted two checks, and
// not of live allocations counted right.
func TestQuotaCountCheck(t *testing.T) {
	d, listen := startQuota(t, 0, 0)
	conn, err := allocateUser(t, listen, "alice", "a", false)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	seen := map[quota.Server][2]int{}
	for i := range 2 {
		if w := d.checkQuotaCounts(seen); len(w) != 0 {
			t.Fatalf("check %d warned of %v with the counts right", i, w)
		}
	}
	// A slot the counter holds for an allocation no pion server has.
	d.lmu.Lock()
	qs := d.listeners["udp"].quotas[0]
	d.lmu.Unlock()
	d.quota.Created(qs, &net.UDPAddr{IP: net.IPv4(192, 0, 2, 1), Port: 9}, "alice")
	if w := d.checkQuotaCounts(seen); len(w) != 0 {
		t.Fatalf("first check warned of %v: the excess may be a deletion half-reported", w)
	}
	if w := d.checkQuotaCounts(seen); len(w) != 1 || w[0] != "udp" {
		t.Fatalf("second check warned of %v, want [udp]", w)
	}
}
