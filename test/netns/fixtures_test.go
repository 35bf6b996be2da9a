package netns_test

import (
	"errors"
	"runtime"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/l7mp/stunnerd-xdp/test/netns"
)

// TestDo checks that Do runs in the namespace on a thread of its own: the caller's thread never
// leaves the test's namespace, and a function that calls t.FailNow is reported, not hung on.
func TestDo(t *testing.T) {
	netns.RequirePrivileged(t)
	n := netns.NewNS(t, "do")
	want := nsInode(t, "/run/netns/"+n.Name) // a bind mount of the namespace's nsfs inode
	home := nsInode(t, "/proc/thread-self/ns/net")
	var inside uint64
	if err := n.Do(func() error { inside = nsInode(t, "/proc/thread-self/ns/net"); return nil }); err != nil {
		t.Fatal(err)
	}
	if inside != want || inside == home {
		t.Errorf("Do ran in namespace %d, want %d (the test's is %d)", inside, want, home)
	}
	if got := nsInode(t, "/proc/thread-self/ns/net"); got != home {
		t.Errorf("the caller's thread is in %d after Do, want %d", got, home)
	}
	sentinel := errors.New("sentinel")
	if err := n.Do(func() error { return sentinel }); !errors.Is(err, sentinel) {
		t.Errorf("Do returned %v, want fn's error", err)
	}
	// What t.FailNow does.
	if err := n.Do(func() error { runtime.Goexit(); return nil }); err == nil {
		t.Error("Do returned nil for a function that never returned")
	}
}

func nsInode(t *testing.T, path string) uint64 {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		t.Error(err)
	}
	return st.Ino
}

const exposition = `# HELP stunnerd_xdp_attached Whether XDP is attached.
# TYPE stunnerd_xdp_attached gauge
stunnerd_xdp_attached{iface="srv0",mode="generic"} 0
stunnerd_xdp_attached{iface="srv0",mode="native"} 1
stunnerd_xdp_attached{iface="srv1",mode="native"} 1
# TYPE stunnerd_xdp_packets_total counter
stunnerd_xdp_packets_total{direction="client_to_peer",path="xdp"} 12
stunnerd_xdp_packets_total{direction="client_to_peer",path="userspace"} 3
# TYPE stunnerd_xdp_allocations_active gauge
stunnerd_xdp_allocations_active 2
`

func TestMetrics(t *testing.T) {
	m, err := netns.ParseMetrics(strings.NewReader(exposition))
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		labels []string
		want   float64
		found  bool
	}{{[]string{"mode", "native"}, 2, true}, {[]string{"iface", "srv0", "mode", "native"}, 1, true}, {[]string{"iface", "srv2"}, 0, false}} {
		if got, found := m.Sum("stunnerd_xdp_attached", c.labels...); got != c.want || found != c.found {
			t.Errorf("Sum(attached, %v) = %v, %v; want %v, %v", c.labels, got, found, c.want, c.found)
		}
	}
	if got, _ := m.Sum("stunnerd_xdp_packets_total"); got != 15 {
		t.Errorf("Sum(packets) = %v, want 15", got)
	}
	s := m.Samples()
	if got := s[`stunnerd_xdp_packets_total{direction="client_to_peer",path="userspace"}`]; got != 3 || len(s) != 6 {
		t.Errorf("Samples() = %v", s)
	}
	if v, ok := s["stunnerd_xdp_allocations_active"]; !ok || v != 2 {
		t.Errorf("Samples() lacks the unlabelled gauge: %v", s)
	}
	if _, err := netns.ParseMetrics(strings.NewReader("bad{ 1\n")); err == nil {
		t.Error("ParseMetrics accepted a broken exposition")
	}
}

func TestEventually(t *testing.T) {
	calls := 0
	if err := netns.Eventually(time.Second, time.Millisecond, func() error {
		if calls++; calls < 3 {
			return errors.New("not yet")
		}
		return nil
	}); err != nil || calls != 3 {
		t.Errorf("Eventually = %v after %d calls, want nil after 3", err, calls)
	}
	last := errors.New("still not")
	err := netns.Eventually(50*time.Millisecond, 5*time.Millisecond, func() error { return last })
	if !errors.Is(err, netns.ErrTimeout) || !errors.Is(err, last) {
		t.Errorf("Eventually = %v, want ErrTimeout wrapping the last error", err)
	}
	final := errors.New("gone")
	calls = 0
	start := time.Now()
	err = netns.Eventually(5*time.Second, time.Millisecond, func() error { calls++; return netns.Abort(final) })
	if !errors.Is(err, final) || calls != 1 || time.Since(start) > time.Second {
		t.Errorf("Eventually = %v after %d calls and %v, want the aborting error at once", err, calls, time.Since(start))
	}
}
