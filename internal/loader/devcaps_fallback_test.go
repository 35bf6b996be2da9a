package loader

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"

	"github.com/l7mp/stunnerd-xdp/internal/xdpfeatures"
	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// TestFallbackVethPeers: without xdp-features, a veth transmits redirected
// frames while its peer runs XDP in the driver, whether the peer is in the
// same namespace or in another (a pod's eth0, read through its netns id); a
// generic program at the peer does not count; a bridge and an ifb device
// transmit none.
func TestFallbackVethPeers(t *testing.T) {
	testenv.RequireRoot(t)
	ns, pod := testenv.NewNSWorker(t), testenv.NewNSWorker(t)
	pass, err := ebpf.NewProgram(&ebpf.ProgramSpec{Type: ebpf.XDP, License: "MIT",
		Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, 2 /* XDP_PASS */), asm.Return()}})
	if err != nil {
		t.Fatal(err)
	}
	defer pass.Close()
	idx := map[string]int{}
	if err := ns.Do(func() error {
		for _, l := range []netlink.Link{
			&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "a0"}, PeerName: "a1"},
			&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "b0"}, PeerName: "b1"},
			&netlink.Ifb{LinkAttrs: netlink.LinkAttrs{Name: "d0"}},
			&netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: "br0"}},
		} {
			if err := netlink.LinkAdd(l); err != nil {
				return err
			}
		}
		b1, err := netlink.LinkByName("b1")
		if err != nil {
			return err
		}
		if err := netlink.LinkSetNsFd(b1, int(pod.NS)); err != nil {
			return err
		}
		for _, n := range []string{"a0", "a1", "b0", "d0", "br0"} {
			l, err := netlink.LinkByName(n)
			if err != nil {
				return err
			}
			idx[n] = l.Attrs().Index
			if err := netlink.LinkSetUp(l); err != nil {
				return err
			}
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if err := pod.Do(func() error {
		l, err := netlink.LinkByName("b1")
		if err != nil {
			return err
		}
		idx["b1"] = l.Attrs().Index
		return netlink.LinkSetUp(l)
	}); err != nil {
		t.Fatal(err)
	}
	var fb *fallback
	if err := ns.Do(func() (err error) { fb, err = newFallback(); return }); err != nil {
		t.Fatal(err)
	}
	defer fb.close()
	features := func(modes map[int]Mode) map[int]xdpfeatures.Act {
		t.Helper()
		var got map[int]xdpfeatures.Act
		if err := ns.Do(func() error {
			links, err := netlink.LinkList()
			got = fb.features(links, modes)
			return err
		}); err != nil {
			t.Fatal(err)
		}
		return got
	}
	const veth = xdpfeatures.Basic | xdpfeatures.Redirect
	want := func(when string, got map[int]xdpfeatures.Act, w map[string]xdpfeatures.Act) {
		t.Helper()
		for _, n := range []string{"a0", "a1", "b0", "d0", "br0"} {
			f, ok := got[idx[n]]
			wf, wok := w[n]
			if ok != wok || f != wf {
				t.Errorf("%s: %s has %v (known %v), want %v (known %v)", when, n, f, ok, wf, wok)
			}
		}
	}
	want("no program anywhere", features(nil), map[string]xdpfeatures.Act{"a0": veth, "a1": veth, "b0": veth})

	attach := func(w *testenv.NSWorker, ifindex int, flags link.XDPAttachFlags) link.Link {
		t.Helper()
		var l link.Link
		if err := w.Do(func() (err error) {
			l, err = link.AttachXDP(link.XDPOptions{Program: pass, Interface: ifindex, Flags: flags})
			return
		}); err != nil {
			t.Fatal(err)
		}
		return l
	}
	la := attach(ns, idx["a1"], link.XDPDriverMode)
	lb := attach(pod, idx["b1"], link.XDPDriverMode)
	want("peers in the driver", features(nil),
		map[string]xdpfeatures.Act{"a0": veth | xdpfeatures.NDOXmit, "a1": veth, "b0": veth | xdpfeatures.NDOXmit})
	if err := la.Close(); err != nil {
		t.Fatal(err)
	}
	if err := lb.Close(); err != nil {
		t.Fatal(err)
	}
	lg := attach(pod, idx["b1"], link.XDPGenericMode)
	defer lg.Close()
	want("a generic program at b1, nothing at a1", features(nil), map[string]xdpfeatures.Act{"a0": veth, "a1": veth, "b0": veth})
	// This program's own native attachment counts before the kernel lists it.
	want("a1 attached natively by the program", features(map[int]Mode{idx["a1"]: ModeNative}),
		map[string]xdpfeatures.Act{"a0": veth | xdpfeatures.NDOXmit, "a1": veth, "b0": veth})
}

// TestFallbackDriverName: the driver names the fallback reads are the
// kernel's (sysfs's device/driver link) for this namespace's devices.
func TestFallbackDriverName(t *testing.T) {
	testenv.RequireRoot(t)
	fb, err := newFallback()
	if err != nil {
		t.Fatal(err)
	}
	defer fb.close()
	links, err := netlink.LinkList()
	if err != nil {
		t.Fatal(err)
	}
	checked := 0
	for _, l := range links {
		name := l.Attrs().Name
		target, err := os.Readlink(filepath.Join("/sys/class/net", name, "device/driver"))
		if err != nil {
			continue // a virtual device: no bus driver
		}
		if got := fb.driver(name); got != filepath.Base(target) {
			t.Errorf("%s: driver %q, sysfs says %q", name, got, filepath.Base(target))
		}
		checked++
	}
	if checked == 0 {
		t.Skip("no device with a bus driver here")
	}
	t.Logf("%d devices checked", checked)
}
