package bench

import (
	"fmt"
	"math"
	"strings"
)

// ShapeRow is one node shape (test/netns.Shapes) in one mode of the shapes
// stage: the daemon as a STUNner user runs it (default flags, or
// --xdp-mode=off), a pion/turn client sending to an echoing peer at a fixed
// rate, the kernel's share of each direction from the daemon's metrics, and
// the server CPU per relayed packet.
type ShapeRow struct {
	Shape   string  `json:"shape"`
	Mode    string  `json:"mode"` // default or off
	RatePPS float64 `json:"rate_pps"`
	Sent    int64   `json:"sent"`
	Echoed  int64   `json:"echoed"`
	// Relayed is what the daemon counted as relayed, both directions and paths.
	Relayed float64 `json:"relayed"`
	// KernelC2P and KernelP2C are the kernel's share of what was relayed each
	// way (NaN when nothing was).
	KernelC2P float64 `json:"kernel_share_c2p"`
	KernelP2C float64 `json:"kernel_share_p2c"`
	// TotalUsPerPkt is the daemon's utime+stime plus all CPUs' softirq time per
	// relayed packet; ProcUsPerPkt the daemon's alone.
	TotalUsPerPkt float64 `json:"server_total_us_per_pkt"`
	ProcUsPerPkt  float64 `json:"server_process_us_per_pkt"`
	// The engines' live cost in the default mode (off: zero), from the
	// kernel's BPF statistics over the same interval: runs and ns per run of
	// the daemon's XDP program (all its attachments), of its TC engine (tcx
	// at ingress, all its attachments) and of a trivial tcx program (two
	// instructions) attached right before the TC engine wherever it runs,
	// so that it runs on the packets the engine runs on.
	XDPRuns           uint64  `json:"xdp_runs"`
	XDPNsPerRun       float64 `json:"xdp_ns_per_run"`
	TCRuns            uint64  `json:"tc_runs"`
	TCNsPerRun        float64 `json:"tc_ns_per_run"`
	TrivialTCRuns     uint64  `json:"trivial_tc_runs"`
	TrivialTCNsPerRun float64 `json:"trivial_tc_ns_per_run"`
	// TCPerTrivial and XDPPerTrivial are the engines' ns per run over the
	// trivial tcx program's (zero: not measured).
	TCPerTrivial  float64 `json:"tc_per_trivial"`
	XDPPerTrivial float64 `json:"xdp_per_trivial"`
}

// validateShapes reports a missing shape row or one without numbers.
func (r *Report) validateShapes() []error {
	var errs []error
	if len(r.Shapes) != r.Expected.ShapeRows {
		errs = append(errs, fmt.Errorf("shapes: %d rows, want %d", len(r.Shapes), r.Expected.ShapeRows))
	}
	tcMeasured := false
	for _, s := range r.Shapes {
		if s.Sent == 0 || !(s.Relayed > 0) || math.IsNaN(s.TotalUsPerPkt) || math.IsInf(s.TotalUsPerPkt, 0) {
			errs = append(errs, fmt.Errorf("shapes %s %s: no numbers: %+v", s.Shape, s.Mode, s))
		}
		if s.TCRuns > 0 && !(s.TCPerTrivial > 0) {
			errs = append(errs, fmt.Errorf("shapes %s %s: the TC engine ran %d times, no trivial tcx program beside it: %+v", s.Shape, s.Mode, s.TCRuns, s))
		}
		tcMeasured = tcMeasured || s.TCPerTrivial > 0
	}
	if len(r.Shapes) > 0 && !tcMeasured {
		errs = append(errs, fmt.Errorf("shapes: no row measured the TC engine's live cost"))
	}
	return errs
}

// writeShapes writes the shapes stage's table.
func writeShapes(b *strings.Builder, r *Report) {
	if len(r.Shapes) == 0 {
		return
	}
	b.WriteString("\n## Node shapes\n\n")
	st := table{head: []string{"shape", "mode", "rate pps", "sent", "echoed", "kernel share c→p %", "kernel share p→c %", "server total µs/pkt", "server process µs/pkt"}}
	pct := func(v float64) string { return f(100*v, 1) }
	for _, s := range r.Shapes {
		st.add(s.Shape, s.Mode, f(s.RatePPS, 0), f(float64(s.Sent), 0), f(float64(s.Echoed), 0), pct(s.KernelC2P), pct(s.KernelP2C),
			f(s.TotalUsPerPkt, 2), f(s.ProcUsPerPkt, 2))
	}
	b.WriteString(st.String())
	b.WriteString("\nEach row builds a `test/netns.NodeRig` of the shape (the daemon in the node's namespace, the node IP as listener " +
		"and relay address, no XDP program in any pod; see `test/netns/shapes.go`), runs the daemon on a STUNner config with no flag " +
		"but `--xdp-mode=off` in the off rows, and sends 100-byte datagrams from a pion/turn client through one channel to a peer that " +
		"echoes them, after the binding settled on a path. Server CPU is per packet the daemon counted as relayed (both directions); " +
		"softirq includes the veth hops, the bridge, the peer and the client, as in the relay stage.\n")
	writeEngineCost(b, r)
}

// writeEngineCost writes the engines' live cost per shape (default mode).
func writeEngineCost(b *strings.Builder, r *Report) {
	et := table{head: []string{"shape", "XDP runs", "XDP ns/run", "TC runs", "TC ns/run", "trivial tcx runs", "trivial tcx ns/run", "TC / trivial", "XDP / trivial"}}
	for _, s := range r.Shapes {
		if s.Mode == "off" {
			continue
		}
		ns := func(runs uint64, v float64) string {
			if runs == 0 {
				return "–"
			}
			return f(v, 0)
		}
		ratio := func(v float64) string {
			if !(v > 0) {
				return "–"
			}
			return f(v, 2) + "x"
		}
		et.add(s.Shape, f(float64(s.XDPRuns), 0), ns(s.XDPRuns, s.XDPNsPerRun), f(float64(s.TCRuns), 0), ns(s.TCRuns, s.TCNsPerRun),
			f(float64(s.TrivialTCRuns), 0), ns(s.TrivialTCRuns, s.TrivialTCNsPerRun), ratio(s.TCPerTrivial), ratio(s.XDPPerTrivial))
	}
	b.WriteString("\n### The engines' live cost per shape\n\n")
	b.WriteString(et.String())
	b.WriteString("\nThe kernel's BPF statistics (`kernel.bpf_stats_enabled`: run_time_ns / run_cnt) over each default-mode row's interval: " +
		"the daemon's XDP program and its TC engine (a cls_bpf filter at ingress), each summed over its attachments, beside a trivial program " +
		"(`r0 = TCX_NEXT; exit`, a cls_bpf filter at the priority before the engine's) on every interface the engine runs on, so that both run on the " +
		"same packets in the same interval. The XDP program runs on every frame the node's NIC receives (relayed or passed, the " +
		"echoes included); the TC engine on what XDP passed and on what pods send. A ratio is only taken within one row. " +
		"Statistics include the run-time accounting itself (two clock reads per run), which the trivial program's figure is mostly made of. " +
		"A shape named `+rp_filter=1` is the same shape with strict reverse-path filtering on the node: the TC engine then makes the stack's " +
		"lookup of the route back for every datagram from a filtering device, XDP once per next hop it resolves; its row beside the plain one " +
		"is that lookup's cost.\n")
}
