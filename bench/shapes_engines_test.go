package bench

import (
	"fmt"
	"slices"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"

	"github.com/l7mp/stunnerd-xdp/test/netns"
)

// tcxNext is TCX_NEXT: a tcx program's "the next program decides".
const tcxNext = -1

// engineProbe reads the live cost of the daemon's engines in a node rig: the
// XDP program and the TC engine as the daemon attached them in the node's
// namespace, and a trivial tcx program (two instructions, TCX_NEXT) attached
// right before the TC engine on every interface it runs on, so that it runs
// on exactly the packets the engine runs on, in the same interval.
type engineProbe struct {
	xdp, tc []*ebpf.Program
	trivial *ebpf.Program
	links   []link.Link
}

// probeEngines finds the daemon's programs in ns and attaches the trivial
// program beside the TC engine. Nothing attached (--xdp-mode=off): an empty
// probe.
func probeEngines(t *testing.T, ns *netns.NS) *engineProbe {
	t.Helper()
	p := &engineProbe{}
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
