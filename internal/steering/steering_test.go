package steering

import (
	"context"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// The tests run two Steering values in one process: each holds its own open
// file descriptions, so the locks behave as between two daemons.

func testDir(t testing.TB) string {
	t.Helper()
	return filepath.Join(testenv.BPFFS(t), "steer")
}

func mustOpen(t testing.TB, dir string) *Steering {
	t.Helper()
	s, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

var reuseport = net.ListenConfig{Control: func(_, _ string, c syscall.RawConn) error {
	var serr error
	err := c.Control(func(fd uintptr) { serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_REUSEPORT, 1) })
	if err != nil {
		return err
	}
	return serr
}}

func listenUDP(t testing.TB, network, addr string) *net.UDPConn {
	t.Helper()
	c, err := reuseport.ListenPacket(context.Background(), network, addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c.(*net.UDPConn)
}

func register(t testing.TB, s *Steering, c syscall.Conn, g Group) uint32 {
	t.Helper()
	rc, err := c.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	slot, err := s.Register(rc, g)
	if err != nil {
		t.Fatal(err)
	}
	return slot
}

// receiver sends one datagram from client to the group and reports which of
// the servers got it (-1: none).
func receiver(t *testing.T, client *net.UDPConn, to netip.AddrPort, servers ...*net.UDPConn) int {
	t.Helper()
	if _, err := client.WriteToUDPAddrPort([]byte("x"), to); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 16)
	deadline := time.Now().Add(500 * time.Millisecond)
	for time.Now().Before(deadline) {
		for i, s := range servers {
			_ = s.SetReadDeadline(time.Now().Add(20 * time.Millisecond))
			if _, _, err := s.ReadFromUDPAddrPort(buf); err == nil {
				return i
			}
		}
	}
	return -1
}

func addrPort(c net.Addr) netip.AddrPort { return c.(*net.UDPAddr).AddrPort() }

func stats(t testing.TB, s *Steering) Stats {
	t.Helper()
	st, err := s.Stats()
	if err != nil {
		t.Fatal(err)
	}
	return st
}

func testUDP(t *testing.T, network, host string) {
	dir := testDir(t)
	old, nu := mustOpen(t, dir), mustOpen(t, dir)

	a := listenUDP(t, network, net.JoinHostPort(host, "0"))
	g := Group{Protocol: UDP, Addr: addrPort(a.LocalAddr())}
	slotA := register(t, old, a, g)
	c1, c2 := listenUDP(t, network, net.JoinHostPort(host, "0")), listenUDP(t, network, net.JoinHostPort(host, "0"))
	// c1 has an allocation on the old process.
	if err := old.AddFlow(g, addrPort(c1.LocalAddr()), slotA); err != nil {
		t.Fatal(err)
	}
	if got := receiver(t, c2, g.Addr, a); got != 0 {
		t.Fatalf("alone: the only socket got nothing (%d)", got)
	}

	// The new process binds the same address and takes every new flow.
	b := listenUDP(t, network, g.Addr.String())
	slotB := register(t, nu, b, g)
	if slotB == slotA {
		t.Fatalf("both sockets in slot %d", slotA)
	}
	if ok, err := old.Successor(); err != nil || !ok {
		t.Errorf("the old process sees no successor (%v)", err)
	}
	if ok, err := nu.Successor(); err != nil || ok {
		t.Errorf("the new process sees a successor (%v)", err)
	}
	before := stats(t, nu)
	for i := range 20 {
		if got := receiver(t, c1, g.Addr, a, b); got != 0 {
			t.Fatalf("datagram %d of the old process's client went to socket %d", i, got)
		}
		if got := receiver(t, c2, g.Addr, a, b); got != 1 {
			t.Fatalf("datagram %d of a new client went to socket %d, want the new process's", i, got)
		}
	}
	after := stats(t, old) // the same maps, whichever process reads them
	if after.Owner-before.Owner != 20 || after.Active-before.Active != 20 || after.Hash != before.Hash {
		t.Errorf("verdicts %+v -> %+v, want 20 owner and 20 active", before, after)
	}

	// The allocation ends: its client is new to everyone and goes to the new process.
	if err := old.RemoveFlow(g, addrPort(c1.LocalAddr()), slotA); err != nil {
		t.Fatal(err)
	}
	if got := receiver(t, c1, g.Addr, a, b); got != 1 {
		t.Errorf("after the allocation ended: socket %d, want the new process's", got)
	}

	// The new process dies: its socket leaves the array and the old one,
	// still bound, gets everything again (by the kernel's hash).
	b.Close()
	if ok, err := old.Successor(); err != nil || ok {
		t.Errorf("the old process still sees a successor after it closed (%v)", err)
	}
	if got := receiver(t, c2, g.Addr, a); got != 0 {
		t.Errorf("after the new socket closed: %d", got)
	}
	if st := stats(t, old); st.Hash == after.Hash {
		t.Errorf("no hash verdict after the active socket closed: %+v", st)
	}
}

func TestSteerUDP4(t *testing.T) { testUDP(t, "udp4", "127.0.0.1") }
func TestSteerUDP6(t *testing.T) { testUDP(t, "udp6", "::1") }

// TestSteerTCP: new connections go to the newest listener.
func TestSteerTCP(t *testing.T) {
	dir := testDir(t)
	old, nu := mustOpen(t, dir), mustOpen(t, dir)
	// Go listens with MPTCP by default where the kernel has it; the
	// reuseport array takes plain TCP sockets only.
	reuseport := reuseport
	reuseport.SetMultipathTCP(false)
	la, err := reuseport.Listen(context.Background(), "tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer la.Close()
	g := Group{Protocol: TCP, Addr: la.Addr().(*net.TCPAddr).AddrPort()}
	register(t, old, la.(*net.TCPListener), g)
	lb, err := reuseport.Listen(context.Background(), "tcp4", g.Addr.String())
	if err != nil {
		t.Fatal(err)
	}
	defer lb.Close()
	register(t, nu, lb.(*net.TCPListener), g)
	before := stats(t, nu)
	for i := range 10 {
		c, err := net.Dial("tcp4", g.Addr.String())
		if err != nil {
			t.Fatal(err)
		}
		_ = lb.(*net.TCPListener).SetDeadline(time.Now().Add(time.Second))
		s, err := lb.Accept()
		if err != nil {
			t.Fatalf("connection %d did not reach the new listener: %v", i, err)
		}
		s.Close()
		c.Close()
	}
	if after := stats(t, old); after.Active-before.Active != 10 {
		t.Errorf("verdicts %+v -> %+v, want 10 active", before, after)
	}
}

// TestStaleFlowsPurged: a process killed with live allocations leaves flow
// entries naming its slot; the next one to claim the slot drops them.
func TestStaleFlowsPurged(t *testing.T) {
	dir := testDir(t)
	s := mustOpen(t, dir)
	a := listenUDP(t, "udp4", "127.0.0.1:0")
	g := Group{Protocol: UDP, Addr: addrPort(a.LocalAddr())}
	slot := register(t, s, a, g)
	other := netip.MustParseAddrPort("10.1.2.3:4000")
	for i := range 5 {
		if err := s.AddFlow(g, netip.AddrPortFrom(other.Addr(), uint16(4000+i)), slot); err != nil {
			t.Fatal(err)
		}
	}
	if n, _ := s.Flows(); n != 5 {
		t.Fatalf("%d flows, want 5", n)
	}
	a.Close() // the socket leaves the array: the slot is free
	b := listenUDP(t, "udp4", g.Addr.String())
	if got := register(t, s, b, g); got != slot {
		t.Fatalf("slot %d, want the freed %d", got, slot)
	}
	if n, _ := s.Flows(); n != 0 {
		t.Errorf("%d stale flows left", n)
	}
}

// oldAndClient is an old process with one listener socket and a client that
// has an allocation on it, and a second process not registered yet.
type oldAndClient struct {
	old, nu *Steering
	a, c    *net.UDPConn
	g       Group
}

func newOldAndClient(t *testing.T) oldAndClient {
	t.Helper()
	dir := testDir(t)
	s := oldAndClient{old: mustOpen(t, dir), nu: mustOpen(t, dir), a: listenUDP(t, "udp4", "127.0.0.1:0")}
	s.g = Group{Protocol: UDP, Addr: addrPort(s.a.LocalAddr())}
	slot := register(t, s.old, s.a, s.g)
	s.c = listenUDP(t, "udp4", "127.0.0.1:0")
	if err := s.old.AddFlow(s.g, addrPort(s.c.LocalAddr()), slot); err != nil {
		t.Fatal(err)
	}
	return s
}

// TestRetire: a draining process stops taking new flows; its clients stay.
func TestRetire(t *testing.T) {
	s := newOldAndClient(t)
	if err := s.old.Retire(); err != nil {
		t.Fatal(err)
	}
	if ok, _ := s.old.Successor(); ok {
		t.Error("a successor before any registered")
	}
	b := listenUDP(t, "udp4", s.g.Addr.String())
	register(t, s.nu, b, s.g) // a successor arrives after the drain began
	if ok, err := s.old.Successor(); err != nil || !ok {
		t.Errorf("no successor after one registered (%v)", err)
	}
	c2 := listenUDP(t, "udp4", "127.0.0.1:0")
	for range 10 {
		if got := receiver(t, s.c, s.g.Addr, s.a, b); got != 0 {
			t.Fatalf("the retired process's client went to socket %d", got)
		}
		if got := receiver(t, c2, s.g.Addr, s.a, b); got != 1 {
			t.Fatalf("a new client went to socket %d, want the successor's", got)
		}
	}
}

// TestOwnerKilled: the owner's socket closes without its entries being
// removed (kill -9): its clients go to the newest socket, which answers them
// (pion/turn there tells them the allocation is gone).
func TestOwnerKilled(t *testing.T) {
	s := newOldAndClient(t)
	b := listenUDP(t, "udp4", s.g.Addr.String())
	register(t, s.nu, b, s.g)
	if got := receiver(t, s.c, s.g.Addr, s.a, b); got != 0 {
		t.Fatalf("owner alive: socket %d", got)
	}
	s.a.Close()
	before := stats(t, s.nu)
	if got := receiver(t, s.c, s.g.Addr, b); got != 0 {
		t.Errorf("owner gone: the client's datagram reached no socket (%d)", got)
	}
	if after := stats(t, s.nu); after.Active != before.Active+1 || after.Owner != before.Owner {
		t.Errorf("verdicts %+v -> %+v, want one active (the owner's slot is empty)", before, after)
	}
}

// TestOlderNeverTakesOver: a listener the old process restarts (a config
// reload) while the new one runs, or registers after it retired, does not
// take the new flows back.
func TestOlderNeverTakesOver(t *testing.T) {
	s := newOldAndClient(t)
	b := listenUDP(t, "udp4", s.g.Addr.String())
	register(t, s.nu, b, s.g)
	a2 := listenUDP(t, "udp4", s.g.Addr.String())
	register(t, s.old, a2, s.g) // the old process reloads
	c2 := listenUDP(t, "udp4", "127.0.0.1:0")
	if got := receiver(t, c2, s.g.Addr, s.a, b, a2); got != 1 {
		t.Errorf("after the old process re-registered, a new client went to socket %d, want the new process's", got)
	}
	if err := s.old.Retire(); err != nil {
		t.Fatal(err)
	}
	b.Close() // the successor dies; the old process restarts a listener
	a3 := listenUDP(t, "udp4", s.g.Addr.String())
	register(t, s.old, a3, s.g)
	var cur uint32
	if err := s.old.objs.SteerActive.Lookup(s.g.key(), &cur); err == nil {
		t.Errorf("a retired process took the new flows (slot %d)", cur)
	}
}

// TestCloseDropsOwnFlows: allocations alive at exit leave no entries behind,
// and another process's entries stay.
func TestCloseDropsOwnFlows(t *testing.T) {
	dir := testDir(t)
	a, b := mustOpen(t, dir), mustOpen(t, dir)
	ca := listenUDP(t, "udp4", "127.0.0.1:0")
	g := Group{Protocol: UDP, Addr: addrPort(ca.LocalAddr())}
	slotA := register(t, a, ca, g)
	slotB := register(t, b, listenUDP(t, "udp4", g.Addr.String()), g)
	for i := range 3 {
		if err := a.AddFlow(g, netip.AddrPortFrom(netip.MustParseAddr("10.1.0.1"), uint16(5000+i)), slotA); err != nil {
			t.Fatal(err)
		}
	}
	if err := b.AddFlow(g, netip.MustParseAddrPort("10.1.0.2:6000"), slotB); err != nil {
		t.Fatal(err)
	}
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	if n, err := b.Flows(); err != nil || n != 1 {
		t.Errorf("%d flows (%v) after the first process closed, want the other's 1", n, err)
	}
}

// TestLastOutRemovesPins: the pins stay while any process has them open and
// go with the last one.
func TestLastOutRemovesPins(t *testing.T) {
	dir := testDir(t)
	a, b := mustOpen(t, dir), mustOpen(t, dir)
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(dir, "steer_flows")); err != nil {
		t.Fatalf("pins gone while another process runs: %v", err)
	}
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Errorf("pin directory left behind: %v", err)
	}
	// And a later process starts from scratch.
	c := mustOpen(t, dir)
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
}

func TestOpenRefusesNonBPFFS(t *testing.T) {
	testenv.RequireRoot(t)
	if _, err := Open(t.TempDir()); err == nil {
		t.Fatal("Open accepted a directory outside bpffs")
	}
}

// TestSteerSet: a process with several sockets per listener (one read loop
// each) gets the new flows on all of them, each client always on the same
// one, while the old process's client stays with it.
func TestSteerSet(t *testing.T) {
	dir := testDir(t)
	old, nu := mustOpen(t, dir), mustOpen(t, dir)
	a := listenUDP(t, "udp4", "127.0.0.1:0")
	g := Group{Protocol: UDP, Addr: addrPort(a.LocalAddr())}
	slotA := register(t, old, a, g)
	owned := listenUDP(t, "udp4", "127.0.0.1:0")
	if err := old.AddFlow(g, addrPort(owned.LocalAddr()), slotA); err != nil {
		t.Fatal(err)
	}
	set := []*net.UDPConn{listenUDP(t, "udp4", g.Addr.String()), listenUDP(t, "udp4", g.Addr.String()), listenUDP(t, "udp4", g.Addr.String())}
	rcs := make([]syscall.RawConn, len(set))
	for i, c := range set {
		var err error
		if rcs[i], err = c.SyscallConn(); err != nil {
			t.Fatal(err)
		}
	}
	slots, err := nu.RegisterSet(rcs, g)
	if err != nil {
		t.Fatal(err)
	}
	for i := range slots[1:] {
		if slots[i+1] != slots[i]+1 {
			t.Fatalf("slots %v are not consecutive", slots)
		}
	}
	servers := append([]*net.UDPConn{a}, set...)
	got := map[int]int{}
	for range 24 {
		c := listenUDP(t, "udp4", "127.0.0.1:0")
		first := receiver(t, c, g.Addr, servers...)
		if first < 1 {
			t.Fatalf("a new client went to socket %d, want one of the new process's", first)
		}
		for range 3 {
			if again := receiver(t, c, g.Addr, servers...); again != first {
				t.Fatalf("a client moved from socket %d to %d", first, again)
			}
		}
		got[first]++
	}
	if len(got) < 2 {
		t.Errorf("24 new clients all went to one socket of the set: %v", got)
	}
	if r := receiver(t, owned, g.Addr, servers...); r != 0 {
		t.Errorf("the old process's client went to socket %d", r)
	}
	// Retiring the set stops new flows to all of it.
	if err := nu.Retire(); err != nil {
		t.Fatal(err)
	}
	var cur uint32
	if err := nu.objs.SteerActive.Lookup(g.key(), &cur); err == nil {
		t.Errorf("the retired set still takes new flows (%#x)", cur)
	}
}
