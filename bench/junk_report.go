package bench

import (
	"fmt"
	"math"
	"strings"
)

// JunkRow is one rung of the junk stage: a server under junk at one rate
// while a real session echoes and new clients allocate.
type JunkRow struct {
	Server string `json:"server"`
	Round  int    `json:"round"`
	// TargetPPS is the junk offered: -1 none, 0 as fast as the generator
	// goes (one thread), else packets/s.
	TargetPPS float64 `json:"target_pps"`
	Seconds   float64 `json:"seconds"`
	JunkSent  uint64  `json:"junk_sent"`
	JunkPPS   float64 `json:"junk_pps"`
	// The real session's echoes through the relay, of EchoesSent.
	EchoesSent int `json:"echoes_sent"`
	Echoes     int `json:"echoes"`
	// New clients' Allocates answered with a relay, of AllocatesTried.
	AllocatesTried int `json:"allocates_tried"`
	Allocates      int `json:"allocates"`
	// ServerCores is the server process's CPU (utime+stime) over the rung,
	// in cores.
	ServerCores float64 `json:"server_cores"`
	// What stunnerd-xdp's shield dropped (Counted): in the kernel (XDP and
	// TC verdicts) and in the read loops.
	Counted       bool   `json:"counted"`
	KernelDropped uint64 `json:"kernel_dropped"`
	UserDropped   uint64 `json:"userspace_dropped"`
}

func junkLabel(pps float64) string {
	if pps < 0 {
		return "none"
	}
	return rateLabel(pps)
}

// validateJunk reports missing junk rows and rows without numbers.
func (r *Report) validateJunk() []error {
	var errs []error
	if len(r.Junk) != r.Expected.JunkRows {
		errs = append(errs, fmt.Errorf("junk: %d rows, want %d", len(r.Junk), r.Expected.JunkRows))
	}
	for _, j := range r.Junk {
		if j.EchoesSent == 0 || j.AllocatesTried == 0 || math.IsNaN(j.ServerCores) || j.TargetPPS >= 0 && j.JunkSent == 0 {
			errs = append(errs, fmt.Errorf("junk %s at %s: no numbers: %+v", j.Server, junkLabel(j.TargetPPS), j))
		}
	}
	return errs
}

// writeJunk writes the junk stage's table.
func writeJunk(b *strings.Builder, r *Report) {
	if len(r.Junk) == 0 {
		return
	}
	b.WriteString("\n## The listener under junk\n\n")
	t := table{head: []string{"server", "round", "junk offered pps", "junk sent pps", "echoes", "allocates", "server cores", "shield drops: kernel", "userspace"}}
	for _, j := range r.Junk {
		k, u := "-", "-"
		if j.Counted {
			k, u = f(float64(j.KernelDropped), 0), f(float64(j.UserDropped), 0)
		}
		t.add(j.Server, f(float64(j.Round), 0), junkLabel(j.TargetPPS), f(j.JunkPPS, 0),
			fmt.Sprintf("%d / %d", j.Echoes, j.EchoesSent), fmt.Sprintf("%d / %d", j.Allocates, j.AllocatesTried),
			f(j.ServerCores, 2), k, u)
	}
	b.WriteString(t.String())
	fmt.Fprintf(b, "\n%d source sockets on %d addresses of the client's network send, in turn, ChannelData on a channel nobody bound, "+
		"an unauthenticated Allocate and 100 random bytes to the listener, one generator thread. A real session, allocated before the junk starts, "+
		"echoes through the relay (the echoes column); %d new clients allocate from the client's own address during the junk. "+
		"Each server starts fresh for every rung; stunnerd-xdp runs with its default flags (the listener shield on, "+
		"--admission-rate 100/s per source address).\n", junkSockets, junkSources, junkAllocates)
}

// junkTarget is issue 39's acceptance at the highest rung: with XDP, every
// Allocate answered and ≥ 99 % of the echoes; with --xdp-mode=off ≥ 90 %.
func (r *Report) junkTarget() (TargetResult, bool) {
	worst := map[string]JunkRow{}
	for _, j := range r.Junk {
		if j.TargetPPS != 0 {
			continue
		}
		w, ok := worst[j.Server]
		if !ok || j.Echoes*w.EchoesSent < w.Echoes*j.EchoesSent || j.Allocates < w.Allocates {
			worst[j.Server] = j
		}
	}
	x, okX := worst[ServerXDPNative]
	o, okO := worst[ServerXDPOff]
	if !okX || !okO {
		return TargetResult{}, false
	}
	share := func(j JunkRow) float64 { return float64(j.Echoes) / float64(j.EchoesSent) }
	met := "no"
	if x.Allocates == x.AllocatesTried && share(x) >= 0.99 && share(o) >= 0.90 {
		met = "yes"
	}
	return TargetResult{Target: "under the junk mix at the generator's highest rate: with XDP every Allocate answered and ≥ 99 % of the session's echoes; with --xdp-mode=off ≥ 90 % (worst round)",
		Measured: fmt.Sprintf("XDP: %d/%d Allocates, %s %% echoes at %s junk pps; off: %d/%d Allocates, %s %% echoes at %s junk pps",
			x.Allocates, x.AllocatesTried, f(100*share(x), 1), f(x.JunkPPS, 0), o.Allocates, o.AllocatesTried, f(100*share(o), 1), f(o.JunkPPS, 0)),
		Met: met}, true
}
