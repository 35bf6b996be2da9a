package offload

import (
	"io"
	"log/slog"
	"net"
	"testing"

	"github.com/vishvananda/netlink"

	"github.com/l7mp/stunnerd-xdp/internal/loader"
	"github.com/l7mp/stunnerd-xdp/internal/mirror"
	"github.com/l7mp/stunnerd-xdp/internal/nodelabel"
	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// TestAttachRetryKeepsBindings: while one interface cannot take the program,
// the daemon calls Retry every retry interval. Those calls must leave
// the bindings where they are (no removal, no re-install: either would forget
// what the program learned about each and hold pion's hooks behind the
// mirror); only a real change of path moves them.
func TestAttachRetryKeepsBindings(t *testing.T) {
	if testing.Short() {
		t.Skip("XDP in a network namespace: not in -short mode")
	}
	testenv.RequireRoot(t)
	ns := testenv.NewNSWorker(t)
	if err := ns.Do(func() error { return addVeth("sw0", "sw1") }); err != nil {
		t.Fatal(err)
	}
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	m := mirror.New(log)
	t.Cleanup(m.Close)
	// "missing0" does not exist: the retry keeps trying it.
	sw := New(Options{Log: log, Load: LoadXDP(log), Sink: mirrorOnly{m},
		Program:    loader.Config{ListenerPorts: []uint16{3478}, MinRelayPort: 49152, MaxRelayPort: 65535, MaxBindings: 64},
		Interfaces: []string{"sw0", "missing0"}, Flag: loader.ModeGeneric})
	// Cleanups run last-in first-out: the manager closes inside the namespace.
	t.Cleanup(func() { _ = ns.Do(sw.Close) })
	if err := ns.Do(sw.Start); err != nil {
		t.Fatalf("start: %v", err)
	}
	if got := sw.Attached(); len(got) != 1 || got["sw0"] != loader.ModeGeneric {
		t.Fatalf("attached %v, want sw0 in generic mode", got)
	}

	// One channel binding, reported through pion's hooks.
	client := &net.UDPAddr{IP: net.ParseIP("10.0.0.2"), Port: 40000}
	listener := &net.UDPAddr{IP: net.ParseIP("10.0.0.1"), Port: 3478}
	relay := &net.UDPAddr{IP: net.ParseIP("10.0.0.1"), Port: 50000}
	peer := &net.UDPAddr{IP: net.ParseIP("10.1.0.2"), Port: 5000}
	h := m.EventHandler()
	h.OnAllocationCreated(client, listener, "UDP", "u", "r", relay, 0)
	h.OnChannelCreated(client, listener, "UDP", "u", "r", relay, peer, 0x4000)
	m.Sync()
	before := m.Stats()
	if before.Installs != 1 || before.Removals != 0 || sw.Maps().Len() != 1 {
		t.Fatalf("after one channel: %+v, %d in the maps; want one install", before, sw.Maps().Len())
	}

	for range 3 {
		if missing := sw.Missing(); len(missing) != 1 || missing[0] != "missing0" {
			t.Fatalf("missing %v, want [missing0]", missing)
		}
		if err := ns.Do(func() error { sw.Retry(); return nil }); err != nil {
			t.Fatal(err)
		}
	}
	m.Sync()
	if after := m.Stats(); after.Installs != before.Installs || after.Removals != before.Removals {
		t.Errorf("the attach retries moved the bindings: installs %d -> %d, removals %d -> %d",
			before.Installs, after.Installs, before.Removals, after.Removals)
	}
	if n := sw.Maps().Len(); n != 1 {
		t.Errorf("%d bindings in the maps after the retries, want 1", n)
	}

	// A real change of path does move them: out when the label turns XDP
	// off, back when it returns to the flag's mode.
	if err := ns.Do(func() error { return sw.SetLabel(nodelabel.Detach) }); err != nil {
		t.Fatal(err)
	}
	m.Sync()
	if st := m.Stats(); st.Removals != before.Removals+1 || sw.Maps().Len() != 0 {
		t.Errorf("after the label's detach: %+v, %d in the maps; want the binding removed", st, sw.Maps().Len())
	}
	// Only sw0 attaches: missing0 still fails, which is no error.
	if err := ns.Do(func() error { return sw.SetLabel(nodelabel.Default) }); err != nil {
		t.Fatal(err)
	}
	m.Sync()
	if st := m.Stats(); st.Installs != before.Installs+1 || sw.Maps().Len() != 1 {
		t.Errorf("after the label's default: %+v, %d in the maps; want the binding installed again", st, sw.Maps().Len())
	}
}

// addVeth adds a veth pair, both ends up, in the calling thread's namespace.
func addVeth(name, peer string) error {
	la := netlink.NewLinkAttrs()
	la.Name = name
	if err := netlink.LinkAdd(&netlink.Veth{LinkAttrs: la, PeerName: peer}); err != nil {
		return err
	}
	for _, n := range []string{name, peer} {
		l, err := netlink.LinkByName(n)
		if err != nil {
			return err
		}
		if err := netlink.LinkSetUp(l); err != nil {
			return err
		}
	}
	return nil
}

// mirrorOnly is the mirror as the manager's only writer.
type mirrorOnly struct{ *mirror.Mirror }

func (mirrorOnly) SetMaps(mirror.Offload) {}
