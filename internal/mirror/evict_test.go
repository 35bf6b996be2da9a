package mirror

import (
	"net"
	"net/netip"
	"sync"
	"testing"

	"github.com/l7mp/stunnerd-xdp/internal/natcheck"
	"github.com/l7mp/stunnerd-xdp/internal/policywatch"
)

// clientChecker is fakeChecker that also says where clients' entries lead.
type clientChecker struct {
	*fakeChecker
	mu     sync.Mutex
	client natcheck.ClientVerdict
	asked  []netip.AddrPort // the wire addresses looked up
}

func (c *clientChecker) CheckClient(_, wire, _ netip.AddrPort) (natcheck.ClientVerdict, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.asked = append(c.asked, wire)
	return c.client, nil
}

func (c *clientChecker) setClient(v natcheck.ClientVerdict) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.client = v
}

var vip = netip.MustParseAddrPort("10.96.0.10:3478")

// removed is the conntrack entry src->dst, untranslated, removed by a
// request (deleted) or by the kernel.
func removed(src, dst netip.AddrPort, deleted bool) policywatch.Removed {
	return policywatch.Removed{OrigSrc: src, OrigDst: dst, ReplySrc: dst, ReplyDst: src, Deleted: deleted}
}

func wantEvicted(t *testing.T, m *Mirror, want map[string]uint64) {
	t.Helper()
	got := m.Stats().Evicted
	for _, r := range EvictReasons {
		if got[r] != want[r] {
			t.Fatalf("evicted %v, want %v", got, want)
		}
	}
}

// twoOffloaded is a gated mirror with two bindings of one client offloaded:
// channel 0x4000 to peerA and 0x4001 to peerB.
func twoOffloaded(t *testing.T) (*Mirror, *fakeOffload, *fakeChecker) {
	t.Helper()
	m, f, c, _ := newGatedMirror(t)
	c.set(peerA, natcheck.Direct)
	c.set(peerB, natcheck.Direct)
	bind(m, listener, peerA, 0x4000)
	bind(m, listener, peerB, 0x4001)
	settle(t, m)
	if len(f.keys()) != 2 {
		t.Fatalf("offloaded %v, want both", f.keys())
	}
	return m, f, c
}

// The relay<->peer entry removed, whichever way it was made: the binding
// leaves the maps, waits in userspace for a new entry and is offloaded again
// once the checker finds one.
func TestConntrackRemovedEvictsPeerFlow(t *testing.T) {
	m, f, c := twoOffloaded(t)
	// Another flow of the relay, and another relay's flow to the peer: no binding's.
	m.ConntrackRemoved(removed(addrPort(relay), netip.MustParseAddrPort("10.200.0.9:5001"), true))
	m.ConntrackRemoved(removed(netip.MustParseAddrPort("10.200.0.1:50001"), addrPort(peerA), true))
	m.ConntrackRemoved(removed(addrPort(relay), addrPort(peerA), true))
	m.Sync()
	onlyOffloaded(t, f, 0x4001, peerB)
	wantEvicted(t, m, map[string]uint64{EvictConntrackDeleted: 1})
	wantUserspace(t, m, map[string]int{ReasonPending: 1})
	if _, err := m.Reconcile(); err != nil || len(f.keys()) != 1 {
		t.Fatalf("reconcile brought the evicted binding back: %v, %v", f.keys(), err)
	}

	c.set(peerA, natcheck.Unknown) // pion's packets made no entry yet (a DROP rule)
	if n := m.RecheckPending(); n != 0 {
		t.Fatalf("recheck offloaded %d without a new entry", n)
	}
	c.set(peerA, natcheck.Direct)
	if n := m.RecheckPending(); n != 1 || len(f.keys()) != 2 {
		t.Fatalf("recheck offloaded %d (%v), want the binding back", n, f.keys())
	}

	// The peer's own entry (the peer sent first), expired.
	m.ConntrackRemoved(removed(addrPort(peerB), addrPort(relay), false))
	m.Sync()
	onlyOffloaded(t, f, 0x4000, peerA)
	wantEvicted(t, m, map[string]uint64{EvictConntrackDeleted: 1, EvictConntrackExpired: 1})
}

// The client's entry removed (it came through a VIP): every binding of the
// client leaves the maps and comes back only once a new entry for the VIP
// leads to the listener, and the peer's flow is still offloadable.
func TestConntrackRemovedEvictsClientFlow(t *testing.T) {
	m, f, c, _ := newGatedMirror(t)
	cc := &clientChecker{fakeChecker: c}
	m.SetGate(cc)
	c.set(peerA, natcheck.Direct)
	c.set(peerB, natcheck.Direct)
	bind(m, listener, peerA, 0x4000)
	bind(m, listener, peerB, 0x4001)
	settle(t, m)
	m.ConntrackRemoved(policywatch.Removed{OrigSrc: addrPort(client), OrigDst: vip,
		ReplySrc: addrPort(listener), ReplyDst: addrPort(client), Deleted: true})
	m.Sync()
	if len(f.keys()) != 0 {
		t.Fatalf("offloaded %v after the client's entry went", f.keys())
	}
	wantEvicted(t, m, map[string]uint64{EvictConntrackDeleted: 2})
	wantUserspace(t, m, map[string]int{ReasonClientConntrack: 2})
	for _, v := range []natcheck.ClientVerdict{natcheck.ClientNone, natcheck.ClientElsewhere} {
		cc.setClient(v)
		if n := m.RecheckPending(); n != 0 {
			t.Fatalf("recheck offloaded %d while the client's entry is %v", n, v)
		}
	}
	cc.setClient(natcheck.ClientHere)
	c.set(peerB, natcheck.Unknown)
	if n := m.RecheckPending(); n != 1 {
		t.Fatalf("recheck offloaded %d, want the binding whose peer flow is direct", n)
	}
	onlyOffloaded(t, f, 0x4000, peerA)
	wantUserspace(t, m, map[string]int{ReasonPending: 1})
	cc.mu.Lock()
	defer cc.mu.Unlock()
	for _, w := range cc.asked {
		if w != vip {
			t.Fatalf("looked the client's entry up at %v, want %v (where its removed one went)", w, vip)
		}
	}
}

// A client on a wildcard listener: its entry's reply comes from one of the
// node's addresses.
func TestConntrackRemovedWildcardListener(t *testing.T) {
	m, f, c, _ := newGatedMirror(t)
	c.set(peerA, natcheck.Direct)
	bind(m, wildcard, peerA, 0x4000)
	settle(t, m)
	if len(f.keys()) != 1 {
		t.Fatalf("offloaded %v", f.keys())
	}
	m.ConntrackRemoved(removed(addrPort(client), addrPort(listener), false))
	m.Sync()
	if len(f.keys()) != 0 {
		t.Fatalf("offloaded %v after the client's entry went", f.keys())
	}
}

// After lost notifications, the bindings whose entry is missing are evicted.
func TestConntrackLostLooksUp(t *testing.T) {
	m, f, c := twoOffloaded(t)
	c.set(peerA, natcheck.Unknown)
	m.ConntrackLost()
	m.Sync()
	onlyOffloaded(t, f, 0x4001, peerB)
	wantEvicted(t, m, map[string]uint64{EvictConntrackMissing: 1})
}

// After lost notifications, a client entry that leads elsewhere evicts its
// bindings; none at all does not (a namespace conntrack does not track: the
// binding was admitted without one).
func TestConntrackLostClientEntry(t *testing.T) {
	m, f, c, _ := newGatedMirror(t)
	cc := &clientChecker{fakeChecker: c}
	m.SetGate(cc)
	c.set(peerA, natcheck.Direct)
	cc.setClient(natcheck.ClientHere)
	bind(m, listener, peerA, 0x4000)
	settle(t, m)
	f.mu.Lock()
	for k, b := range f.m {
		b.ReplySource, b.ReplyPort = addrPort(listener).Addr(), addrPort(listener).Port() // learned by the program
		f.m[k] = b
	}
	f.mu.Unlock()
	cc.setClient(natcheck.ClientNone)
	m.ConntrackLost()
	m.Sync()
	if len(f.keys()) != 1 {
		t.Fatalf("offloaded %v after lost notifications with no client entry, want the binding", f.keys())
	}
	cc.setClient(natcheck.ClientElsewhere)
	m.ConntrackLost()
	m.Sync()
	if len(f.keys()) != 0 {
		t.Fatalf("offloaded %v after lost notifications with the client's entry leading elsewhere", f.keys())
	}
	wantEvicted(t, m, map[string]uint64{EvictConntrackMissing: 1})
}

// An xfrm policy that blocks or encrypts a flow takes its bindings out and
// keeps new ones out; one that lets it through (a bypass) does not; when it
// goes they come back.
func TestXfrmPolicies(t *testing.T) {
	m, f, _ := twoOffloaded(t)
	host := func(a *net.UDPAddr) netip.Prefix { return netip.PrefixFrom(addrPort(a).Addr(), 32) }
	block := policywatch.Policy{Dir: policywatch.DirOut, Src: host(relay), Dst: host(peerA), Block: true}
	m.SetXfrmPolicies(policywatch.Policies{block})
	onlyOffloaded(t, f, 0x4001, peerB)
	wantEvicted(t, m, map[string]uint64{EvictXfrm: 1})
	wantUserspace(t, m, map[string]int{ReasonXfrm: 1})
	bind(m, listener, peerA, 0x4002)
	settle(t, m)
	onlyOffloaded(t, f, 0x4001, peerB)
	wantUserspace(t, m, map[string]int{ReasonXfrm: 2})

	// A bypass of higher precedence lets the stack send in the clear.
	bypass := policywatch.Policy{Dir: policywatch.DirOut, Src: host(relay), Dst: host(peerA)}
	block.Priority = 10
	m.SetXfrmPolicies(policywatch.Policies{block, bypass})
	if len(f.keys()) != 3 {
		t.Fatalf("offloaded %v under a bypass, want all three", f.keys())
	}

	// IPsec on the client's flow (an in policy with a template): all of them.
	ipsec := policywatch.Policy{Dir: policywatch.DirIn, Src: host(client), Dst: host(listener), Templates: 1}
	m.SetXfrmPolicies(policywatch.Policies{ipsec})
	if len(f.keys()) != 0 {
		t.Fatalf("offloaded %v under IPsec on the client's flow", f.keys())
	}
	wantEvicted(t, m, map[string]uint64{EvictXfrm: 4})
	m.SetXfrmPolicies(nil)
	if len(f.keys()) != 3 {
		t.Fatalf("offloaded %v once the policies went, want all three", f.keys())
	}
}

// A policy on the relay as the peer sees it (a masquerade's address) refuses
// a translated binding, found before or after the policy came.
func TestXfrmPolicyOnTheTranslatedRelay(t *testing.T) {
	m, f, c, _ := newGatedMirror(t)
	c.translate(peerA, "10.244.0.0:61000")
	onWire := policywatch.Policy{Dir: policywatch.DirOut, Src: netip.MustParsePrefix("10.244.0.0/32"), Block: true}
	m.SetXfrmPolicies(policywatch.Policies{onWire})
	bind(m, listener, peerA, 0x4000)
	settle(t, m)
	if len(f.keys()) != 0 {
		t.Fatalf("offloaded %v from a relay a policy blocks", f.keys())
	}
	wantUserspace(t, m, map[string]int{ReasonXfrm: 1})
	m.SetXfrmPolicies(nil)
	if len(f.keys()) != 1 {
		t.Fatalf("offloaded %v once the policy went, want the binding", f.keys())
	}
	m.SetXfrmPolicies(policywatch.Policies{onWire})
	if len(f.keys()) != 0 {
		t.Fatalf("offloaded %v after the policy came", f.keys())
	}
	wantEvicted(t, m, map[string]uint64{EvictXfrm: 1})
}
