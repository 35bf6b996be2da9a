package daemon

import (
	"net/netip"
	"testing"
	"time"

	"github.com/l7mp/stunnerd-xdp/internal/loader"
	"github.com/l7mp/stunnerd-xdp/test/netns"
	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// TestTCVerdictsScraped: with the TC engine loaded (as the command's default
// --tc-engine does), the daemon's scrape carries the engine's own verdict
// counters. Frames that are not IP, sent into the XDP interface from its veth
// peer, pass XDP and then the TC engine at tcx ingress, which counts each as
// pass_not_ip; the scrape shows them under stunnerd_xdp_tc_verdicts_total.
func TestTCVerdictsScraped(t *testing.T) {
	if !testenv.InNetns() {
		netns.RequirePrivileged(t)
		ns := netns.NewNS(t, "tcverdicts")
		testenv.RunInNetns(t, ns.Name, 2*time.Minute)
		return
	}
	d := startOnLink(t, "xt0", netip.MustParseAddr("10.99.0.1"), true)
	if got := d.Attached(); got["xt0"] != loader.ModeGeneric {
		t.Fatalf("attached %v, want xt0 in generic mode", got)
	}
	before := tcVerdict(t, d, "pass_not_ip")
	if before < 0 {
		t.Fatal(`no stunnerd_xdp_tc_verdicts_total{reason="pass_not_ip"} with the TC engine loaded`)
	}

	const frames = 3
	if err := testenv.SendNonIP("xt0p", "xt0", frames); err != nil {
		t.Fatal(err)
	}
	eventually(t, 5*time.Second, "the TC engine's pass_not_ip verdicts in the scrape", func() bool {
		return tcVerdict(t, d, "pass_not_ip") >= before+frames
	})
}

// tcVerdict is the scraped stunnerd_xdp_tc_verdicts_total of the reason, -1
// when the scrape has no such series.
func tcVerdict(t *testing.T, d *Daemon, reason string) float64 {
	t.Helper()
	mfs, err := d.Registry().Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != "stunnerd_xdp_tc_verdicts_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, lp := range m.GetLabel() {
				if lp.GetName() == "reason" && lp.GetValue() == reason {
					return m.GetCounter().GetValue()
				}
			}
		}
	}
	return -1
}
