package bench

import (
	"fmt"
	"math"
	"slices"
	"strings"
)

// lossFree is the loss at or below which a rung counts as loss-free.
const lossFree = 0.5 // percent: a 0.5 s smoke rung loses a few packets at its edges whatever the server

// UserspaceSummary is one server's line of the userspace comparison: the
// median over the stage's rounds of each round's figures. The servers take
// turns round by round, so that a drift of the shared machine's load falls on
// all of them; the ratios to coturn pair each round with coturn's in the same
// round.
type UserspaceSummary struct {
	Server string
	Rounds int
	// LossFreePPS is the highest delivered rate of an unpinned rung with at
	// most lossFree % loss (0: none), LossFreeLo and LossFreeHi its range over
	// the rounds. Unpinned, the generator shares the cores with the relay and
	// falls short of the higher rungs' targets: this rate is partly the
	// generator's.
	LossFreePPS, LossFreeLo, LossFreeHi float64
	// PinnedLossFreePPS is the same with the generator on CPU 0 and the relay
	// on the others, from the pinned rungs and the search between them: the
	// relay's own loss-free rate.
	PinnedLossFreePPS, PinnedLossFreeLo, PinnedLossFreeHi float64
	// UsPerPkt is the server CPU per packet at the lowest rung (process and
	// the system's softirq), ProcUsPerPkt the process's alone: the softirq
	// also holds whatever else runs on the machine.
	UsPerPkt, ProcUsPerPkt float64
	// MaxPPS and PinnedMaxPPS are the delivered rates of the max rungs.
	MaxPPS, PinnedMaxPPS float64
	// GeneratorBound: at the max rung everything offered arrived (in most
	// rounds), so the generator, not the relay, set the rate.
	GeneratorBound, PinnedGeneratorBound bool
	// Ratios to coturn in the same round (median; NaN without coturn):
	// loss-free rates, server CPU and process CPU at the lowest rung, and
	// the range of the process ratio and the pinned loss-free ratio over the
	// rounds.
	LossFreeX, PinnedLossFreeX, PinnedLossFreeXLo, PinnedLossFreeXHi float64
	UsX, ProcX, ProcXLo, ProcXHi                                     float64
	// LoadedX is the process CPU ratio at the highest rung both relays
	// carried loss-free in the round (median and range; NaN if none).
	LoadedX, LoadedXLo, LoadedXHi float64
}

// higherBy is how much higher a loss-free rate must be to count as higher:
// two servers that carried the same rung differ by a few packets of
// delivery noise, one search step apart by several per cent.
const higherBy = 1.02

// searchBounds are the rates the loss-free search narrows down from the
// fixed pinned rungs: the highest rung carried loss-free and the lowest rung
// above it that was not (ok false: nothing to search).
func searchBounds(points []RelayPoint) (lo, hi float64, ok bool) {
	for _, p := range points {
		if p.Pinned && !p.Search && p.TargetPPS > 0 && p.LossPercent <= lossFree && p.TargetPPS > lo {
			lo = p.TargetPPS
		}
	}
	if lo == 0 {
		return 0, 0, false
	}
	for _, p := range points {
		if p.Pinned && !p.Search && p.TargetPPS > lo && p.LossPercent > lossFree && (hi == 0 || p.TargetPPS < hi) {
			hi = p.TargetPPS
		}
	}
	if hi == 0 {
		return 0, 0, false
	}
	return lo, hi, true
}

// searchNext is the next rate to try between lo (carried loss-free) and hi
// (not): the middle, to 1,000 pps.
func searchNext(lo, hi float64) float64 {
	return math.Round((lo+hi)/2/1000) * 1000
}

// highestShared is the highest rate in both a and b (0: none).
func highestShared(a, b map[float64]float64) float64 {
	var top float64
	for rate := range a {
		if _, ok := b[rate]; ok && rate > top {
			top = rate
		}
	}
	return top
}

// roundSummary is one server's figures in one round.
type roundSummary struct {
	lossFree, pinnedLossFree, us, proc, max, pinnedMax float64
	bound, pinnedBound                                 bool
	// loaded is the process CPU per packet of each fixed unpinned rung
	// carried loss-free, by target rate.
	loaded map[float64]float64
}

func summarizeRound(points []RelayPoint) roundSummary {
	sum := roundSummary{us: math.NaN(), proc: math.NaN(), loaded: map[float64]float64{}}
	lowest := math.Inf(1)
	for _, p := range points {
		bound := p.LossPercent <= lossFree
		// Search points are pinned and not max rungs: they count for the
		// pinned loss-free rate only.
		if p.Pinned {
			if p.TargetPPS == 0 {
				sum.pinnedMax, sum.pinnedBound = p.DeliveredPPS, bound
			}
			if bound && p.DeliveredPPS > sum.pinnedLossFree {
				sum.pinnedLossFree = p.DeliveredPPS
			}
			continue
		}
		switch {
		case p.TargetPPS == 0:
			sum.max, sum.bound = p.DeliveredPPS, bound
		case p.TargetPPS < lowest:
			lowest, sum.us, sum.proc = p.TargetPPS, p.TotalUsPerPkt, p.ProcUsPerPkt
		}
		if bound && p.TargetPPS > 0 {
			sum.loaded[p.TargetPPS] = p.ProcUsPerPkt
		}
		if bound && p.DeliveredPPS > sum.lossFree {
			sum.lossFree = p.DeliveredPPS
		}
	}
	return sum
}

// rounds sums a server's points up round by round, keyed by round.
func (r *Report) rounds(server string) map[int]roundSummary {
	by := map[int][]RelayPoint{}
	for _, p := range r.Userspace {
		if p.Server == server {
			by[p.Round] = append(by[p.Round], p)
		}
	}
	out := map[int]roundSummary{}
	for round, points := range by {
		out[round] = summarizeRound(points)
	}
	return out
}

// UserspaceSummaries sums the userspace stage up per server, in the
// expected order.
func (r *Report) UserspaceSummaries() []UserspaceSummary {
	coturn := r.rounds(ServerCoturn)
	var out []UserspaceSummary
	for _, s := range r.Expected.UserspaceServers {
		rounds := r.rounds(s)
		var lf, plf, us, proc, mx, pmx, lfX, plfX, usX, procX, loadX []float64
		bound, pbound := 0, 0
		for round, rs := range rounds {
			lf, plf, us, proc, mx, pmx = append(lf, rs.lossFree), append(plf, rs.pinnedLossFree), append(us, rs.us), append(proc, rs.proc),
				append(mx, rs.max), append(pmx, rs.pinnedMax)
			if rs.bound {
				bound++
			}
			if rs.pinnedBound {
				pbound++
			}
			if c, ok := coturn[round]; ok {
				lfX, plfX = append(lfX, rs.lossFree/c.lossFree), append(plfX, rs.pinnedLossFree/c.pinnedLossFree)
				usX, procX = append(usX, rs.us/c.us), append(procX, rs.proc/c.proc)
				if rate := highestShared(rs.loaded, c.loaded); rate > 0 {
					loadX = append(loadX, rs.loaded[rate]/c.loaded[rate])
				}
			}
		}
		sum := UserspaceSummary{Server: s, Rounds: len(rounds),
			LossFreePPS: median(lf), LossFreeLo: lowest(lf), LossFreeHi: highest(lf),
			PinnedLossFreePPS: median(plf), PinnedLossFreeLo: lowest(plf), PinnedLossFreeHi: highest(plf),
			UsPerPkt: median(us), ProcUsPerPkt: median(proc), MaxPPS: median(mx), PinnedMaxPPS: median(pmx),
			GeneratorBound: 2*bound > len(rounds), PinnedGeneratorBound: 2*pbound > len(rounds),
			LossFreeX: median(lfX), PinnedLossFreeX: median(plfX), PinnedLossFreeXLo: lowest(plfX), PinnedLossFreeXHi: highest(plfX),
			UsX: median(usX), ProcX: median(procX), ProcXLo: lowest(procX), ProcXHi: highest(procX),
			LoadedX: median(loadX), LoadedXLo: lowest(loadX), LoadedXHi: highest(loadX)}
		out = append(out, sum)
	}
	return out
}

// median of xs (NaN when empty; the mean of the middle two when even).
func median(xs []float64) float64 {
	if len(xs) == 0 {
		return math.NaN()
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

func lowest(xs []float64) float64 {
	if len(xs) == 0 {
		return math.NaN()
	}
	return slices.Min(xs)
}

func highest(xs []float64) float64 {
	if len(xs) == 0 {
		return math.NaN()
	}
	return slices.Max(xs)
}

func validateUserspace(r *Report) []error {
	var errs []error
	n := map[string]int{}
	search := map[string]int{}
	for _, p := range r.Userspace {
		if p.Search {
			search[p.Server]++
		} else {
			n[p.Server]++
		}
		for name, v := range map[string]float64{"offered": p.OfferedPPS, "delivered": p.DeliveredPPS, "loss": p.LossPercent, "total": p.TotalUsPerPkt} {
			if math.IsNaN(v) || math.IsInf(v, 0) {
				errs = append(errs, fmt.Errorf("userspace %s %s: %s is %v", p.Server, rateLabel(p.TargetPPS), name, v))
			}
		}
	}
	for _, s := range r.Expected.UserspaceServers {
		if n[s] != r.Expected.UserspacePoints {
			errs = append(errs, fmt.Errorf("userspace %s: %d points, want %d", s, n[s], r.Expected.UserspacePoints))
		}
		if rounds := len(r.rounds(s)); search[s] > r.Expected.UserspaceSearch*rounds {
			errs = append(errs, fmt.Errorf("userspace %s: %d search points, want at most %d per round", s, search[s], r.Expected.UserspaceSearch))
		}
	}
	return errs
}

func writeUserspace(b *strings.Builder, r *Report) {
	b.WriteString("\n### Userspace relays side by side\n\n")
	fmt.Fprintf(b, "stunnerd-xdp with `--xdp-mode=off` at one read loop, at one per CPU and at the operator's 16, coturn with its default thread model, "+
		"and STUNner's current stunnerd (v1.2.1) at `-u` = CPUs and the operator's `-u 16`; 100-byte ChannelData spread by the "+
		"generator over %d allocations (one client socket each: the kernel's SO_REUSEPORT hash keeps a 4-tuple on one socket, so a "+
		"single flow never uses more than one read loop). Each round runs the ladder unpinned (generator and relay share every core), "+
		"then pinned: the generator on CPU 0, the server on the other CPUs (the client→server veth's softirq still runs where the "+
		"generator sends, the server→peer one where the server sends). Unpinned, the generator falls short of the higher rungs' "+
		"targets (see offered pps), so an unpinned loss-free rate is partly the generator's; pinned, the relay sets it. "+
		"Loss-free = the highest delivered rate of a rung with at most %.1f %% loss; the pinned loss-free rate comes from the pinned "+
		"rungs and a search between the highest carried loss-free and the next one up (%d halvings, marked \"search\", RFC 2544 style), "+
		"and counts as higher than coturn's only when it is more than %.0f %% higher (\"none\": not even the lowest pinned rung, %s/s, was carried loss-free in any round). \"generator-bound\": at the max rung everything "+
		"offered arrived, so the generator set the rate, not the relay. CPU per packet comes from the unpinned rungs: on a machine "+
		"shared with other work the system-wide softirq column holds that work's packets too, so the process column is the cleaner "+
		"comparison. The servers take turns over several rounds (each round starts with the next server), so that a drift of the "+
		"shared machine's load falls on all of them: the summary gives each figure's median over the rounds, and each ratio to coturn "+
		"is the median of the ratios to coturn in the same round.\n\n", userspaceFlowsOf(r), lossFree,
		r.Expected.UserspaceSearch, (higherBy-1)*100, f(lowestPinnedRung(r), 0))
	sums := r.UserspaceSummaries()
	st := table{head: []string{"server", "rounds", "loss-free pps, unpinned (median, range)", "× coturn",
		"loss-free pps, pinned (median, range)", "× coturn (median, range)", "server CPU µs/pkt (lowest rung)", "× coturn",
		"server process µs/pkt (lowest rung)", "× coturn (median, range)",
		"process × coturn at the highest rung both carried loss-free (median, range)", "max delivered pps", "pinned max delivered pps"}}
	bound := func(pps float64, gen bool) string {
		if gen {
			return f(pps, 0) + " (generator-bound)"
		}
		return f(pps, 0)
	}
	for _, s := range sums {
		st.add(s.Server, fmt.Sprint(s.Rounds), lossFreeCell(s.LossFreePPS, s.LossFreeLo, s.LossFreeHi),
			ratio(s.LossFreeX), lossFreeCell(s.PinnedLossFreePPS, s.PinnedLossFreeLo, s.PinnedLossFreeHi),
			fmt.Sprintf("%s (%s–%s)", ratio(s.PinnedLossFreeX), ratio(s.PinnedLossFreeXLo), ratio(s.PinnedLossFreeXHi)), f(s.UsPerPkt, 2), ratio(s.UsX), f(s.ProcUsPerPkt, 2),
			fmt.Sprintf("%s (%s–%s)", ratio(s.ProcX), ratio(s.ProcXLo), ratio(s.ProcXHi)),
			fmt.Sprintf("%s (%s–%s)", ratio(s.LoadedX), ratio(s.LoadedXLo), ratio(s.LoadedXHi)),
			bound(s.MaxPPS, s.GeneratorBound), bound(s.PinnedMaxPPS, s.PinnedGeneratorBound))
	}
	b.WriteString(st.String())
	b.WriteString("\n")
	rt := table{head: []string{"server", "round", "target pps", "pinned", "offered pps", "delivered pps", "loss %", "server process µs/pkt",
		"softirq µs/pkt (system)", "server total µs/pkt", "server rcvbuf drops"}}
	for _, p := range r.Userspace {
		pinned := "no"
		if p.Pinned {
			pinned = "yes"
		}
		target := rateLabel(p.TargetPPS)
		if p.Search {
			target += " (search)"
		}
		rt.add(p.Server, fmt.Sprint(p.Round), target, pinned, f(p.OfferedPPS, 0), f(p.DeliveredPPS, 0), f(p.LossPercent, 2),
			f(p.ProcUsPerPkt, 2), f(p.SoftUsPerPkt, 2), f(p.TotalUsPerPkt, 2), f(float64(p.ServerRcvbuf), 0))
	}
	b.WriteString(rt.String())
}

// lowestPinnedRung is the lowest fixed pinned rate of the stage (0: none).
func lowestPinnedRung(r *Report) float64 {
	var low float64
	for _, p := range r.Userspace {
		if p.Pinned && !p.Search && p.TargetPPS > 0 && (low == 0 || p.TargetPPS < low) {
			low = p.TargetPPS
		}
	}
	return low
}

// lossFreeCell is a loss-free rate's median and range, or "none" when no
// rung of any round was carried loss-free.
func lossFreeCell(med, lo, hi float64) string {
	if hi == 0 {
		return "none"
	}
	return fmt.Sprintf("%s (%s–%s)", f(med, 0), f(lo, 0), f(hi, 0))
}

// ratio is a ratio to coturn with two decimals ("–" when there is none,
// "∞" when coturn's figure was 0: it carried no rung loss-free).
func ratio(x float64) string {
	switch {
	case math.IsInf(x, 1):
		return "∞"
	case math.IsNaN(x) || math.IsInf(x, 0):
		return "–"
	}
	return f(x, 2)
}

func userspaceFlowsOf(r *Report) int {
	for _, p := range r.Userspace {
		return p.Flows
	}
	return 0
}
