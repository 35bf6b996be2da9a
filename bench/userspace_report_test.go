package bench

import (
	"math"
	"strings"
	"testing"
)

// TestUserspaceSummaries runs unprivileged: the loss-free rate is the best
// delivered rate of an unpinned rung within lossFree, the CPU figures come
// from the lowest rung, the pinned rung only fills its own column, and a
// missing row fails Validate.
func TestUserspaceSummaries(t *testing.T) {
	pt := func(server string, target, delivered, loss, total, proc float64, pinned bool) RelayPoint {
		return RelayPoint{Server: server, TargetPPS: target, OfferedPPS: delivered, DeliveredPPS: delivered, LossPercent: loss,
			TotalUsPerPkt: total, ProcUsPerPkt: proc, Pinned: pinned, Flows: 4}
	}
	r := &Report{Expected: ExpectedRows{UserspaceServers: []string{ServerUser1, ServerCoturn}, UserspacePoints: 4}}
	r.Userspace = []RelayPoint{
		pt(ServerUser1, 20000, 20000, 0, 10, 6, false), pt(ServerUser1, 100000, 99000, 0.2, 9, 5, false),
		pt(ServerUser1, 0, 120000, 30, 8, 4, false), pt(ServerUser1, 0, 150000, 0, 7, 3, true),
		pt(ServerCoturn, 20000, 20000, 0, 20, 8, false), pt(ServerCoturn, 100000, 60000, 40, 9, 5, false),
		pt(ServerCoturn, 0, 70000, 0.1, 8, 4, false), pt(ServerCoturn, 0, 30000, 80, 7, 3, true),
	}
	if err := validateUserspace(r); len(err) != 0 {
		t.Fatalf("complete: %v", err)
	}
	got := r.UserspaceSummaries()
	want := []UserspaceSummary{
		{Server: ServerUser1, LossFreePPS: 99000, UsPerPkt: 10, ProcUsPerPkt: 6, MaxPPS: 120000, PinnedMaxPPS: 150000, PinnedGeneratorBound: true},
		{Server: ServerCoturn, LossFreePPS: 70000, UsPerPkt: 20, ProcUsPerPkt: 8, MaxPPS: 70000, PinnedMaxPPS: 30000, GeneratorBound: true},
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("summary %d: %+v, want %+v", i, got[i], want[i])
		}
	}
	var b strings.Builder
	writeUserspace(&b, r)
	if !strings.Contains(b.String(), "| "+ServerUser1+" | 99,000 | 1.41 | 10.00 | 0.50 | 6.00 | 0.75 | 120,000 | 150,000 (generator-bound) |") {
		t.Errorf("summary row not rendered as expected:\n%s", b.String())
	}
	r.Userspace = r.Userspace[1:]
	r.Userspace[0].TotalUsPerPkt = math.NaN()
	if err := validateUserspace(r); len(err) != 2 {
		t.Errorf("a missing point and a NaN: %v", err)
	}
}
