package mirror

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"sync"
	"testing"
	"time"

	"github.com/l7mp/stunnerd-xdp/internal/channelmap"
)

// fakeOffload is an in-memory Offload; the real maps are exercised by the
// privileged tests in internal/daemon and bpf.
type fakeOffload struct {
	mu      sync.Mutex
	m       map[channelmap.Key]channelmap.Binding
	failPut bool
	block   chan struct{}
	// capacity > 0: Upserts of new keys beyond it fail with ErrFull, as the maps do.
	capacity int
}

func newFake() *fakeOffload { return &fakeOffload{m: map[channelmap.Key]channelmap.Binding{}} }

func (f *fakeOffload) Upsert(b channelmap.Binding) error {
	if f.block != nil {
		<-f.block
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.failPut {
		return errors.New("map write failed")
	}
	if _, ok := f.m[b.Key()]; !ok && f.capacity > 0 && len(f.m) >= f.capacity {
		return fmt.Errorf("upsert %v: %w", b, channelmap.ErrFull)
	}
	f.m[b.Key()] = b
	return nil
}

func (f *fakeOffload) Delete(k channelmap.Key) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	delete(f.m, k)
	return nil
}

func (f *fakeOffload) Installed() []channelmap.Binding {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []channelmap.Binding
	for _, b := range f.m {
		out = append(out, b)
	}
	return out
}

func (f *fakeOffload) Dump() (map[channelmap.Key]channelmap.Binding, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := map[channelmap.Key]channelmap.Binding{}
	for k, v := range f.m {
		out[k] = v
	}
	return out, nil
}

func (f *fakeOffload) RemoveStray() (int, error) { return 0, nil }

func (f *fakeOffload) keys() map[channelmap.Key]channelmap.Binding { d, _ := f.Dump(); return d }

var (
	client   = &net.UDPAddr{IP: net.IPv4(10, 100, 0, 2), Port: 40000}
	listener = &net.UDPAddr{IP: net.IPv4(10, 100, 0, 1), Port: 3478}
	wildcard = &net.UDPAddr{IP: net.IPv4zero, Port: 3478}
	relay    = &net.UDPAddr{IP: net.IPv4(10, 200, 0, 1), Port: 50000}
	peerA    = &net.UDPAddr{IP: net.IPv4(10, 200, 0, 2), Port: 5001}
	peerB    = &net.UDPAddr{IP: net.IPv4(10, 200, 0, 3), Port: 5001}
)

func newMirror(t *testing.T) (*Mirror, *fakeOffload) {
	m := New(slog.New(slog.NewTextHandler(io.Discard, nil)))
	t.Cleanup(m.Close)
	f := newFake()
	m.SetOffload(f)
	return m, f
}

func chKey(ch uint16) channelmap.Key {
	return channelmap.Key{Client: addrPort(client), Listener: addrPort(listener), Channel: ch}
}

// bind replays what pion reports for a ChannelBind: permission, then channel.
func bind(m *Mirror, dst net.Addr, peer *net.UDPAddr, ch uint16) {
	h := m.EventHandler()
	h.OnPermissionCreated(client, dst, "UDP", "u", "r", relay, peer.IP)
	h.OnChannelCreated(client, dst, "UDP", "u", "r", relay, peer, ch)
}

func TestChannelLifecycle(t *testing.T) {
	m, f := newMirror(t)
	h := m.EventHandler()
	h.OnAllocationCreated(client, listener, "UDP", "u", "r", relay, 0)
	bind(m, listener, peerA, 0x4000)
	bind(m, listener, peerB, 0x4001)
	m.Sync()
	got := f.keys()
	if len(got) != 2 {
		t.Fatalf("installed %d bindings, want 2", len(got))
	}
	b := got[chKey(0x4000)]
	want := channelmap.Binding{Client: addrPort(client), Listener: addrPort(listener), Channel: 0x4000,
		Peer: addrPort(peerA), Relay: addrPort(relay)}
	if b != want {
		t.Fatalf("binding %+v, want %+v", b, want)
	}
	if a, c := m.Counts(); a != 1 || c != 2 {
		t.Fatalf("counts %d allocations %d channels", a, c)
	}

	h.OnChannelDeleted(client, listener, "UDP", "u", "r", relay, peerA, 0x4000)
	m.Sync()
	if _, ok := f.keys()[chKey(0x4000)]; ok || len(f.keys()) != 1 {
		t.Fatalf("after channel delete: %v", f.keys())
	}

	h.OnAllocationDeleted(client, listener, "UDP", "u", "r")
	m.Sync()
	if len(f.keys()) != 0 {
		t.Fatalf("after allocation delete: %v", f.keys())
	}
	if a, c := m.Counts(); a != 0 || c != 0 {
		t.Fatalf("counts %d allocations %d channels after delete", a, c)
	}
}

// TestPermissionDeleted: pion keeps a channel after its permission expires but
// would refuse to relay without one; the kernel path must stop, and resume when
// a CreatePermission brings the permission back.
func TestPermissionDeleted(t *testing.T) {
	m, f := newMirror(t)
	h := m.EventHandler()
	h.OnAllocationCreated(client, listener, "UDP", "u", "r", relay, 0)
	bind(m, listener, peerA, 0x4000)
	bind(m, listener, peerB, 0x4001)
	h.OnPermissionDeleted(client, listener, "UDP", "u", "r", relay, peerA.IP)
	m.Sync()
	got := f.keys()
	if _, ok := got[chKey(0x4000)]; ok {
		t.Fatal("binding to a peer without permission is still offloaded")
	}
	if _, ok := got[chKey(0x4001)]; !ok {
		t.Fatal("binding to another peer was removed")
	}
	h.OnPermissionCreated(client, listener, "UDP", "u", "r", relay, peerA.IP)
	m.Sync()
	if _, ok := f.keys()[chKey(0x4000)]; !ok {
		t.Fatal("binding not offloaded again after the permission came back")
	}
}

// TestListenersSharingAPort: one client address:port with an allocation on
// each of two listeners of one port binds the same channel number on both;
// they are two bindings, and removing one leaves the other.
func TestListenersSharingAPort(t *testing.T) {
	m, f := newMirror(t)
	other := &net.UDPAddr{IP: net.ParseIP("10.100.0.3"), Port: 3478}
	relay2 := &net.UDPAddr{IP: net.ParseIP("10.200.0.1"), Port: 50001}
	h := m.EventHandler()
	h.OnAllocationCreated(client, listener, "UDP", "u", "r", relay, 0)
	h.OnAllocationCreated(client, other, "UDP", "u", "r", relay2, 0)
	bind(m, listener, peerA, 0x4000)
	h.OnPermissionCreated(client, other, "UDP", "u", "r", relay2, peerB.IP)
	h.OnChannelCreated(client, other, "UDP", "u", "r", relay2, peerB, 0x4000)
	m.Sync()
	k2 := channelmap.Key{Client: addrPort(client), Listener: addrPort(other), Channel: 0x4000}
	got := f.keys()
	if len(got) != 2 || got[chKey(0x4000)].Peer != addrPort(peerA) || got[k2].Peer != addrPort(peerB) {
		t.Fatalf("bindings %v, want peer A through %v and peer B through %v", got, listener, other)
	}
	h.OnAllocationDeleted(client, other, "UDP", "u", "r")
	m.Sync()
	if got := f.keys(); len(got) != 1 || got[chKey(0x4000)].Peer != addrPort(peerA) {
		t.Fatalf("after deleting the second allocation: %v, want the first listener's binding only", got)
	}
}

// TestReplySourceIsNeverSeeded: the source of replies is the program's to
// learn, also for a specific listener: a DNAT in front of it may change it.
func TestReplySourceIsNeverSeeded(t *testing.T) {
	m, f := newMirror(t)
	bind(m, wildcard, peerA, 0x4000)
	bind(m, listener, peerB, 0x4001)
	m.Sync()
	for k, b := range f.keys() {
		if b.ReplySource.IsValid() {
			t.Errorf("%v: reply source %v, want none", k, b.ReplySource)
		}
	}
	if len(f.keys()) != 2 {
		t.Fatalf("installed %d bindings, want 2", len(f.keys()))
	}
}

func TestOnlyUDPAllocationsAreOffloaded(t *testing.T) {
	m, f := newMirror(t)
	h := m.EventHandler()
	tcpClient := &net.TCPAddr{IP: client.IP, Port: client.Port}
	h.OnChannelCreated(tcpClient, listener, "TCP", "u", "r", relay, peerA, 0x4000)
	m.Sync()
	if len(f.keys()) != 0 {
		t.Fatal("a TCP allocation's channel was offloaded")
	}
}

// TestHooksNeverBlock: pion calls the hooks under its locks; a stuck map write
// must not stall them.
func TestHooksNeverBlock(t *testing.T) {
	m := New(slog.New(slog.NewTextHandler(io.Discard, nil)))
	f := newFake()
	f.block = make(chan struct{})
	m.push(event{kind: evSetOffload, offload: f, done: make(chan struct{})})
	done := make(chan struct{})
	go func() {
		for i := 0; i < 1000; i++ {
			bind(m, listener, peerA, 0x4000+uint16(i%0x100))
		}
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("hooks blocked behind a stuck offload")
	}
	close(f.block)
	m.Sync()
	m.Close()
	if len(f.keys()) != 0x100 {
		t.Fatalf("%d bindings after the offload unblocked, want %d", len(f.keys()), 0x100)
	}
}

func TestFailedInstallStaysInUserspaceAndReconcileRepairs(t *testing.T) {
	m, f := newMirror(t)
	f.failPut = true
	bind(m, listener, peerA, 0x4000)
	m.Sync()
	if len(f.keys()) != 0 || m.Stats().Errors != 1 {
		t.Fatalf("installed %d, errors %d", len(f.keys()), m.Stats().Errors)
	}
	f.failPut = false
	// Drift the other way too: an entry pion does not hold.
	stray := channelmap.Binding{Client: netip.MustParseAddrPort("10.9.9.9:9"), Listener: addrPort(listener), Channel: 0x4000,
		Peer: addrPort(peerA), Relay: addrPort(relay)}
	_ = f.Upsert(stray)
	n, err := m.Reconcile()
	if err != nil {
		t.Fatal(err)
	}
	if n != 2 || m.Stats().Drift != 2 {
		t.Fatalf("repaired %d (drift %d), want 2", n, m.Stats().Drift)
	}
	got := f.keys()
	if _, ok := got[chKey(0x4000)]; !ok || len(got) != 1 {
		t.Fatalf("after reconcile: %v", got)
	}
}

func TestSetOffloadMovesBindings(t *testing.T) {
	m := New(slog.New(slog.NewTextHandler(io.Discard, nil)))
	t.Cleanup(m.Close)
	bind(m, listener, peerA, 0x4000)
	m.Sync()
	f := newFake()
	m.SetOffload(f)
	if len(f.keys()) != 1 {
		t.Fatal("existing binding not installed on attach")
	}
	m.SetOffload(nil)
	if len(f.keys()) != 0 {
		t.Fatal("binding left in the maps on detach")
	}
}

// gatingOffload is a fakeOffload that counts its GateFlows calls.
type gatingOffload struct {
	*fakeOffload
	gated chan struct{}
}

func (g *gatingOffload) GateFlows() error {
	select {
	case g.gated <- struct{}{}:
	default:
	}
	return nil
}

// TestReconcileLoopGatesFlows: the reconcile loop lets an offload that
// gates its flow caches (channelmap.Maps) count its bindings that send, every
// FlowGateInterval, whatever the reconcile interval.
func TestReconcileLoopGatesFlows(t *testing.T) {
	m := New(slog.New(slog.NewTextHandler(io.Discard, nil)))
	t.Cleanup(m.Close)
	g := &gatingOffload{fakeOffload: newFake(), gated: make(chan struct{}, 1)}
	m.SetOffload(g)
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() { defer close(done); m.RunReconcile(time.Hour, stop) }()
	defer func() { close(stop); <-done }()
	for i := range 2 {
		select {
		case <-g.gated:
		case <-time.After(10 * FlowGateInterval):
			t.Fatalf("GateFlows call %d did not come within %v", i+1, 10*FlowGateInterval)
		}
	}
}
