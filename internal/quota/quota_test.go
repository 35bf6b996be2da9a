package quota

import (
	"net"
	"testing"
)

func addr(port int) net.Addr { return &net.UDPAddr{IP: net.IPv4(10, 0, 0, 1), Port: port} }

func TestQuota(t *testing.T) {
	c := New(Limits{PerUser: 2, Total: 3})
	s1, s2 := c.NewServer(), c.NewServer()
	if s1 == s2 {
		t.Fatal("two servers share an identity")
	}
	step := func(got, want Reason) {
		t.Helper()
		if got != want {
			t.Fatalf("got %v, want %v", got, want)
		}
	}
	// alice's two allocations on two servers count together.
	step(c.Reserve(s1, addr(1), "alice"), Granted)
	c.Created(s1, addr(1), "alice")
	step(c.Reserve(s2, addr(1), "alice"), Granted)
	c.Created(s2, addr(1), "alice")
	step(c.Reserve(s1, addr(2), "alice"), UserQuota)
	// bob still allocates; a failed create gives the slot back.
	step(c.Reserve(s1, addr(3), "bob"), Granted)
	c.Failed(s1, addr(3))
	step(c.Reserve(s1, addr(3), "bob"), Granted)
	c.Created(s1, addr(3), "bob")
	// Three live: the total quota refuses carol.
	step(c.Reserve(s2, addr(4), "carol"), TotalQuota)
	// A failure report without a grant changes nothing.
	c.Failed(s2, addr(4))
	if st := c.Stats(); st.Allocations != 3 || st.Users != 2 || st.Refused[UserQuota] != 1 || st.Refused[TotalQuota] != 1 {
		t.Fatalf("stats %+v", st)
	}
	// alice's allocation on s2 ends: carol gets the slot; alice's count is one.
	c.Deleted(s2, addr(1))
	c.Deleted(s2, addr(1)) // reported twice: counted once
	if n := c.User("alice"); n != 1 {
		t.Fatalf("alice holds %d, want 1", n)
	}
	step(c.Reserve(s2, addr(4), "carol"), Granted)
	// A grant whose outcome never came is dropped by the next request on the
	// same (server, client), not held forever.
	step(c.Reserve(s2, addr(4), "carol"), Granted)
	if st := c.Stats(); st.Allocations != 3 {
		t.Fatalf("stale grant kept: %+v", st)
	}
	// Lifting the limits lets everyone in; lowering them closes nothing.
	c.SetLimits(Limits{})
	step(c.Reserve(s1, addr(5), "alice"), Granted)
	c.Created(s1, addr(5), "alice")
	c.SetLimits(Limits{PerUser: 1})
	if n := c.User("alice"); n != 2 {
		t.Fatalf("alice holds %d after lowering the quota, want 2", n)
	}
	step(c.Reserve(s1, addr(6), "alice"), UserQuota)
}

func TestPermissions(t *testing.T) {
	p := NewPermissions(2)
	c := New(Limits{})
	s1, s2 := c.NewServer(), c.NewServer()
	peer := func(i byte) net.IP { return net.IPv4(10, 9, 0, i) }
	for i := byte(1); i <= 2; i++ {
		if !p.Allow(s1, addr(1), peer(i)) {
			t.Fatalf("peer %d refused under the limit", i)
		}
		p.Created(s1, addr(1), peer(i))
	}
	if p.Allow(s1, addr(1), peer(3)) {
		t.Fatal("a third peer IP allowed with a limit of 2")
	}
	// A refresh of a held peer (IPv4 or as mapped IPv6), another allocation
	// (another client, or the same client address on another server) pass.
	if !p.Allow(s1, addr(1), peer(1)) || !p.Allow(s1, addr(1), peer(2).To16()) || !p.Allow(s1, addr(2), peer(3)) || !p.Allow(s2, addr(1), peer(3)) {
		t.Fatal("a refresh or another allocation was refused")
	}
	p.Deleted(s1, addr(1), peer(1))
	if !p.Allow(s1, addr(1), peer(3)) || p.Held(s1, addr(1)) != 1 || p.Refused() != 1 {
		t.Fatalf("after an expiry: held %d, refused %d", p.Held(s1, addr(1)), p.Refused())
	}
	p.Deleted(s1, addr(1), peer(2))
	if len(p.held) != 0 {
		t.Fatalf("empty allocations kept: %v", p.held)
	}
	p.SetLimit(0)
	p.Created(s1, addr(1), peer(1))
	p.Created(s1, addr(1), peer(2))
	if !p.Allow(s1, addr(1), peer(3)) {
		t.Fatal("refused without a limit")
	}
}
