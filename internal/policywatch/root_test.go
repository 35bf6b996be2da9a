package policywatch

import (
	"errors"
	"net"
	"net/netip"
	"os/exec"
	"testing"
	"time"

	"github.com/ti-mo/conntrack"

	"github.com/l7mp/stunnerd-xdp/test/netns"
	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// The rig: one namespace with 10.0.0.1 and 10.0.0.2 on its loopback and a nat
// rule, so that conntrack tracks its flows as on a node with kube-proxy.
func inNetns(t *testing.T) bool {
	t.Helper()
	if testenv.InNetns() {
		return true
	}
	netns.RequirePrivileged(t, "iptables", "conntrack")
	ns := netns.NewNS(t, "policywatch")
	ns.IP(t, "link", "set", "lo", "up")
	for _, a := range []string{"10.0.0.1/32", "10.0.0.2/32"} {
		ns.IP(t, "addr", "add", a, "dev", "lo")
	}
	ns.Run(t, "iptables", "-t", "nat", "-A", "OUTPUT", "-d", "10.96.0.1", "-j", "DNAT", "--to-destination", "10.0.0.1")
	testenv.RunInNetns(t, ns.Name, time.Minute)
	return false
}

func run(t *testing.T, name string, args ...string) string {
	t.Helper()
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s %v: %v: %s", name, args, err, out)
	}
	return string(out)
}

// next waits (at most 5 s, scaled) for the removals of the flow src->dst.
func next(t *testing.T, got <-chan Removed, src, dst netip.AddrPort) Removed {
	t.Helper()
	timeout := time.After(testenv.Timeout(5 * time.Second))
	for {
		select {
		case r := <-got:
			if r.OrigSrc == src && r.OrigDst == dst {
				return r
			}
		case <-timeout:
			t.Fatalf("no removal of %v->%v", src, dst)
		}
	}
}

// A conntrack -D is a deletion; an entry the kernel finds expired on the
// flow's next packet is not.
func TestConntrackRemovedRoot(t *testing.T) {
	if !inNetns(t) {
		return
	}
	ev, err := ListenConntrack()
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan Removed, 64)
	go func() {
		for {
			rs, err := ev.Next()
			if err != nil && !errors.Is(err, ErrEventsLost) {
				close(got)
				return
			}
			for _, r := range rs {
				got <- r
			}
		}
	}()
	defer ev.Close()

	src, dst := netip.MustParseAddrPort("10.0.0.2:4000"), netip.MustParseAddrPort("10.0.0.1:5000")
	rx, err := net.ListenUDP("udp4", net.UDPAddrFromAddrPort(dst))
	if err != nil {
		t.Fatal(err)
	}
	defer rx.Close()
	tx, err := net.ListenUDP("udp4", net.UDPAddrFromAddrPort(src))
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Close()
	send := func() {
		if _, err := tx.WriteToUDPAddrPort([]byte("x"), dst); err != nil {
			t.Fatal(err)
		}
	}
	send()
	run(t, "conntrack", "-D", "-p", "udp", "--orig-src", "10.0.0.2", "--orig-dst", "10.0.0.1")
	r := next(t, got, src, dst)
	if want := (Removed{OrigSrc: src, OrigDst: dst, ReplySrc: dst, ReplyDst: src, Deleted: true}); r != want {
		t.Fatalf("removed %+v, want %+v", r, want)
	}

	send()
	run(t, "conntrack", "-U", "-p", "udp", "--orig-src", "10.0.0.2", "--orig-dst", "10.0.0.1", "--timeout", "1")
	time.Sleep(1500 * time.Millisecond)
	send() // finds the entry expired: the kernel removes it
	if r := next(t, got, src, dst); r.Deleted {
		t.Fatalf("an expired entry's removal %+v says deleted", r)
	}
}

// Policy notifications come for every change, and ListPolicies reads what
// the kernel holds.
func TestXfrmRoot(t *testing.T) {
	if !inNetns(t) {
		return
	}
	ev, err := WatchXfrm()
	if err != nil {
		t.Fatal(err)
	}
	defer ev.Close()
	changed := make(chan string, 16)
	go func() {
		for {
			what, err := ev.Next()
			if err != nil {
				return
			}
			changed <- what
		}
	}()
	wait := func(what string) {
		t.Helper()
		select {
		case w := <-changed:
			t.Logf("%s: %s", what, w)
		case <-time.After(testenv.Timeout(5 * time.Second)):
			t.Fatalf("no notification after %s", what)
		}
	}
	if ps, err := ListPolicies(); err != nil || len(ps) != 0 {
		t.Fatalf("policies %v, %v; want none", ps, err)
	}
	run(t, "ip", "xfrm", "policy", "add", "src", "10.0.0.1/32", "dst", "10.0.0.2/32", "proto", "udp", "sport", "5000",
		"dport", "6000", "dir", "out", "priority", "7", "action", "block")
	wait("a block policy added")
	run(t, "ip", "xfrm", "policy", "add", "src", "10.0.0.2/32", "dst", "10.0.0.1/32", "dir", "in",
		"tmpl", "src", "10.0.0.2", "dst", "10.0.0.1", "proto", "esp", "mode", "transport")
	wait("an IPsec policy added")
	ps, err := ListPolicies()
	if err != nil || len(ps) != 2 {
		t.Fatalf("policies %v, %v; want two", ps, err)
	}
	for _, p := range ps {
		t.Logf("%v", p)
		switch p.Dir {
		case DirOut:
			want := Policy{Dir: DirOut, Priority: 7, Index: p.Index, Family: 2, Src: netip.MustParsePrefix("10.0.0.1/32"),
				Dst: netip.MustParsePrefix("10.0.0.2/32"), Proto: 17, SrcPort: 5000, SrcPortMask: 0xffff, DstPort: 6000,
				DstPortMask: 0xffff, Block: true}
			if p != want {
				t.Errorf("read %+v, want %+v", p, want)
			}
		case DirIn:
			if p.Block || p.Templates != 1 {
				t.Errorf("read %+v, want an allow policy with one template", p)
			}
		}
	}
	relay, peer := netip.MustParseAddrPort("10.0.0.1:5000"), netip.MustParseAddrPort("10.0.0.2:6000")
	if _, ok := ps.Refuses(relay, peer); !ok {
		t.Error("the policies do not refuse the flow they select")
	}
	run(t, "ip", "xfrm", "policy", "flush")
	wait("the policies flushed")
	if ps, err := ListPolicies(); err != nil || len(ps) != 0 {
		t.Fatalf("policies %v, %v after the flush; want none", ps, err)
	}
}

// TestDestroyNotificationsCost: a flush of a table of n UDP entries reaches
// the subscription as n removals, or as a loss it reports (ErrEventsLost),
// never as fewer removals in silence; it logs what receiving and decoding
// cost per removal.
func TestDestroyNotificationsCost(t *testing.T) {
	if !inNetns(t) {
		return
	}
	c, err := conntrack.Dial(nil)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ev, err := ListenConntrack()
	if err != nil {
		t.Fatal(err)
	}
	defer ev.Close()
	for _, n := range []int{2000, 50000} {
		for i := range n {
			f := conntrack.NewFlow(17, 0, netip.MustParseAddr("10.0.0.2"), netip.MustParseAddr("10.0.0.1"),
				uint16(1024+i%60000), uint16(5000+i/60000), 120, 0)
			if err := c.Create(f); err != nil {
				t.Fatalf("creating entry %d: %v", i, err)
			}
		}
		if err := c.Flush(); err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		got, lost := 0, false
		for got < n && !lost {
			rs, err := ev.Next()
			switch {
			case errors.Is(err, ErrEventsLost):
				lost = true
			case err != nil:
				t.Fatal(err)
			}
			got += len(rs)
		}
		took := time.Since(start)
		t.Logf("flush of %d entries: %d removals received in %v (%.1f us each), lost: %v", n, got, took,
			float64(took.Microseconds())/float64(max(got, 1)), lost)
		if got < n && !lost {
			t.Fatalf("%d of %d removals, and no loss reported", got, n)
		}
		// Drain what is left before the next round.
		for {
			done := make(chan struct{})
			go func() {
				select {
				case <-done:
				case <-time.After(500 * time.Millisecond):
					ev.conn.SetReadDeadline(time.Now())
				}
			}()
			_, err := ev.Next()
			close(done)
			if err != nil && !errors.Is(err, ErrEventsLost) {
				ev.conn.SetReadDeadline(time.Time{})
				break
			}
		}
	}
}
