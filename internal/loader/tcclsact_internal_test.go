package loader

import (
	"fmt"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/features"
	"github.com/vishvananda/netlink"

	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// TestTCHooksOnThisKernel: the TC engine's hooks, with a program that
// only passes, so that they are tested on every kernel whether the engine's
// program loads there or not: tcx is found where the kernel has it (6.6+);
// the clsact path adds its filter last on a device without a qdisc (its own
// clsact, removed at detach) and on the bandwidth plugin's ingress qdisc
// (kept), swaps the program in place, and a second engine's handle is
// another.
func TestTCHooksOnThisKernel(t *testing.T) {
	if testing.Short() {
		t.Skip("network namespace: not in -short mode")
	}
	testenv.RequireRoot(t)
	ns := testenv.NewNSWorker(t)
	pass := func() *ebpf.Program {
		p, err := ebpf.NewProgram(&ebpf.ProgramSpec{Type: ebpf.SchedCLS, License: "GPL",
			Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, -1), asm.Return()}})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { p.Close() })
		return p
	}
	first, second := pass(), pass()

	v, err := features.LinuxVersionCode()
	if err != nil {
		t.Fatal(err)
	}
	want := v >= 6<<16|6<<8
	if got := tcxSupported(first); got != want {
		t.Errorf("kernel %d.%d: tcx found %v, want %v", v>>16, v>>8&0xff, got, want)
	}
	t.Logf("kernel %d.%d.%d: tcx %v", v>>16, v>>8&0xff, v&0xff, want)

	err = ns.Do(func() error {
		ids := func(name string) ([]int, string, error) {
			l, err := netlink.LinkByName(name)
			if err != nil {
				return nil, "", err
			}
			var kind string
			qs, _ := netlink.QdiscList(l)
			for _, q := range qs {
				if q.Attrs().Parent == netlink.HANDLE_INGRESS {
					kind = q.Type()
				}
			}
			fs, _ := netlink.FilterList(l, netlink.HANDLE_MIN_INGRESS)
			var out []int
			for _, f := range fs {
				if isOurs(f) {
					out = append(out, f.(*netlink.BpfFilter).Id)
				}
			}
			return out, kind, nil
		}
		progID := func(p *ebpf.Program) int {
			info, _ := p.Info()
			id, _ := info.ID()
			return int(id)
		}
		owner, err := claimFreeHandle()
		if err != nil {
			return err
		}
		defer owner.release()
		other, err := claimFreeHandle()
		if err != nil {
			return err
		}
		other.release()
		if other.handle == owner.handle {
			return fmt.Errorf("two engines claimed handle %x", owner.handle)
		}
		hooks := map[string]*clsactHook{}
		for _, name := range []string{"bare", "bw"} {
			la := netlink.NewLinkAttrs()
			la.Name = name
			if err := netlink.LinkAdd(&netlink.Veth{LinkAttrs: la, PeerName: "p" + name}); err != nil {
				return fmt.Errorf("add veth %s: %w", name, err)
			}
			l, err := netlink.LinkByName(name)
			if err != nil {
				return err
			}
			if name == "bw" {
				if err := netlink.QdiscAdd(&netlink.Ingress{QdiscAttrs: netlink.QdiscAttrs{LinkIndex: l.Attrs().Index,
					Handle: netlink.MakeHandle(0xffff, 0), Parent: netlink.HANDLE_INGRESS}}); err != nil {
					return fmt.Errorf("add an ingress qdisc: %w", err)
				}
			}
			if hooks[name], err = attachClsact(l.Attrs().Index, owner.handle, first); err != nil {
				return fmt.Errorf("%s: %w", name, err)
			}
		}
		for name, qdisc := range map[string]string{"bare": "clsact", "bw": "ingress"} {
			got, kind, err := ids(name)
			if err != nil {
				return err
			}
			if len(got) != 1 || got[0] != progID(first) || kind != qdisc {
				return fmt.Errorf("%s: filters running %v on %q, want program %d on %q", name, got, kind, progID(first), qdisc)
			}
			if err := hooks[name].update(second); err != nil {
				return err
			}
			if got, _, _ := ids(name); len(got) != 1 || got[0] != progID(second) {
				return fmt.Errorf("%s after update: filters running %v, want program %d", name, got, progID(second))
			}
			if err := hooks[name].detach(); err != nil {
				return err
			}
			want := map[string]string{"bare": "", "bw": "ingress"}[name]
			if got, kind, _ := ids(name); len(got) != 0 || kind != want {
				return fmt.Errorf("%s after detach: filters running %v on %q, want none on %q", name, got, kind, want)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}
