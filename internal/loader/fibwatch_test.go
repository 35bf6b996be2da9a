package loader

import (
	"io"
	"log/slog"
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/l7mp/stunnerd-xdp/test/netns"
	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// watchIn runs WatchFIB in the namespace and returns a channel that gets a
// value for each call of changed after the first.
func watchIn(t *testing.T, ns *netns.NS) <-chan struct{} {
	t.Helper()
	stop := make(chan struct{})
	t.Cleanup(func() { close(stop) })
	ch := make(chan struct{}, 1024)
	first := true
	err := ns.Do(func() error {
		return WatchFIB(stop, func() {
			if first {
				first = false
				return
			}
			select {
			case ch <- struct{}{}:
			default:
			}
		}, slog.New(slog.NewTextHandler(io.Discard, nil)))
	})
	if err != nil {
		t.Fatal(err)
	}
	return ch
}

// quiet drains ch and fails if it does not stay empty for d: nothing changed.
func quiet(t *testing.T, ch <-chan struct{}, d time.Duration) {
	t.Helper()
	deadline := time.After(d)
	for {
		select {
		case <-ch:
			deadline = time.After(d)
		case <-deadline:
			return
		case <-time.After(10 * time.Second):
			t.Fatal("the watch reports changes without end")
		}
	}
}

func wantChange(t *testing.T, ch <-chan struct{}, within time.Duration, what string) {
	t.Helper()
	select {
	case <-ch:
	case <-time.After(within):
		t.Errorf("%s: the next-hop cache was not invalidated within %v", what, within)
	}
}

// TestWatchFIBNexthopAndPMTU: in namespaces of its own, the watch invalidates
// the next-hop cache when a nexthop object a route uses is deleted (the kernel
// removes the route without a route notification) and when an ICMP
// fragmentation-needed error gives a path a lower MTU (a route exception, of
// which the kernel sends no notification at all).
func TestWatchFIBNexthopAndPMTU(t *testing.T) {
	netns.RequirePrivileged(t)
	defer func(d time.Duration) { ExceptionPollInterval = d }(ExceptionPollInterval)
	ExceptionPollInterval = 200 * time.Millisecond
	a, b := netns.NewNS(t, "fiba"), netns.NewNS(t, "fibb")
	// No IPv6: its link-local addresses come up a second later, and their
	// events would stand in for what is tested.
	for _, n := range []*netns.NS{a, b} {
		n.Run(t, "sysctl", "-q", "-w", "net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1")
	}
	if _, err := netns.Exec("ip", "link", "add", "va", "netns", a.Name, "type", "veth", "peer", "vb", "netns", b.Name); err != nil {
		t.Fatal(err)
	}
	a.IP(t, "addr", "add", "10.9.0.1/24", "dev", "va")
	b.IP(t, "addr", "add", "10.9.0.2/24", "dev", "vb")
	a.IP(t, "link", "set", "va", "up")
	b.IP(t, "link", "set", "vb", "up")
	// Neighbours fixed: no neighbour event stands in for what is tested.
	a.IP(t, "neigh", "replace", "10.9.0.2", "lladdr", "02:00:00:00:00:02", "dev", "va", "nud", "permanent")
	a.IP(t, "neigh", "replace", "10.9.0.3", "lladdr", "02:00:00:00:00:03", "dev", "va", "nud", "permanent")
	a.IP(t, "nexthop", "add", "id", "7", "via", "10.9.0.2", "dev", "va")
	a.IP(t, "route", "add", "10.99.0.0/24", "nhid", "7")

	ch := watchIn(t, a)
	quiet(t, ch, 300*time.Millisecond)

	// Replacing the nexthop moves the route with no route notification.
	a.IP(t, "nexthop", "replace", "id", "7", "via", "10.9.0.3", "dev", "va")
	wantChange(t, ch, time.Second, "nexthop replaced")
	quiet(t, ch, 300*time.Millisecond)

	a.IP(t, "nexthop", "del", "id", "7")
	if out := a.IP(t, "route", "show", "10.99.0.0/24"); strings.TrimSpace(out) != "" {
		t.Fatalf("the route via the deleted nexthop is still there: %q", out)
	}
	wantChange(t, ch, time.Second, "nexthop deleted")
	quiet(t, ch, 300*time.Millisecond)

	// A UDP socket in a sends through b (a router); b's ICMP error about it
	// lowers the path MTU (an exception of the gateway route: the kernel
	// keeps none for a destination on the link).
	a.IP(t, "route", "add", "10.99.0.0/24", "via", "10.9.0.2", "dev", "va")
	quiet(t, ch, 300*time.Millisecond)
	src, dst := netip.MustParseAddrPort("10.9.0.1:7000"), netip.MustParseAddrPort("10.99.0.5:7001")
	var sock *net.UDPConn
	if err := a.Do(func() error {
		c, err := net.ListenUDP("udp4", net.UDPAddrFromAddrPort(src))
		sock = c
		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer sock.Close()
	if _, err := sock.WriteToUDPAddrPort([]byte("x"), dst); err != nil {
		t.Fatal(err)
	}
	quiet(t, ch, 300*time.Millisecond)
	if err := b.Do(func() error { return testenv.SendICMP(src.Addr(), testenv.FragNeeded(src, dst, 1200)) }); err != nil {
		t.Fatal(err)
	}
	wantChange(t, ch, 2*time.Second, "path MTU lowered")
	if out := a.IP(t, "route", "get", dst.Addr().String()); !strings.Contains(out, "mtu 1200") {
		t.Errorf("no route exception with mtu 1200 in a: %q", out)
	}
	// Nothing more changes while the exception stands.
	quiet(t, ch, 3*ExceptionPollInterval)
}
