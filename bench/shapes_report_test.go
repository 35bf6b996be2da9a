package bench

import (
	"strings"
	"testing"
)

// TestShapesEngineCost runs unprivileged: the shapes stage's report needs the
// TC engine's live cost beside a trivial tcx program's in at least one row,
// refuses a row where the engine ran without the trivial program beside it,
// and renders the ratios.
func TestShapesEngineCost(t *testing.T) {
	rows := func() []ShapeRow {
		return []ShapeRow{
			{Shape: "pod-veth", Mode: "default", Sent: 10, Relayed: 20, TotalUsPerPkt: 1, XDPRuns: 10, XDPNsPerRun: 900,
				TCRuns: 20, TCNsPerRun: 700, TrivialTCRuns: 20, TrivialTCNsPerRun: 100, TCPerTrivial: 7, XDPPerTrivial: 9},
			{Shape: "pod-veth", Mode: "off", Sent: 10, Relayed: 20, TotalUsPerPkt: 1},
		}
	}
	r := &Report{Expected: ExpectedRows{ShapeRows: 2}, Shapes: rows()}
	if errs := r.validateShapes(); len(errs) != 0 {
		t.Fatalf("complete shapes: %v", errs)
	}
	var b strings.Builder
	writeShapes(&b, r)
	for _, want := range []string{"The engines' live cost per shape", "| pod-veth | 10 | 900 | 20 | 700 | 20 | 100 | 7.00x | 9.00x |"} {
		if !strings.Contains(b.String(), want) {
			t.Errorf("report lacks %q:\n%s", want, b.String())
		}
	}
	for name, spoil := range map[string]func([]ShapeRow){
		"no trivial beside the engine": func(s []ShapeRow) { s[0].TrivialTCRuns, s[0].TrivialTCNsPerRun, s[0].TCPerTrivial = 0, 0, 0 },
		"no TC engine measured":        func(s []ShapeRow) { s[0].TCRuns, s[0].TCNsPerRun, s[0].TCPerTrivial = 0, 0, 0 },
	} {
		r.Shapes = rows()
		spoil(r.Shapes)
		if errs := r.validateShapes(); len(errs) == 0 {
			t.Errorf("%s: validated", name)
		}
	}
}
