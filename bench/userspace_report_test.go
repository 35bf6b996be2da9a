package bench

import (
	"math"
	"strings"
	"testing"
)

// TestUserspaceSummaries runs unprivileged: the loss-free rates are the best
// delivered rates of an unpinned and of a pinned rung within lossFree, the
// CPU figures come from the lowest unpinned rung, the pinned max rung fills
// its own column too, each figure is the median over the rounds, each ratio
// to coturn the median of the ratios within a round, and a missing row
// fails Validate.
func TestUserspaceSummaries(t *testing.T) {
	pt := func(round int, server string, target, delivered, loss, total, proc float64, pinned bool) RelayPoint {
		return RelayPoint{Server: server, TargetPPS: target, OfferedPPS: delivered, DeliveredPPS: delivered, LossPercent: loss,
			TotalUsPerPkt: total, ProcUsPerPkt: proc, Pinned: pinned, Flows: 4, Round: round}
	}
	r := &Report{Expected: ExpectedRows{UserspaceServers: []string{ServerUser1, ServerCoturn}, UserspacePoints: 15}}
	// Round 1 as a single round; rounds 2 and 3 move every figure, so that
	// medians and paired ratios differ from the pooled or the first ones.
	r.Userspace = []RelayPoint{
		pt(1, ServerUser1, 20000, 20000, 0, 10, 6, false), pt(1, ServerUser1, 100000, 99000, 0.2, 9, 5, false),
		pt(1, ServerUser1, 0, 120000, 30, 8, 4, false), pt(1, ServerUser1, 100000, 100000, 0, 7, 3, true), pt(1, ServerUser1, 0, 150000, 0, 7, 3, true),
		pt(1, ServerCoturn, 20000, 20000, 0, 20, 8, false), pt(1, ServerCoturn, 100000, 60000, 40, 9, 5, false),
		pt(1, ServerCoturn, 0, 70000, 0.1, 8, 4, false), pt(1, ServerCoturn, 100000, 95000, 0.3, 7, 3, true), pt(1, ServerCoturn, 0, 30000, 80, 7, 3, true),

		pt(2, ServerUser1, 20000, 20000, 0, 12, 9, false), pt(2, ServerUser1, 100000, 90000, 10, 9, 5, false),
		pt(2, ServerUser1, 0, 110000, 30, 8, 4, false), pt(2, ServerUser1, 100000, 100000, 0, 7, 3, true), pt(2, ServerUser1, 0, 140000, 5, 7, 3, true),
		pt(2, ServerCoturn, 20000, 20000, 0, 12, 6, false), pt(2, ServerCoturn, 100000, 100000, 0, 9, 5, false),
		pt(2, ServerCoturn, 0, 80000, 1, 8, 4, false), pt(2, ServerCoturn, 100000, 100000, 0, 7, 3, true), pt(2, ServerCoturn, 0, 40000, 80, 7, 3, true),

		pt(3, ServerUser1, 20000, 20000, 0, 11, 7, false), pt(3, ServerUser1, 100000, 98000, 0, 9, 5, false),
		pt(3, ServerUser1, 0, 100000, 0, 8, 4, false), pt(3, ServerUser1, 100000, 98000, 0.4, 7, 3, true), pt(3, ServerUser1, 0, 160000, 0, 7, 3, true),
		pt(3, ServerCoturn, 20000, 20000, 0, 10, 7, false), pt(3, ServerCoturn, 100000, 50000, 0, 9, 4, false),
		pt(3, ServerCoturn, 0, 90000, 0, 8, 4, false), pt(3, ServerCoturn, 100000, 99000, 0.5, 7, 3, true), pt(3, ServerCoturn, 0, 50000, 80, 7, 3, true),
	}
	if err := validateUserspace(r); len(err) != 0 {
		t.Fatalf("complete: %v", err)
	}
	got := r.UserspaceSummaries()
	// User1: loss-free 99,000 / 20,000 / 100,000, lowest-rung process 6 / 9 / 7;
	// coturn: loss-free 70,000 / 100,000 / 90,000, process 8 / 6 / 7.
	// At the highest rung both carried loss-free (20,000, 20,000, 100,000):
	// 6/8, 9/6, 5/4 → median 1.25.
	// Paired process ratios 0.75 / 1.5 / 1 (median 1; the pooled medians
	// would give 7/7 = 1 too, so the loss-free ratios tell them apart:
	// 99/70, 0.2, 100/90 → median 100/90, not 99/90).
	// Pinned loss-free: user1 150,000 / 100,000 / 160,000 (the max rung when
	// it lost nothing), coturn 95,000 / 100,000 / 99,000 (0.5 % is still
	// loss-free); paired 150/95, 1, 160/99 → median 150/95.
	want := []UserspaceSummary{
		{Server: ServerUser1, Rounds: 3, LossFreePPS: 99000, LossFreeLo: 20000, LossFreeHi: 100000,
			PinnedLossFreePPS: 150000, PinnedLossFreeLo: 100000, PinnedLossFreeHi: 160000, UsPerPkt: 11, ProcUsPerPkt: 7,
			MaxPPS: 110000, PinnedMaxPPS: 150000, GeneratorBound: false, PinnedGeneratorBound: true,
			LossFreeX: 100000.0 / 90000, PinnedLossFreeX: 150000.0 / 95000, PinnedLossFreeXLo: 1, PinnedLossFreeXHi: 160000.0 / 99000,
			UsX: 1.0, ProcX: 1, ProcXLo: 0.75, ProcXHi: 1.5,
			LoadedX: 1.25, LoadedXLo: 0.75, LoadedXHi: 1.5},
		{Server: ServerCoturn, Rounds: 3, LossFreePPS: 90000, LossFreeLo: 70000, LossFreeHi: 100000,
			PinnedLossFreePPS: 99000, PinnedLossFreeLo: 95000, PinnedLossFreeHi: 100000, UsPerPkt: 12, ProcUsPerPkt: 7,
			MaxPPS: 80000, PinnedMaxPPS: 40000, GeneratorBound: true, PinnedGeneratorBound: false,
			LossFreeX: 1, PinnedLossFreeX: 1, PinnedLossFreeXLo: 1, PinnedLossFreeXHi: 1,
			UsX: 1, ProcX: 1, ProcXLo: 1, ProcXHi: 1, LoadedX: 1, LoadedXLo: 1, LoadedXHi: 1},
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("summary %d:\n got %+v\nwant %+v", i, got[i], want[i])
		}
	}
	var b strings.Builder
	writeUserspace(&b, r)
	if row := "| " + ServerUser1 + " | 3 | 99,000 (20,000–100,000) | 1.11 | 150,000 (100,000–160,000) | 1.58 (1.00–1.62) | 11.00 | 1.00 | 7.00 | 1.00 (0.75–1.50) | 1.25 (0.75–1.50) | 110,000 | 150,000 (generator-bound) |"; !strings.Contains(b.String(), row) {
		t.Errorf("summary row not rendered as expected, want\n%s\nin\n%s", row, b.String())
	}
	if got := ratio(math.Inf(1)); got != "∞" {
		t.Errorf("a ratio to a coturn that carried nothing loss-free: %q", got)
	}
	if got := lossFreeCell(0, 0, 0); got != "none" {
		t.Errorf("no rung carried loss-free in any round: %q", got)
	}
	r.Userspace = r.Userspace[1:]
	r.Userspace[0].TotalUsPerPkt = math.NaN()
	if err := validateUserspace(r); len(err) != 2 {
		t.Errorf("a missing point and a NaN: %v", err)
	}
}

// TestLossFreeSearch runs unprivileged: the search narrows the gap between
// the highest pinned rung carried loss-free and the next pinned one up that
// was not (unpinned rungs, max rungs and earlier search points are not
// rungs), and a search point counts for the pinned loss-free rate only,
// never as the lowest rung or as a rung shared with coturn, and at most
// UserspaceSearch per round.
func TestLossFreeSearch(t *testing.T) {
	pt := func(target, delivered, loss, proc float64, pinned, search bool) RelayPoint {
		return RelayPoint{Server: ServerUser1, Round: 1, TargetPPS: target, OfferedPPS: delivered, DeliveredPPS: delivered,
			LossPercent: loss, TotalUsPerPkt: proc + 4, ProcUsPerPkt: proc, Pinned: pinned, Search: search, Flows: 4}
	}
	unpinned := []RelayPoint{pt(20000, 20000, 0, 8, false, false), pt(100000, 99900, 0.1, 7, false, false), pt(0, 150000, 30, 7, false, false)}
	pinned := []RelayPoint{pt(100000, 99900, 0.1, 6, true, false), pt(150000, 130000, 10, 6, true, false), pt(0, 170000, 5, 6, true, false)}
	all := append(append([]RelayPoint(nil), unpinned...), pinned...)
	for _, c := range []struct {
		name   string
		points []RelayPoint
		lo, hi float64
		ok     bool
	}{
		{"pinned rungs", all, 100000, 150000, true},
		{"a lower rung failed too", append([]RelayPoint{pt(50000, 45000, 10, 7, true, false)}, all...), 100000, 150000, true},
		{"every rung carried", all[:4], 0, 0, false},
		{"none carried", []RelayPoint{pt(20000, 10000, 50, 8, true, false), pt(0, 170000, 0, 6, true, false)}, 0, 0, false},
		{"an unpinned rung carried more", append([]RelayPoint{pt(150000, 149000, 0, 7, false, false)}, pinned...), 100000, 150000, true},
		{"unpinned rungs are not searched", []RelayPoint{pt(100000, 99900, 0, 7, false, false), pt(150000, 130000, 10, 7, false, false)}, 0, 0, false},
		{"search points are not rungs", append(all[:5:5], pt(125000, 125000, 0, 7, true, true)), 100000, 150000, true},
	} {
		lo, hi, ok := searchBounds(c.points)
		if lo != c.lo || hi != c.hi || ok != c.ok {
			t.Errorf("%s: bounds %v, %v, %v; want %v, %v, %v", c.name, lo, hi, ok, c.lo, c.hi, c.ok)
		}
	}
	if got := searchNext(100000, 150000); got != 125000 {
		t.Errorf("searchNext(100k, 150k) = %v", got)
	}
	if got := searchNext(125000, 150000); got != 138000 { // 137,500 to 1,000
		t.Errorf("searchNext(125k, 150k) = %v", got)
	}

	// 125,000 carried, 138,000 not: the pinned loss-free rate is 125,000's
	// delivery, the unpinned one stays the 100,000 rung's.
	r := &Report{Expected: ExpectedRows{UserspaceServers: []string{ServerUser1}, UserspacePoints: 6, UserspaceSearch: 2}}
	r.Userspace = append(append([]RelayPoint(nil), all...), pt(125000, 124800, 0.2, 5, true, true), pt(138000, 120000, 13, 9, true, true))
	if err := validateUserspace(r); len(err) != 0 {
		t.Fatalf("complete: %v", err)
	}
	s := r.UserspaceSummaries()[0]
	if s.PinnedLossFreePPS != 124800 || s.LossFreePPS != 99900 || s.ProcUsPerPkt != 8 || s.MaxPPS != 150000 || s.PinnedMaxPPS != 170000 {
		t.Errorf("summary %+v: want pinned loss-free 124,800 (the search point), unpinned 99,900, process 8 (the 20,000 rung), max 150,000, pinned max 170,000", s)
	}
	if rs := summarizeRound(r.Userspace); len(rs.loaded) != 2 || rs.loaded[125000] != 0 {
		t.Errorf("rungs to share with coturn %v, want 20,000 and 100,000 only", rs.loaded)
	}
	var b strings.Builder
	writeUserspace(&b, r)
	if !strings.Contains(b.String(), "| 125,000 (search) | yes |") {
		t.Errorf("search point not marked in\n%s", b.String())
	}
	r.Userspace = append(r.Userspace, pt(131000, 130000, 0, 5, true, true))
	if err := validateUserspace(r); len(err) != 1 {
		t.Errorf("3 search points in a round of at most 2: %v", err)
	}
}

// TestUserspaceTarget: the target is met when one configuration meets every
// part of it (CPU at both rungs, loss-free rate more than higherBy), not when
// the parts are met by different configurations.
func TestUserspaceTarget(t *testing.T) {
	sum := func(server string, proc, loaded, lossFree float64) UserspaceSummary {
		return UserspaceSummary{Server: server, Rounds: 3, ProcX: proc, LoadedX: loaded, PinnedLossFreeX: lossFree, LossFreeX: 0.5}
	}
	coturn := UserspaceSummary{Server: ServerCoturn, Rounds: 3, ProcX: 1, LoadedX: 1, PinnedLossFreeX: 1, LossFreeX: 1}
	for _, c := range []struct {
		name string
		sums []UserspaceSummary
		met  string
	}{
		{"one meets it", []UserspaceSummary{sum(ServerUser1, 1.1, 0.9, 0.5), sum(ServerUser16, 0.9, 1, 1.15), coturn}, "yes: " + ServerUser16},
		{"parts in different configurations", []UserspaceSummary{sum(ServerUser1, 0.9, 0.9, 0.5), sum(ServerUser16, 1.1, 1, 1.15), coturn}, "no"},
		{"a tie in loss-free rate", []UserspaceSummary{sum(ServerUser16, 0.9, 0.9, 1.01), coturn}, "no"},
		{"none run", []UserspaceSummary{coturn}, "n/a"},
	} {
		if got := userspaceTarget(c.sums).Met; got != c.met {
			t.Errorf("%s: met %q, want %q", c.name, got, c.met)
		}
	}
}
