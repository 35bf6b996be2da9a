package steering

import (
	"encoding/binary"
	"errors"
	"net"
	"os"
	"path/filepath"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/l7mp/stunnerd-xdp/bpf"
)

// gateway is one Gateway's listener on the node: its group, and the sockets
// bound to it, one per process.
type gateway struct {
	g Group
}

func newGateway(t *testing.T) gateway {
	t.Helper()
	c := listenUDP(t, "udp4", "127.0.0.1:0")
	g := Group{Protocol: UDP, Addr: addrPort(c.LocalAddr())}
	c.Close() // the port only: each process binds its own socket
	return gateway{g: g}
}

// serve registers a new socket of the Gateway's listener for s.
func (gw gateway) serve(t *testing.T, s *Steering) (*net.UDPConn, uint32) {
	t.Helper()
	c := listenUDP(t, "udp4", gw.g.Addr.String())
	return c, register(t, s, c, gw.g)
}

func wantNewer(t *testing.T, s *Steering, want bool, why string) {
	t.Helper()
	if newer, err := s.Newer(); err != nil || newer != want {
		t.Errorf("%s: Newer %v (%v), want %v", why, newer, err, want)
	}
}

// TestNewerPerGateway: the daemons of two Gateways share the node's pin
// directory. Gateway A's old daemon drains for its successor; B's daemon
// registered after A's old one. When A's successor dies, A's old daemon must
// stand in: B's daemon, alive in another group, is nobody's successor in A's.
func TestNewerPerGateway(t *testing.T) {
	dir := testDir(t)
	gwA, gwB := newGateway(t), newGateway(t)
	aOld := mustOpen(t, dir)
	sockAOld, _ := gwA.serve(t, aOld)
	aNew := mustOpen(t, dir)
	sockANew, _ := gwA.serve(t, aNew)
	idle := mustOpen(t, dir) // opened, nothing registered yet
	b := mustOpen(t, dir)
	gwB.serve(t, b)
	if !(aOld.gen < aNew.gen && aOld.gen < b.gen) {
		t.Fatalf("generations %d, %d, %d: A's old daemon is not the oldest", aOld.gen, aNew.gen, b.gen)
	}
	if err := aOld.Retire(); err != nil {
		t.Fatal(err)
	}
	if ok, err := aOld.Successor(); err != nil || !ok {
		t.Fatalf("A's old daemon sees no successor (%v)", err)
	}
	wantNewer(t, aOld, true, "A's successor alive")
	wantNewer(t, b, false, "B alone in its group, A's successor registered before it")

	sockANew.Close() // kill -9 of A's successor
	wantNewer(t, aOld, false, "A's successor killed, B alive in its own group")
	wantNewer(t, idle, true, "no registration, so no group to tell by: B counts")
	if err := aOld.Unretire(); err != nil {
		t.Fatal(err)
	}
	newClientsGoTo(t, gwA.g, 0, sockAOld)

	// The same Gateway: a newer daemon of A's group counts, B's still not.
	aNext := mustOpen(t, dir)
	gwA.serve(t, aNext)
	wantNewer(t, aOld, true, "a newer daemon of A registered")
	wantNewer(t, b, false, "a newer daemon of A registered, none of B")
	// A process in both groups (one daemon serving both Gateways) counts for
	// each.
	both := mustOpen(t, dir)
	gwB.serve(t, both)
	wantNewer(t, b, true, "a newer daemon serving B")
}

// claimAsEarlierVersion puts the socket into the slot as versions without
// steer_slot_grp do (their claim), over their own load of the pinned maps:
// they write steer_sockets and steer_slots only.
func claimAsEarlierVersion(t *testing.T, dir string, c *net.UDPConn, slot uint32, gen uint64) {
	t.Helper()
	var objs bpf.SteerObjects
	if err := bpf.LoadSteerObjects(&objs, &ebpf.CollectionOptions{Maps: ebpf.MapOptions{PinPath: dir}}); err != nil {
		t.Fatalf("an earlier version's load over the pins: %v", err)
	}
	defer objs.Close()
	rc, err := c.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var cerr error
	if err := rc.Control(func(fd uintptr) { cerr = objs.SteerSockets.Update(slot, uint64(fd), ebpf.UpdateNoExist) }); err != nil || cerr != nil {
		t.Fatalf("claim slot %d: %v %v", slot, err, cerr)
	}
	var cookie uint64
	if err := objs.SteerSockets.Lookup(slot, &cookie); err != nil {
		t.Fatal(err)
	}
	if err := objs.SteerSlots.Put(slot, bpf.SteerSlotInfo{Cookie: cookie, Generation: gen}); err != nil {
		t.Fatal(err)
	}
}

// TestNewerEarlierVersion: a socket claimed by a version that does not record
// its group counts for every group (what all sockets did before), whether its
// slot's record is missing or stale (left by a socket of another group that
// had the slot before).
func TestNewerEarlierVersion(t *testing.T) {
	dir := testDir(t)
	gwA, gwB := newGateway(t), newGateway(t)
	aOld := mustOpen(t, dir)
	gwA.serve(t, aOld)
	b := mustOpen(t, dir)
	sockB, slotB := gwB.serve(t, b)
	wantNewer(t, aOld, false, "only B's daemon, in another group")

	var used slotGroup
	if err := aOld.slotGroups.Lookup(slotB, &used); err != nil || used.Group != gwB.g.key() {
		t.Fatalf("B's slot %d records %+v (%v), want group %v", slotB, used, err, gwB.g)
	}
	sockB.Close()
	stale := listenUDP(t, "udp4", gwB.g.Addr.String())
	claimAsEarlierVersion(t, dir, stale, slotB, b.gen)
	wantNewer(t, aOld, true, "an earlier version's socket in a slot with a stale record")
	stale.Close()
	wantNewer(t, aOld, false, "the earlier version's socket closed")

	const unused = Slots - 1
	if err := aOld.slotGroups.Lookup(uint32(unused), &used); err != nil || used.Cookie != 0 {
		t.Fatalf("slot %d has a record %+v (%v)", unused, used, err)
	}
	missing := listenUDP(t, "udp4", gwB.g.Addr.String())
	claimAsEarlierVersion(t, dir, missing, unused, b.gen)
	wantNewer(t, aOld, true, "an earlier version's socket in a slot never recorded")
	wantNewer(t, b, false, "B's daemon, newer than the earlier version's socket")
}

// TestSlotGroupsPin: steer_slot_grp is shared by the processes of the
// directory, made by the first of this version even where an earlier version
// made the other pins, and removed by the last one out.
func TestSlotGroupsPin(t *testing.T) {
	if n := binary.Size(slotGroup{}); n != int(slotGroupsSpec.ValueSize) {
		t.Fatalf("slotGroup is %d bytes, the map's values %d", n, slotGroupsSpec.ValueSize)
	}
	dir := testDir(t)
	// An earlier version runs in the directory: its pins, not ours.
	if err := os.MkdirAll(filepath.Join(dir, "registry"), 0o700); err != nil {
		t.Fatal(err)
	}
	var earlier bpf.SteerObjects
	if err := bpf.LoadSteerObjects(&earlier, &ebpf.CollectionOptions{Maps: ebpf.MapOptions{PinPath: dir}}); err != nil {
		t.Fatal(err)
	}
	defer earlier.Close()
	pin := filepath.Join(dir, slotGroupsSpec.Name)
	if _, err := os.Stat(pin); !os.IsNotExist(err) {
		t.Fatalf("%s before this version opened: %v", pin, err)
	}
	a, b := mustOpen(t, dir), mustOpen(t, dir)
	ia, err := a.slotGroups.Info()
	if err != nil {
		t.Fatal(err)
	}
	ib, err := b.slotGroups.Info()
	if err != nil {
		t.Fatal(err)
	}
	ida, _ := ia.ID()
	idb, _ := ib.ID()
	if ida != idb {
		t.Errorf("two processes of the directory have maps %d and %d", ida, idb)
	}
	gw := newGateway(t)
	_, slot := gw.serve(t, a)
	var rec slotGroup
	if err := b.slotGroups.Lookup(slot, &rec); err != nil || rec.Group != gw.g.key() || rec.Cookie == 0 {
		t.Errorf("the other process reads %+v (%v) for slot %d, want group %v", rec, err, slot, gw.g)
	}
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(pin); err != nil {
		t.Fatalf("pin gone while another process runs: %v", err)
	}
	earlier.Close() // our process is the last one out
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Errorf("pin directory left behind: %v", err)
	}
}

// TestSlotGroupsIncompatible: a pin of another layout under the name (a
// version that changed it) makes Open fail with the reason, as the program's
// maps do, instead of writing records another version misreads.
func TestSlotGroupsIncompatible(t *testing.T) {
	dir := testDir(t)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	spec := slotGroupsSpec
	spec.ValueSize = 24
	m, err := ebpf.NewMapWithOptions(&spec, ebpf.MapOptions{PinPath: dir})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if s, err := Open(dir); !errors.Is(err, ebpf.ErrMapIncompatible) {
		if err == nil {
			s.Close()
		}
		t.Fatalf("open: %v, want ErrMapIncompatible", err)
	}
}
