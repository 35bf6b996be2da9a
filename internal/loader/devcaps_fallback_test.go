package loader

import (
	"fmt"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

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
				return fmt.Errorf("add %s %s: %w", l.Type(), l.Attrs().Name, err)
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

// TestFallbackMatchesKernel: what the fallback says of a veth is what this
// kernel does with frames redirected into it, checked with real traffic and
// a bare redirect program (no relay program needed: it runs on kernels whose
// verifier refuses that one). A sender's frames enter r0, where a native XDP
// program redirects each into a0; a0's peer a1 is in a pod namespace with a
// socket. Where the fallback says a0 transmits (a1 runs XDP in its driver),
// every datagram must arrive; where it says not (no program, or a generic
// one), what arrives is only logged: "not" is allowed to be too careful.
func TestFallbackMatchesKernel(t *testing.T) {
	testenv.RequireRoot(t)
	host, sender, pod := testenv.NewNSWorker(t), testenv.NewNSWorker(t), testenv.NewNSWorker(t)
	move := func(name string, to *testenv.NSWorker, addr string) (net.HardwareAddr, int, error) {
		var mac net.HardwareAddr
		var idx int
		l, err := netlink.LinkByName(name)
		if err != nil {
			return nil, 0, err
		}
		if err := netlink.LinkSetNsFd(l, int(to.NS)); err != nil {
			return nil, 0, err
		}
		return mac, idx, to.Do(func() error {
			l, err := netlink.LinkByName(name)
			if err != nil {
				return err
			}
			mac, idx = l.Attrs().HardwareAddr, l.Attrs().Index
			a, _ := netlink.ParseAddr(addr)
			if err := netlink.AddrAdd(l, a); err != nil {
				return err
			}
			return netlink.LinkSetUp(l)
		})
	}
	var a0, s1mac, a1mac = 0, net.HardwareAddr(nil), net.HardwareAddr(nil)
	var a1 int
	if err := host.Do(func() error {
		for _, v := range []*netlink.Veth{
			{LinkAttrs: netlink.LinkAttrs{Name: "r0"}, PeerName: "s1"},
			{LinkAttrs: netlink.LinkAttrs{Name: "a0"}, PeerName: "a1"},
		} {
			if err := netlink.LinkAdd(v); err != nil {
				return fmt.Errorf("add veth %s: %w", v.Name, err)
			}
		}
		for _, n := range []string{"r0", "a0"} {
			l, err := netlink.LinkByName(n)
			if err != nil {
				return err
			}
			if n == "a0" {
				a0 = l.Attrs().Index
			}
			if err := netlink.LinkSetUp(l); err != nil {
				return err
			}
		}
		var err error
		if s1mac, _, err = move("s1", sender, "10.9.0.1/24"); err != nil {
			return err
		}
		a1mac, a1, err = move("a1", pod, "10.9.0.2/24")
		return err
	}); err != nil {
		t.Fatal(err)
	}
	_ = s1mac
	// The sender addresses a1's MAC: the frame is a1's to take once
	// redirected into a0.
	if err := sender.Do(func() error {
		l, err := netlink.LinkByName("s1")
		if err != nil {
			return err
		}
		return netlink.NeighAdd(&netlink.Neigh{LinkIndex: l.Attrs().Index, State: netlink.NUD_PERMANENT,
			IP: net.ParseIP("10.9.0.2"), HardwareAddr: a1mac})
	}); err != nil {
		t.Fatal(err)
	}
	redirect, err := ebpf.NewProgram(&ebpf.ProgramSpec{Type: ebpf.XDP, License: "GPL", Instructions: asm.Instructions{
		asm.Mov.Imm(asm.R1, int32(a0)), asm.Mov.Imm(asm.R2, 0), asm.FnRedirect.Call(), asm.Return()}})
	if err != nil {
		t.Fatal(err)
	}
	defer redirect.Close()
	pass, err := ebpf.NewProgram(&ebpf.ProgramSpec{Type: ebpf.XDP, License: "MIT",
		Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, 2 /* XDP_PASS */), asm.Return()}})
	if err != nil {
		t.Fatal(err)
	}
	defer pass.Close()
	if err := host.Do(func() error {
		r0, err := netlink.LinkByName("r0")
		if err != nil {
			return err
		}
		l, err := link.AttachXDP(link.XDPOptions{Program: redirect, Interface: r0.Attrs().Index, Flags: link.XDPDriverMode})
		if err != nil {
			return err
		}
		t.Cleanup(func() { l.Close() })
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	var rx, tx *net.UDPConn
	if err := pod.Do(func() (err error) {
		if rx, err = net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(10, 9, 0, 2), Port: 5000}); err != nil {
			return err
		}
		raw, err := rx.SyscallConn()
		if err != nil {
			return err
		}
		var serr error
		if err := raw.Control(func(fd uintptr) { serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_RCVBUFFORCE, 4<<20) }); err != nil {
			return err
		}
		return serr
	}); err != nil {
		t.Fatal(err)
	}
	defer rx.Close()
	if err := sender.Do(func() (err error) {
		tx, err = net.DialUDP("udp4", nil, &net.UDPAddr{IP: net.IPv4(10, 9, 0, 2), Port: 5000})
		return
	}); err != nil {
		t.Fatal(err)
	}
	// No UDP checksum (IPv4 allows 0): a veth's checksum offload would
	// leave it to be filled in, which nothing does once XDP redirected the
	// frame, and a1 would drop it for its checksum, not for the transmit.
	raw, err := tx.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var serr error
	if err := raw.Control(func(fd uintptr) { serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_NO_CHECK, 1) }); err != nil || serr != nil {
		t.Fatalf("SO_NO_CHECK: %v %v", err, serr)
	}
	defer tx.Close()
	var fb *fallback
	if err := host.Do(func() (err error) { fb, err = newFallback(); return }); err != nil {
		t.Fatal(err)
	}
	defer fb.close()

	const n = 50
	for _, tc := range []struct {
		name  string
		flags link.XDPAttachFlags // 0: no program at a1
	}{{"no program at a1", 0}, {"a1 in the driver", link.XDPDriverMode}, {"a1 generic", link.XDPGenericMode}} {
		var l link.Link
		if tc.flags != 0 {
			if err := pod.Do(func() (err error) {
				l, err = link.AttachXDP(link.XDPOptions{Program: pass, Interface: a1, Flags: tc.flags})
				return
			}); err != nil {
				t.Fatalf("%s: %v", tc.name, err)
			}
		}
		var says bool
		if err := host.Do(func() error {
			links, err := netlink.LinkList()
			says = fb.features(links, nil)[a0]&xdpfeatures.NDOXmit != 0
			return err
		}); err != nil {
			t.Fatal(err)
		}
		for i := range n {
			if _, err := tx.Write([]byte("redirected")); err != nil {
				t.Fatal(err)
			}
			if i%10 == 9 {
				time.Sleep(time.Millisecond)
			}
		}
		got := 0
		buf := make([]byte, 64)
		for {
			_ = rx.SetReadDeadline(time.Now().Add(300 * time.Millisecond))
			if _, err := rx.Read(buf); err != nil {
				break
			}
			got++
		}
		t.Logf("%s: the fallback says a0 transmits: %v; %d of %d arrived", tc.name, says, got, n)
		if says && got != n {
			t.Errorf("%s: the fallback says a0 transmits XDP frames, but %d of %d arrived", tc.name, got, n)
		}
		if l != nil {
			if err := l.Close(); err != nil {
				t.Fatal(err)
			}
		}
	}
}
