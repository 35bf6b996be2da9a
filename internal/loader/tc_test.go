package loader_test

import (
	"io"
	"log/slog"
	"slices"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"

	"github.com/l7mp/stunnerd-xdp/internal/loader"
	"github.com/l7mp/stunnerd-xdp/internal/testenv"
)

// TestTCAttachMatching: the TC engine attaches (tcx ingress) to the
// interfaces whose names match the patterns and to no other, shares the XDP
// program's maps, and detaches when closed.
func TestTCAttachMatching(t *testing.T) {
	if testing.Short() {
		t.Skip("network namespace: not in -short mode")
	}
	testenv.RequireRoot(t)
	ns := testenv.NewNSWorker(t)
	cfg := loader.Config{ListenerPorts: []uint16{3478}, MinRelayPort: 49152, MaxRelayPort: 65535, MaxBindings: 1024}
	err := ns.Do(func() error {
		for _, name := range []string{"lxc1", "cali2", "eth9"} {
			la := netlink.NewLinkAttrs()
			la.Name = name
			if err := netlink.LinkAdd(&netlink.Veth{LinkAttrs: la, PeerName: "p" + name}); err != nil {
				return err
			}
		}
		prog, err := loader.Load(cfg, slog.New(slog.NewTextHandler(io.Discard, nil)))
		if err != nil {
			return err
		}
		defer prog.Close()
		tc, err := prog.LoadTC()
		if err != nil {
			return err
		}
		got, err := tc.AttachMatching("lxc*", "cali*", "nomatch*")
		if err != nil {
			return err
		}
		slices.Sort(got)
		if !slices.Equal(got, []string{"cali2", "lxc1"}) {
			t.Errorf("attached to %v, want cali2 and lxc1", got)
		}
		for name, want := range map[string]int{"lxc1": 1, "cali2": 1, "eth9": 0, "plxc1": 0} {
			l, err := netlink.LinkByName(name)
			if err != nil {
				return err
			}
			r, err := link.QueryPrograms(link.QueryOptions{Target: l.Attrs().Index, Attach: ebpf.AttachTCXIngress})
			if err != nil {
				return err
			}
			if len(r.Programs) != want {
				t.Errorf("%s: %d programs at tcx ingress, want %d", name, len(r.Programs), want)
			}
		}
		if _, err := tc.AttachMatching("["); err == nil {
			t.Error("a malformed pattern was taken")
		}
		if err := tc.Close(); err != nil {
			return err
		}
		l, _ := netlink.LinkByName("lxc1")
		r, err := link.QueryPrograms(link.QueryOptions{Target: l.Attrs().Index, Attach: ebpf.AttachTCXIngress})
		if err != nil {
			return err
		}
		if len(r.Programs) != 0 {
			t.Errorf("still attached after Close")
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// TestTCDiscover: pods' veths that appear after Discover started are
// attached, others not; a deleted one is forgotten, so that a new device that
// reuses its name is attached again.
func TestTCDiscover(t *testing.T) {
	if testing.Short() {
		t.Skip("network namespace: not in -short mode")
	}
	testenv.RequireRoot(t)
	ns := testenv.NewNSWorker(t)
	cfg := loader.Config{ListenerPorts: []uint16{3478}, MinRelayPort: 49152, MaxRelayPort: 65535, MaxBindings: 1024}
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	var tc *loader.TC
	stop := make(chan struct{})
	err := ns.Do(func() error {
		prog, err := loader.Load(cfg, log)
		if err != nil {
			return err
		}
		t.Cleanup(func() { prog.Close() })
		if tc, err = prog.LoadTC(); err != nil {
			return err
		}
		t.Cleanup(func() { close(stop); tc.Close() })
		return tc.Discover(stop, []string{"lxc*"}, log)
	})
	if err != nil {
		t.Fatal(err)
	}
	addVeth := func(name string) {
		t.Helper()
		if err := ns.Do(func() error {
			la := netlink.NewLinkAttrs()
			la.Name = name
			return netlink.LinkAdd(&netlink.Veth{LinkAttrs: la, PeerName: "p" + name})
		}); err != nil {
			t.Fatal(err)
		}
	}
	// attached polls the kernel for a program at the device's tcx ingress.
	attached := func(name string) bool {
		t.Helper()
		var n int
		deadline := time.Now().Add(2 * time.Second)
		for {
			if err := ns.Do(func() error {
				l, err := netlink.LinkByName(name)
				if err != nil {
					return err
				}
				r, err := link.QueryPrograms(link.QueryOptions{Target: l.Attrs().Index, Attach: ebpf.AttachTCXIngress})
				n = len(r.Programs)
				return err
			}); err != nil {
				t.Fatal(err)
			}
			if n > 0 || time.Now().After(deadline) {
				return n > 0
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	addVeth("lxc7")
	addVeth("eth7")
	if !attached("lxc7") {
		t.Error("lxc7 (new, matching) not attached")
	}
	if attached("eth7") {
		t.Error("eth7 (not matching) attached")
	}
	if err := ns.Do(func() error {
		l, err := netlink.LinkByName("lxc7")
		if err != nil {
			return err
		}
		return netlink.LinkDel(l)
	}); err != nil {
		t.Fatal(err)
	}
	time.Sleep(100 * time.Millisecond)
	addVeth("lxc7")
	if !attached("lxc7") {
		t.Error("lxc7 (deleted and made again) not attached")
	}
	if got := tc.Attached(); len(got) != 1 || got[0] != "lxc7" {
		t.Errorf("attached to %v, want lxc7 only", got)
	}
}
