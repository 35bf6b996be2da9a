package daemon

import (
	"net/netip"
	"testing"
	"time"

	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// waitUntil polls cond for up to d.
func waitUntil(t *testing.T, what string, d time.Duration, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %v", what, d)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// TestStandInForDeadSuccessor: a daemon draining for its successor takes new
// allocations again when the successor goes, and drains again for the next
// one. The e2e test kills the successor with SIGKILL; here it closes.
func TestStandInForDeadSuccessor(t *testing.T) {
	testenv.RequireRoot(t)
	listen := netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), freePort(t))
	pins := testenv.BPFFS(t)
	old, _, err := startOn(t, listen, pins)
	if err != nil {
		t.Fatal(err)
	}
	allocate(t, listen) // a session keeps the old daemon's drain going
	drained := old.Drain()
	nu, _, err := startOn(t, listen, pins)
	if err != nil {
		t.Fatal(err)
	}
	allocate(t, listen)
	if n := nu.AllocationCount(); n != 1 {
		t.Fatalf("the successor has %d allocations, want the new one", n)
	}
	waitUntil(t, "the old daemon hands over", 3*time.Second, old.xdp.HandedOver)

	nu.Close()
	waitUntil(t, "the old daemon stands in", 4*time.Second, func() bool { return !old.Draining() })
	if st := old.Status(); st.Status != "READY" {
		t.Errorf("standing in: status %q, want READY", st.Status)
	}
	allocate(t, listen)
	if n := old.AllocationCount(); n != 2 {
		t.Errorf("standing in: %d allocations on the old daemon, want 2 (the new one)", n)
	}
	select {
	case <-drained:
		t.Fatal("drained while standing in")
	default:
	}

	next, _, err := startOn(t, listen, pins)
	if err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "the old daemon drains for the next successor", 3*time.Second, old.Draining)
	allocate(t, listen)
	if na, nn := old.AllocationCount(), next.AllocationCount(); na != 2 || nn != 1 {
		t.Errorf("allocations: old %d, next %d; want 2 and 1", na, nn)
	}

	// The successor is told to stop too (a node drain): it lives, so the old
	// daemon keeps draining.
	next.Drain()
	time.Sleep((successorGoneChecks + 1) * successorCheck)
	if !old.Draining() {
		t.Error("the old daemon stood in for a successor that drains")
	}
}

// TestStandInBesideOtherGateway: another Gateway's daemon on the node (its own
// listener port, the same steering directory) registered after the draining
// daemon; the draining daemon's successor dies. The draining daemon stands in
// for its own Gateway all the same: the other Gateway's daemon is nobody's
// successor here (steering.Newer counts only the daemon's own listeners).
func TestStandInBesideOtherGateway(t *testing.T) {
	testenv.RequireRoot(t)
	listen := netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), freePort(t))
	other := netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), freePort(t))
	pins := testenv.BPFFS(t)
	old, _, err := startOn(t, listen, pins)
	if err != nil {
		t.Fatal(err)
	}
	allocate(t, listen)
	old.Drain()
	if _, _, err := startOn(t, other, pins); err != nil { // the other Gateway's daemon
		t.Fatal(err)
	}
	successor, _, err := startOn(t, listen, pins)
	if err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "the old daemon hands over", 3*time.Second, old.xdp.HandedOver)
	successor.Close()
	waitUntil(t, "the old daemon stands in beside the other Gateway's daemon", 4*time.Second, func() bool { return !old.Draining() })
	allocate(t, listen)
	if n := old.AllocationCount(); n != 2 {
		t.Errorf("standing in: %d allocations, want 2", n)
	}
}
