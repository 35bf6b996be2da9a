package bench

import (
	"strings"
	"testing"
)

// TestSessionsReport runs unprivileged: the sessions stage's rows need
// traffic both ways, the kernel rows the program's cost beside the trivial
// program's; the table renders the ratios to one flow and to no flow cache,
// and the target reads them at the most sessions.
func TestSessionsReport(t *testing.T) {
	row := func(path string, n int, ns float64) SessionRow {
		return SessionRow{Path: path, Sessions: n, Bindings: n, TargetPPS: float64(150 * n), Intervals: 1, Seconds: 1,
			SentC2P: 10, SentP2C: 10, DeliveredC2P: 10, DeliveredP2C: 10, OfferedPPS: 20, DeliveredPPS: 20, DeliveredShare: 1,
			KernelCounted: true, KernelC2P: 10, KernelP2C: 10, KernelShareC2P: 1, KernelShareP2C: 1,
			ProgNs: []float64{ns}, TrivialNs: []float64{50}, ProgMedianNs: ns, TrivialMedianNs: 50, Ratio: ns / 50, TotalUsPerPkt: 1, SoftUsPerPkt: 1}
	}
	rows := func() []SessionRow {
		coturn := row(ServerCoturn, 100, 0)
		coturn.Daemon, coturn.KernelCounted, coturn.KernelShareC2P, coturn.KernelShareP2C = true, false, -1, -1
		coturn.ProgNs, coturn.TrivialNs, coturn.ProgMedianNs, coturn.TrivialMedianNs, coturn.Ratio = nil, nil, 0, 0, 0
		return []SessionRow{row(SessionsFlowCache, 1, 200), row(SessionsNoFlow, 1, 240),
			row(SessionsFlowCache, 1000, 300), row(SessionsNoFlow, 1000, 250), row(SessionsOneFlow, 1000, 200), coturn}
	}
	r := &Report{Expected: ExpectedRows{SessionRows: 6}, Sessions: rows()}
	if errs := r.validateSessions(); len(errs) != 0 {
		t.Fatalf("complete sessions: %v", errs)
	}
	var b strings.Builder
	writeSessions(&b, r)
	for _, want := range []string{"| " + SessionsFlowCache + " | 1,000 | 1,000 | 150,000 | 10 | 100.0 | 100.0 | 100.0 | 300 | 50 | 6.00x | 1.50x | 1.20x |",
		"| " + SessionsFlowCache + " | 1 | 1 | 150 | 10 | 100.0 | 100.0 | 100.0 | 200 | 50 | 4.00x | 1.00x | 0.83x |",
		"| " + ServerCoturn + " | 100 | 100 | 15,000 | 10 | 100.0 | – | – | – | – | – | – | – |"} {
		if !strings.Contains(b.String(), want) {
			t.Errorf("report lacks %q:\n%s", want, b.String())
		}
	}
	if tr, ok := r.sessionsTarget(); !ok || tr.Met != "no" || !strings.Contains(tr.Measured, "1,000 sessions: 1.50× one flow, 1.20× no flow cache") {
		t.Errorf("target: %+v", tr)
	}
	for name, spoil := range map[string]func([]SessionRow){
		"a row missing":          func(s []SessionRow) { r.Sessions = s[:5] },
		"nothing delivered p2c":  func(s []SessionRow) { s[2].DeliveredP2C = 0 },
		"negative CPU":           func(s []SessionRow) { s[1].TotalUsPerPkt = -1 },
		"kernel row without ns":  func(s []SessionRow) { s[3].ProgMedianNs, s[3].Ratio = 0, 0 },
		"no trivial beside it":   func(s []SessionRow) { s[4].Ratio = 0 },
		"kernel share not taken": func(s []SessionRow) { s[0].KernelShareP2C = -1 },
	} {
		r.Sessions = rows()
		spoil(r.Sessions)
		if errs := r.validateSessions(); len(errs) == 0 {
			t.Errorf("%s: validated", name)
		}
	}
}
