package mirror_test

import (
	"io"
	"log/slog"
	"net"
	"testing"

	"github.com/l7mp/stunnerd-xdp/internal/channelmap"
	"github.com/l7mp/stunnerd-xdp/internal/loader"
	"github.com/l7mp/stunnerd-xdp/internal/mirror"
	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// TestPermissionDeletedClearsKernelMaps drives the pion/turn hooks against the
// real BPF maps. pion/turn v4 fixes the permission lifetime at 5 minutes, so the
// permission-deleted path is exercised through the handler, as pion calls it.
func TestPermissionDeletedClearsKernelMaps(t *testing.T) {
	testenv.RequireRoot(t)
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	prog, err := loader.Load(loader.Config{ListenerPorts: []uint16{3478}, MinRelayPort: 49152, MaxRelayPort: 65535, MaxBindings: 64}, log)
	if err != nil {
		t.Fatal(err)
	}
	defer prog.Close()
	maps := channelmap.New(prog.Maps())
	m := mirror.New(log)
	defer m.Close()
	m.SetOffload(maps)

	client := &net.UDPAddr{IP: net.IPv4(10, 100, 0, 2), Port: 40000}
	listener := &net.UDPAddr{IP: net.IPv4(10, 100, 0, 1), Port: 3478}
	relay := &net.UDPAddr{IP: net.IPv4(10, 200, 0, 1), Port: 50000}
	peer := &net.UDPAddr{IP: net.IPv4(10, 200, 0, 2), Port: 5001}
	other := &net.UDPAddr{IP: net.IPv4(10, 200, 0, 3), Port: 5001}
	h := m.EventHandler()
	h.OnAllocationCreated(client, listener, "UDP", "u", "r", relay, 0)
	for i, p := range []*net.UDPAddr{peer, other} {
		h.OnPermissionCreated(client, listener, "UDP", "u", "r", relay, p.IP)
		h.OnChannelCreated(client, listener, "UDP", "u", "r", relay, p, 0x4000+uint16(i))
	}
	m.Sync()
	if got := dump(t, maps); got != 2 {
		t.Fatalf("%d bindings in the kernel, want 2", got)
	}

	h.OnPermissionDeleted(client, listener, "UDP", "u", "r", relay, peer.IP)
	m.Sync()
	kernel, err := maps.Dump()
	if err != nil {
		t.Fatal(err)
	}
	for _, b := range kernel {
		if b.Peer.Addr().String() == "10.200.0.2" {
			t.Fatalf("binding to %v survived the permission's deletion", b.Peer)
		}
	}
	if n, _ := maps.DumpPeerToClient(); n != 1 || len(kernel) != 1 {
		t.Fatalf("kernel holds %d client->peer and %d peer->client entries, want 1 and 1", len(kernel), n)
	}

	h.OnAllocationDeleted(client, listener, "UDP", "u", "r")
	m.Sync()
	if got := dump(t, maps); got != 0 {
		t.Fatalf("%d bindings left after the allocation was deleted", got)
	}
	if n, _ := maps.DumpPeerToClient(); n != 0 {
		t.Fatalf("%d peer->client entries left after the allocation was deleted", n)
	}
}

func dump(t *testing.T, maps *channelmap.Maps) int {
	t.Helper()
	d, err := maps.Dump()
	if err != nil {
		t.Fatal(err)
	}
	return len(d)
}
