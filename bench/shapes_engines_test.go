package bench

import (
	"fmt"
	"slices"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/l7mp/stunnerd-xdp/test/netns"
)

// tcxNext is TCX_NEXT: a tcx program's "the next program decides".
const tcxNext = -1

// engineProbe reads the live cost of the daemon's engines in a node rig: the
// XDP program and the TC engine as the daemon attached them in the node's
// namespace, and a trivial program (two instructions, TCX_NEXT) attached
// right before the TC engine on every interface it runs on (a cls_bpf filter
// at the priority before the engine's, or a tcx program before it), so that
// it runs on exactly the packets the engine runs on, in the same interval.
type engineProbe struct {
	xdp, tc []*ebpf.Program
	trivial *ebpf.Program
	links   []link.Link
	filters []*netlink.BpfFilter
	ns      *netns.NS
}

// clsactPriority is the daemon's cls_bpf filter priority (internal/loader:
// after every other filter).
const clsactPriority = 65535

// clsactEngine finds the daemon's TC engine among the ingress cls_bpf filters
// of l: the one at its priority, named as the loader names it.
func clsactEngine(l netlink.Link) (ebpf.ProgramID, bool) {
	fs, err := netlink.FilterList(l, netlink.HANDLE_MIN_INGRESS)
	if err != nil {
		return 0, false
	}
	for _, f := range fs {
		if bf, ok := f.(*netlink.BpfFilter); ok && bf.Priority == clsactPriority && bf.Name == "stunnerd-xdp" && bf.Id != 0 {
			return ebpf.ProgramID(bf.Id), true
		}
	}
	return 0, false
}

// probeEngines finds the daemon's programs in ns and attaches the trivial
// program beside the TC engine. Nothing attached (--xdp-mode=off): an empty
// probe.
func probeEngines(t *testing.T, ns *netns.NS) *engineProbe {
	t.Helper()
	p := &engineProbe{ns: ns}
	t.Cleanup(p.close)
	trivial, err := ebpf.NewProgram(&ebpf.ProgramSpec{Name: "tcx_next_floor", Type: ebpf.SchedCLS, License: "MIT",
		Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, tcxNext), asm.Return()}})
	if err != nil {
		t.Fatal(err)
	}
	p.trivial = trivial
	var xdpIDs, tcIDs []ebpf.ProgramID
	err = ns.Do(func() error {
		links, err := netlink.LinkList()
		if err != nil {
			return err
		}
		for _, l := range links {
			if x := l.Attrs().Xdp; x != nil && x.Attached && x.ProgId != 0 && !slices.Contains(xdpIDs, ebpf.ProgramID(x.ProgId)) {
				xdpIDs = append(xdpIDs, ebpf.ProgramID(x.ProgId))
			}
			// The engine as a cls_bpf filter (clsact, the default): the
			// trivial program goes in a filter of its own right before it.
			if engine, ok := clsactEngine(l); ok {
				if !slices.Contains(tcIDs, engine) {
					tcIDs = append(tcIDs, engine)
				}
				f := &netlink.BpfFilter{FilterAttrs: netlink.FilterAttrs{LinkIndex: l.Attrs().Index, Parent: netlink.HANDLE_MIN_INGRESS,
					Handle: 1, Priority: clsactPriority - 1, Protocol: unix.ETH_P_ALL},
					Fd: trivial.FD(), Name: "tcx_next_floor", DirectAction: true}
				if err := netlink.FilterAdd(f); err != nil {
					return fmt.Errorf("add the trivial cls_bpf filter to %s: %w", l.Attrs().Name, err)
				}
				p.filters = append(p.filters, f)
				continue
			}
			// The engine on tcx (where a loader caller asked for it).
			q, err := link.QueryPrograms(link.QueryOptions{Target: l.Attrs().Index, Attach: ebpf.AttachTCXIngress})
			if err != nil || len(q.Programs) == 0 {
				continue
			}
			engine := q.Programs[len(q.Programs)-1].ID
			if !slices.Contains(tcIDs, engine) {
				tcIDs = append(tcIDs, engine)
			}
			tl, err := link.AttachTCX(link.TCXOptions{Interface: l.Attrs().Index, Program: trivial,
				Attach: ebpf.AttachTCXIngress, Anchor: link.BeforeProgramByID(engine)})
			if err != nil {
				return fmt.Errorf("attach the trivial tcx program to %s: %w", l.Attrs().Name, err)
			}
			p.links = append(p.links, tl)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	open := func(ids []ebpf.ProgramID) []*ebpf.Program {
		var out []*ebpf.Program
		for _, id := range ids {
			prog, err := ebpf.NewProgramFromID(id)
			if err != nil {
				t.Fatalf("program %d: %v", id, err)
			}
			out = append(out, prog)
		}
		return out
	}
	p.xdp, p.tc = open(xdpIDs), open(tcIDs)
	return p
}

func (p *engineProbe) close() {
	for _, l := range p.links {
		_ = l.Close()
	}
	if len(p.filters) > 0 {
		_ = p.ns.Do(func() error {
			for _, f := range p.filters {
				_ = netlink.FilterDel(f)
			}
			return nil
		})
	}
	for _, prog := range append(append(slices.Clone(p.xdp), p.tc...), p.trivial) {
		if prog != nil {
			_ = prog.Close()
		}
	}
}

// engineStats is a reading of the probed programs' run-time statistics, each
// summed over the programs of its kind.
type engineStats struct{ xdp, tc, trivial progStats }

func (p *engineProbe) read(t *testing.T) engineStats {
	t.Helper()
	sum := func(progs []*ebpf.Program) progStats {
		var s progStats
		for _, prog := range progs {
			st, err := statsOf(prog)
			if err != nil {
				t.Fatalf("BPF statistics: %v", err)
			}
			s.runTime += st.runTime
			s.runs += st.runs
		}
		return s
	}
	return engineStats{xdp: sum(p.xdp), tc: sum(p.tc), trivial: sum([]*ebpf.Program{p.trivial})}
}

// fill puts what ran between before and after into row.
func (s engineStats) fill(before engineStats, row *ShapeRow) {
	row.XDPRuns, row.XDPNsPerRun = s.xdp.runs-before.xdp.runs, s.xdp.nsPerRunSince(before.xdp)
	row.TCRuns, row.TCNsPerRun = s.tc.runs-before.tc.runs, s.tc.nsPerRunSince(before.tc)
	row.TrivialTCRuns, row.TrivialTCNsPerRun = s.trivial.runs-before.trivial.runs, s.trivial.nsPerRunSince(before.trivial)
	if row.TrivialTCNsPerRun > 0 {
		row.TCPerTrivial = row.TCNsPerRun / row.TrivialTCNsPerRun
		row.XDPPerTrivial = row.XDPNsPerRun / row.TrivialTCNsPerRun
	}
}
