package daemon

import (
	"io"
	"log/slog"
	"net"
	"net/netip"
	"testing"

	"github.com/l7mp/stunnerd-xdp/internal/mirror"
	"github.com/l7mp/stunnerd-xdp/internal/quota"
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
