package listener

import (
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

	"github.com/l7mp/stunnerd-xdp/internal/credentials"
	"github.com/l7mp/stunnerd-xdp/internal/logging"
	"github.com/l7mp/stunnerd-xdp/internal/mirror"
	"github.com/l7mp/stunnerd-xdp/internal/quota"
	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// TestReplacedAllocation replays what pion reports when a five-tuple
// allocates again while its previous allocation is being closed: Created
// (old), Created (new, the old one already out of pion's map), the old one's
// permission deleted and Deleted (late), then the new one's Deleted. The
// hooks are stacked as in Set.hooks; the quota, the steering flows, the
// permission limit and the mirror must follow the live allocation.
func TestReplacedAllocation(t *testing.T) {
	d := testDeps(t)
	s := &Set{deps: d}
	m := mirror.New(slog.New(slog.NewTextHandler(io.Discard, nil)))
	t.Cleanup(m.Close)
	// The steering map: AddFlow writes the client's entry, RemoveFlow
	// deletes it.
	flows := map[netip.AddrPort]bool{}
	inner := onAllocations(m.EventHandler(),
		func(c netip.AddrPort) { flows[c] = true },
		func(c netip.AddrPort) { delete(flows, c) })
	qs := d.Quota.NewServer()
	h := new(replacements).wrap(s.quotaHooks(qs)(s.gate.wrap(inner)))

	client := &net.UDPAddr{IP: net.IPv4(10, 100, 0, 2), Port: 40000}
	server := &net.UDPAddr{IP: net.IPv4(10, 100, 0, 1), Port: 3478}
	oldRelay := &net.UDPAddr{IP: net.IPv4(10, 200, 0, 1), Port: 50000}
	newRelay := &net.UDPAddr{IP: net.IPv4(10, 200, 0, 1), Port: 50001}
	oldPeer, newPeer := net.IPv4(10, 200, 0, 2), net.IPv4(10, 200, 0, 3)
	c := client.AddrPort()
	allocate := func(relay net.Addr, peer net.IP) {
		t.Helper()
		if r := d.Quota.Reserve(qs, client, "u"); r != quota.Granted {
			t.Fatalf("Reserve: %v", r)
		}
		h.OnAllocationCreated(client, server, "UDP", "u", "r", relay, 0)
		h.OnPermissionCreated(client, server, "UDP", "u", "r", relay, peer)
	}
	check := func(when string, allocs int, flow bool, held int) {
		t.Helper()
		m.Sync()
		if got := d.Quota.Stats().Allocations; got != allocs {
			t.Errorf("%s: quota counts %d allocations, want %d", when, got, allocs)
		}
		if flows[c] != flow {
			t.Errorf("%s: steering entry for the client: %v, want %v", when, flows[c], flow)
		}
		if got := d.Permissions.Held(qs, client); got != held {
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
	d := testDeps(t)
	s := &Set{deps: d, strangerLog: lf.Slog("test")}
	qs := d.Quota.NewServer()
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
		QuotaHandler:  s.quotaHandler(qs),
		EventHandler:  new(replacements).wrap(s.quotaHooks(qs)(inner)),
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
	c := &testenv.RawTURN{T: t, Conn: cc, Server: conn.LocalAddr(), User: "u", Key: stun.NewLongTermIntegrity("u", "r", "p")}

	c.Allocate(time.Second)
	peer := stun.XORMappedAddress{IP: net.IPv4(127, 0, 0, 1), Port: 9}
	if res := c.Do(stun.MethodCreatePermission, testenv.PeerAddress(peer)); res.Type.Class != stun.ClassSuccessResponse {
		t.Fatalf("CreatePermission: %v", res)
	}
	select {
	case <-closing:
	case <-time.After(5 * time.Second):
		t.Fatal("the allocation did not expire")
	}
	c.Allocate(time.Second) // pion has taken the old one out of its map
	deadline := time.Now().Add(5 * time.Second)
	for srv.AllocationCount() != 0 || d.Quota.Stats().Allocations != 0 {
		if time.Now().After(deadline) {
			t.Fatalf("pion holds %d allocations, the quota counts %d", srv.AllocationCount(), d.Quota.Stats().Allocations)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// testDeps are the quota, permission and credential dependencies of a set.
func testDeps(t *testing.T) Deps {
	t.Helper()
	return Deps{
		Quota: quota.New(quota.Limits{}), Permissions: quota.NewPermissions(0),
		Credentials: credentials.New(credentials.Set{}, slog.New(slog.NewTextHandler(io.Discard, nil))),
		Draining:    func() bool { return false },
	}
}
