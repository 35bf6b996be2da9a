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
}

// validateShapes reports a missing shape row or one without numbers.
func (r *Report) validateShapes() []error {
	var errs []error
	if len(r.Shapes) != r.Expected.ShapeRows {
		errs = append(errs, fmt.Errorf("shapes: %d rows, want %d", len(r.Shapes), r.Expected.ShapeRows))
	}
	for _, s := range r.Shapes {
		if s.Sent == 0 || !(s.Relayed > 0) || math.IsNaN(s.TotalUsPerPkt) || math.IsInf(s.TotalUsPerPkt, 0) {
			errs = append(errs, fmt.Errorf("shapes %s %s: no numbers: %+v", s.Shape, s.Mode, s))
		}
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
}
