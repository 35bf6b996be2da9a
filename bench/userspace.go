package bench

import (
	"fmt"
	"math"
	"strings"
)

// lossFree is the loss at or below which a rung counts as loss-free.
const lossFree = 0.5 // percent: a 0.5 s smoke rung loses a few packets at its edges whatever the server

// UserspaceSummary is one server's line of the userspace comparison.
type UserspaceSummary struct {
	Server string
	// LossFreePPS is the highest delivered rate of an unpinned rung with at
	// most lossFree % loss (0: none).
	LossFreePPS float64
	// UsPerPkt is the server CPU per packet at the lowest rung (process and
	// the system's softirq), ProcUsPerPkt the process's alone: the softirq
	// also holds whatever else runs on the machine.
	UsPerPkt, ProcUsPerPkt float64
	// MaxPPS and PinnedMaxPPS are the delivered rates of the max rungs.
	MaxPPS, PinnedMaxPPS float64
	// GeneratorBound: at the max rung everything offered arrived, so the
	// generator, not the relay, set the rate.
	GeneratorBound, PinnedGeneratorBound bool
}

// UserspaceSummaries sums the userspace stage up per server, in the
// expected order.
func (r *Report) UserspaceSummaries() []UserspaceSummary {
	var out []UserspaceSummary
	for _, s := range r.Expected.UserspaceServers {
		sum := UserspaceSummary{Server: s, UsPerPkt: math.NaN(), ProcUsPerPkt: math.NaN()}
		lowest := math.Inf(1)
		for _, p := range r.Userspace {
			if p.Server != s {
				continue
			}
			bound := p.LossPercent <= lossFree
			switch {
			case p.Pinned:
				sum.PinnedMaxPPS, sum.PinnedGeneratorBound = p.DeliveredPPS, bound
				continue
			case p.TargetPPS == 0:
				sum.MaxPPS, sum.GeneratorBound = p.DeliveredPPS, bound
			case p.TargetPPS < lowest:
				lowest, sum.UsPerPkt, sum.ProcUsPerPkt = p.TargetPPS, p.TotalUsPerPkt, p.ProcUsPerPkt
			}
			if bound && p.DeliveredPPS > sum.LossFreePPS {
				sum.LossFreePPS = p.DeliveredPPS
			}
		}
		out = append(out, sum)
	}
	return out
}

func validateUserspace(r *Report) []error {
	var errs []error
	n := map[string]int{}
	for _, p := range r.Userspace {
		n[p.Server]++
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
	}
	return errs
}

func writeUserspace(b *strings.Builder, r *Report) {
	b.WriteString("\n### Userspace relays side by side\n\n")
	fmt.Fprintf(b, "stunnerd-xdp with `--xdp-mode=off` at one read loop and at one per CPU, coturn with its default thread model, "+
		"and STUNner's current stunnerd (v1.2.1) at `-u` = CPUs and the operator's `-u 16`; 100-byte ChannelData spread by the "+
		"generator over %d allocations (one client socket each: the kernel's SO_REUSEPORT hash keeps a 4-tuple on one socket, so a "+
		"single flow never uses more than one read loop). Loss-free = the highest delivered rate of a rung with at most %.1f %% loss. "+
		"The pinned max rung runs the generator on CPU 0 and the server on the other CPUs (the client→server veth's softirq still runs "+
		"where the generator sends); unpinned, they share every core. \"generator-bound\": at the max rung everything offered arrived, "+
		"so the generator set the rate, not the relay. On a machine shared with other work, pinning the relay to fewer CPUs makes it "+
		"compete there with everything else, and the system-wide softirq column holds that work's packets too: the process column "+
		"is the cleaner comparison.\n\n", userspaceFlowsOf(r), lossFree)
	sums := r.UserspaceSummaries()
	var coturn *UserspaceSummary
	for i := range sums {
		if sums[i].Server == ServerCoturn {
			coturn = &sums[i]
		}
	}
	ratio := func(a, b float64) string {
		if coturn == nil || !(b > 0) {
			return "–"
		}
		return f(a/b, 2)
	}
	st := table{head: []string{"server", "loss-free pps", "× coturn", "server CPU µs/pkt (lowest rung)", "× coturn",
		"server process µs/pkt (lowest rung)", "× coturn", "max delivered pps", "pinned max delivered pps"}}
	bound := func(pps float64, gen bool) string {
		if gen {
			return f(pps, 0) + " (generator-bound)"
		}
		return f(pps, 0)
	}
	for _, s := range sums {
		var cl, cu, cp float64
		if coturn != nil {
			cl, cu, cp = coturn.LossFreePPS, coturn.UsPerPkt, coturn.ProcUsPerPkt
		}
		st.add(s.Server, f(s.LossFreePPS, 0), ratio(s.LossFreePPS, cl), f(s.UsPerPkt, 2), ratio(s.UsPerPkt, cu),
			f(s.ProcUsPerPkt, 2), ratio(s.ProcUsPerPkt, cp),
			bound(s.MaxPPS, s.GeneratorBound), bound(s.PinnedMaxPPS, s.PinnedGeneratorBound))
	}
	b.WriteString(st.String())
	b.WriteString("\n")
	rt := table{head: []string{"server", "target pps", "pinned", "offered pps", "delivered pps", "loss %", "server process µs/pkt",
		"softirq µs/pkt (system)", "server total µs/pkt", "server rcvbuf drops"}}
	for _, p := range r.Userspace {
		pinned := "no"
		if p.Pinned {
			pinned = "yes"
		}
		rt.add(p.Server, rateLabel(p.TargetPPS), pinned, f(p.OfferedPPS, 0), f(p.DeliveredPPS, 0), f(p.LossPercent, 2),
			f(p.ProcUsPerPkt, 2), f(p.SoftUsPerPkt, 2), f(p.TotalUsPerPkt, 2), f(float64(p.ServerRcvbuf), 0))
	}
	b.WriteString(rt.String())
}

func userspaceFlowsOf(r *Report) int {
	for _, p := range r.Userspace {
		return p.Flows
	}
	return 0
}
