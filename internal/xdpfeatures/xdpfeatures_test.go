package xdpfeatures_test

import (
	"errors"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"

	"github.com/l7mp/stunnerd-xdp/internal/xdpfeatures"
	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// TestVethFollowsItsPeer: a veth transmits redirected XDP frames (NDOXmit)
// only while its peer runs an XDP program; Get, Dump and the notifications say
// so, within a second of the peer's program coming and going.
func TestVethFollowsItsPeer(t *testing.T) {
	testenv.RequireRoot(t)
	ns := testenv.NewNSWorker(t)
	pass, err := ebpf.NewProgram(&ebpf.ProgramSpec{Type: ebpf.XDP, License: "MIT",
		Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, 2 /* XDP_PASS */), asm.Return()}})
	if err != nil {
		t.Fatal(err)
	}
	defer pass.Close()

	var (
		c         *xdpfeatures.Client
		near, far int
	)
	events := make(chan xdpfeatures.Event, 64)
	var w *xdpfeatures.Watcher
	err = ns.Do(func() error {
		if err := netlink.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "near"}, PeerName: "far"}); err != nil {
			return err
		}
		for _, n := range []string{"near", "far"} {
			l, err := netlink.LinkByName(n)
			if err != nil {
				return err
			}
			if err := netlink.LinkSetUp(l); err != nil {
				return err
			}
			*map[string]*int{"near": &near, "far": &far}[n] = l.Attrs().Index
		}
		if c, err = xdpfeatures.Dial(); err != nil {
			return err
		}
		w, err = xdpfeatures.Watch(func(e xdpfeatures.Event) { events <- e })
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	defer w.Close()

	get := func() xdpfeatures.Act {
		t.Helper()
		var a xdpfeatures.Act
		if err := ns.Do(func() (err error) { a, err = c.Get(near); return }); err != nil {
			t.Fatal(err)
		}
		return a
	}
	// waitFor waits for a change notification of near with NDOXmit as want.
	waitFor := func(want bool) {
		t.Helper()
		deadline := time.After(time.Second)
		for {
			select {
			case e := <-events:
				if e.Kind == xdpfeatures.Changed && e.Ifindex == near && (e.Features&xdpfeatures.NDOXmit != 0) == want {
					return
				}
			case <-deadline:
				t.Fatalf("no notification within a second that near's NDOXmit is %v", want)
			}
		}
	}

	if a := get(); a&xdpfeatures.NDOXmit != 0 || a&xdpfeatures.Basic == 0 {
		t.Fatalf("near with a peer without XDP: features %#x, want Basic without NDOXmit", a)
	}
	var l link.Link
	if err := ns.Do(func() (err error) {
		l, err = link.AttachXDP(link.XDPOptions{Program: pass, Interface: far, Flags: link.XDPDriverMode})
		return
	}); err != nil {
		t.Fatal(err)
	}
	waitFor(true)
	if a := get(); a&xdpfeatures.NDOXmit == 0 {
		t.Fatalf("near with an XDP program on its peer: features %#x, want NDOXmit", a)
	}
	var dump map[int]xdpfeatures.Act
	if err := ns.Do(func() (err error) { dump, err = c.Dump(); return }); err != nil {
		t.Fatal(err)
	}
	if dump[near]&xdpfeatures.NDOXmit == 0 || len(dump) < 3 { // lo, near, far
		t.Fatalf("dump %v: want lo, near (with NDOXmit) and far", dump)
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	waitFor(false)
	if a := get(); a&xdpfeatures.NDOXmit != 0 {
		t.Fatalf("near after the peer's program left: features %#x, want no NDOXmit", a)
	}
	if err := ns.Do(func() error { _, err := c.Get(near + 1000); return err }); !errors.Is(err, xdpfeatures.ErrNoDevice) {
		t.Fatalf("a missing ifindex: %v, want ErrNoDevice", err)
	}
	// Deleting the pair is notified.
	if err := ns.Do(func() error { return netlink.LinkDel(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "near"}}) }); err != nil {
		t.Fatal(err)
	}
	deadline := time.After(time.Second)
	for {
		select {
		case e := <-events:
			if e.Kind == xdpfeatures.Deleted && e.Ifindex == near {
				return
			}
		case <-deadline:
			t.Fatal("no notification within a second that near was deleted")
		}
	}
}
