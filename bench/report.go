// Package bench benchmarks stunnerd-xdp side by side with its own userspace
// path, STUNner's stunnerd and coturn, in network namespaces on one machine.
// The measurements are privileged tests (bench_test.go, run by `make bench` and
// `make bench-smoke`); this file holds what they produce: the report, as JSON,
// Markdown and gnuplot PNGs, and the check that a report is complete.
package bench

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"time"
)

// Report is everything one run measured. Every figure in it comes from this run.
type Report struct {
	Meta     Meta          `json:"meta"`
	ProgRun  []ProgRunRow  `json:"prog_run"`
	LiveCost []LiveCostRow `json:"live_cost"`
	Memory   []MemoryRow   `json:"map_memory"`
	MapOps   []MapOpsRow   `json:"map_ops"`
	Relay    []RelayPoint  `json:"relay"`
	// Userspace compares the userspace relays over several allocations.
	Userspace []RelayPoint   `json:"userspace"`
	Latency   []LatencyRow   `json:"latency"`
	Iperf     []IperfRow     `json:"iperf"`
	Control   *ControlResult `json:"control,omitempty"`
	Scaling   []ScalingPoint `json:"scaling"`
	// Shapes are the node shapes of issue 23 in both modes.
	Shapes []ShapeRow `json:"shapes"`
	// Sessions are issue 27's many sessions with a WebRTC-like mix.
	Sessions []SessionRow `json:"sessions"`
	// Junk is issue 39's listener under junk.
	Junk     []JunkRow       `json:"junk"`
	Targets  []TargetResult  `json:"targets"`
	Expected ExpectedRows    `json:"expected"`
	Notes    []string        `json:"notes,omitempty"`
	Stages   []StageDuration `json:"stages"`
}

// Meta describes the machine, the software and how the run was made.
type Meta struct {
	Mode      string    `json:"mode"` // full or smoke
	Started   time.Time `json:"started"`
	Duration  string    `json:"duration"`
	Kernel    string    `json:"kernel"`
	CPU       string    `json:"cpu"`
	CPUs      int       `json:"cpus"`
	MemTotal  string    `json:"mem_total"`
	Go        string    `json:"go"`
	Versions  []string  `json:"versions"`
	Commands  []string  `json:"commands"`
	ClockTick int       `json:"clock_tick_hz"`
	// LoadAvg is /proc/loadavg at the start and the end: other work on the
	// machine shares the cores with the benchmark.
	LoadAvg []string `json:"loadavg"`
	Daemon  string   `json:"daemon"`
}

// StageDuration is how long one stage of the run took.
type StageDuration struct {
	Stage   string  `json:"stage"`
	Seconds float64 `json:"seconds"`
}

// ProgRunRow is the per-packet cost of one program on one frame through BPF_PROG_RUN.
type ProgRunRow struct {
	Name     string  `json:"name"`
	Frame    string  `json:"frame"`
	Verdict  string  `json:"verdict"`
	Runs     int     `json:"runs"`
	MeanNs   float64 `json:"mean_ns"`
	MedianNs float64 `json:"median_ns"`
	P99Ns    float64 `json:"p99_ns"`
	AboveNs  float64 `json:"above_floor_ns"` // median minus the XDP_TX floor's median
	FloorX   float64 `json:"x_floor"`        // median / floor median
	// Cross-check: wall time per syscall measured in Go, and its excess over
	// the floor's: it includes copying the frame in and out.
	WallNs      float64 `json:"wall_ns_per_syscall"`
	WallAboveNs float64 `json:"wall_above_floor_ns"`
	Method      string  `json:"method"`         // how it was measured
	Valid       bool    `json:"valid"`          // false: shown only to illustrate a pitfall
	WrongRets   int     `json:"wrong_verdicts"` // runs that returned another verdict (must be 0)
}

// LiveCostRow is the attached relay program's cost per run on live traffic of
// one kind, from the kernel's BPF run-time statistics, beside the trivial
// XDP_PASS program that the relayed frames meet on the receiving veth in the
// same intervals.
type LiveCostRow struct {
	Name    string  `json:"name"`
	Reason  string  `json:"reason"` // the verdict reason every run of the row ends in
	RatePPS float64 `json:"rate_pps"`
	Seconds float64 `json:"seconds_per_interval"`
	Sent    uint64  `json:"sent"`
	Runs    uint64  `json:"relay_runs"`
	Counted uint64  `json:"counted"` // runs that ended in Reason
	// Per interval: relay program ns/run and trivial program ns/run.
	RelayNs       []float64 `json:"relay_ns"`
	FloorNs       []float64 `json:"trivial_ns,omitempty"`
	RelayMedianNs float64   `json:"relay_median_ns"`
	FloorMedianNs float64   `json:"trivial_median_ns"`
	Ratio         float64   `json:"x_trivial"` // median of the per-interval ratios; 0 for rows that relay nothing
}

// MemoryRow is the kernel memory of the relay program's maps for one size.
type MemoryRow struct {
	Bindings uint32 `json:"bindings"`
	CPUs     int    `json:"cpus"`
	// Bytes per map as the kernel reports it (bpf_map_memory_usage via fdinfo
	// memlock), for maps created with these sizes on this machine, or computed
	// from the entry sizes for CPU counts the machine does not have.
	Maps     map[string]uint64 `json:"bytes_per_map"`
	Total    uint64            `json:"total_bytes"`
	Measured bool              `json:"measured"` // false: computed
}

// MapOpsRow is the latency of one kind of binding write (internal/channelmap,
// both directions and the state slot) while the maps fill to or empty from N.
type MapOpsRow struct {
	Op        string  `json:"op"`
	Bindings  int     `json:"bindings"`
	PerSecond float64 `json:"per_second"`
	P50Us     float64 `json:"p50_us"`
	P99Us     float64 `json:"p99_us"`
	MaxUs     float64 `json:"max_us"`
}

// RelayPoint is one rung of the offered-load ladder for one server.
type RelayPoint struct {
	Server        string  `json:"server"`
	Payload       int     `json:"payload_bytes"`
	TargetPPS     float64 `json:"target_pps"` // 0: as fast as the generator goes
	Workers       int     `json:"generator_threads"`
	Seconds       float64 `json:"seconds"`
	Sent          uint64  `json:"sent"`
	Delivered     uint64  `json:"delivered"`
	OfferedPPS    float64 `json:"offered_pps"`
	DeliveredPPS  float64 `json:"delivered_pps"`
	LossPercent   float64 `json:"loss_percent"`
	ProcUsPerPkt  float64 `json:"server_process_us_per_pkt"`
	SoftUsPerPkt  float64 `json:"softirq_us_per_pkt"`      // system-wide, all CPUs
	TotalUsPerPkt float64 `json:"server_total_us_per_pkt"` // process + softirq
	BusyUsPerPkt  float64 `json:"system_busy_us_per_pkt"`  // every non-idle tick, both cores
	XDPShare      float64 `json:"xdp_share"`               // of client->peer packets, stunnerd-xdp only; -1: n/a
	// ProgNsPerRun is the attached relay program's cost per run during the
	// rung, from the kernel's BPF run-time statistics (stunnerd-xdp with XDP
	// only; 0: n/a). Every frame on the attached interfaces is a run.
	ProgNsPerRun float64 `json:"xdp_prog_ns_per_run"`
	ServerRcvbuf int64   `json:"server_rcvbuf_errors"`   // Udp.RcvbufErrors in the server namespace
	SendErrors   uint64  `json:"generator_send_retries"` // EAGAIN retries of the generator
	// Flows is the number of allocations the load is spread over (0: one).
	Flows int `json:"flows,omitempty"`
	// Pinned: the generator ran on CPU 0 and the server on the others.
	Pinned bool `json:"pinned,omitempty"`
	// Round is the userspace stage's round the point was taken in (from 1;
	// 0: other stages).
	Round int `json:"round,omitempty"`
	// Search: a rate the userspace stage's loss-free search chose between
	// two of the ladder's rungs, not a rung of the ladder.
	Search bool `json:"search,omitempty"`
}

// LatencyRow is the round-trip time of timestamped datagrams echoed by the peer.
type LatencyRow struct {
	Server   string  `json:"server"`
	RatePPS  float64 `json:"rate_pps"`
	Payload  int     `json:"payload_bytes"`
	Sent     int     `json:"sent"`
	Received int     `json:"received"`
	P50Us    float64 `json:"p50_us"`
	P99Us    float64 `json:"p99_us"`
	P999Us   float64 `json:"p999_us"`
	// Added is the percentile minus the same percentile of the direct path
	// (kernel forwarding without TURN); zero for the direct path itself.
	AddedP50Us  float64 `json:"added_p50_us"`
	AddedP99Us  float64 `json:"added_p99_us"`
	AddedP999Us float64 `json:"added_p999_us"`
}

// IperfRow is the user's own benchmark: iperf2 through turncat.
type IperfRow struct {
	Server        string  `json:"server"`
	RatePPS       int     `json:"rate_pps"`
	Payload       int     `json:"payload_bytes"`
	Seconds       int     `json:"seconds"`
	Sent          int64   `json:"sent"`
	Received      int64   `json:"received"`
	LossPercent   float64 `json:"loss_percent"`
	TotalUsPerPkt float64 `json:"server_total_us_per_pkt"`
	ProcUsPerPkt  float64 `json:"server_process_us_per_pkt"`
	TurncatUs     float64 `json:"turncat_us_per_pkt"`
}

// ControlResult is the control plane: how fast bindings reach the maps and what they cost.
type ControlResult struct {
	Bindings          int     `json:"bindings"`
	Allocations       int     `json:"allocations"`
	Events            int     `json:"events"`
	Seconds           float64 `json:"seconds"`
	BindingsPerSecond float64 `json:"bindings_per_second"`
	Installed         int     `json:"installed"`
	MaxEntries        int     `json:"max_entries"`
	PossibleCPUs      int     `json:"possible_cpus"`
	// Map memory: memlock of each map from /proc/self/fdinfo, and per binding slot.
	MapMemlock      map[string]int64 `json:"map_memlock_bytes"`
	MapBytesPerSlot float64          `json:"map_bytes_per_slot"`
	// Key+value sizes × max entries (counters × possible CPUs), for comparison.
	MapBytesPerSlotComputed float64 `json:"map_bytes_per_slot_computed"`
	HeapBytesPerBinding     float64 `json:"go_heap_bytes_per_binding"`
	RemoveSeconds           float64 `json:"remove_seconds"`
}

// ScalingPoint is the XDP path with many channels bound at once.
type ScalingPoint struct {
	Channels      int     `json:"channels"`
	Allocations   int     `json:"allocations"`
	TargetPPS     float64 `json:"target_pps"`
	Seconds       float64 `json:"seconds"`
	Sent          uint64  `json:"sent"`
	Delivered     uint64  `json:"delivered"`
	OfferedPPS    float64 `json:"offered_pps"`
	DeliveredPPS  float64 `json:"delivered_pps"`
	LossPercent   float64 `json:"loss_percent"`
	SoftUsPerPkt  float64 `json:"softirq_us_per_pkt"`
	BusyUsPerPkt  float64 `json:"system_busy_us_per_pkt"`
	XDPRelayed    uint64  `json:"xdp_relayed"`
	ChannelsHit   int     `json:"channels_with_traffic"`
	InstallSecond float64 `json:"install_seconds"`
}

// TargetResult is one of the targets, reported (not asserted).
type TargetResult struct {
	Target   string `json:"target"`
	Measured string `json:"measured"`
	Met      string `json:"met"` // yes, no, or n/a
}

// ExpectedRows is what a complete report holds; Validate checks against it.
type ExpectedRows struct {
	ProgRun        []string `json:"prog_run"`
	LiveCost       []string `json:"live_cost"`
	Memory         bool     `json:"map_memory"` // the memory table and the binding-write rows
	RelayServers   []string `json:"relay_servers"`
	RelayPoints    int      `json:"relay_points_per_server"`
	LatencyServers []string `json:"latency_servers"`
	IperfServers   []string `json:"iperf_servers"`
	ScalingPoints  int      `json:"scaling_points"`
	// UserspaceServers each have UserspacePoints rows in Userspace, and at
	// most UserspaceSearch more per round from the loss-free search.
	UserspaceServers []string `json:"userspace_servers"`
	UserspacePoints  int      `json:"userspace_points_per_server"`
	UserspaceSearch  int      `json:"userspace_search_steps"`
	ShapeRows        int      `json:"shape_rows"` // node shapes times two modes
	SessionRows      int      `json:"session_rows"`
	JunkRows         int      `json:"junk_rows"`
}

// Validate reports every missing row and every figure that is not a finite
// number. It checks structure only, never performance.
func (r *Report) Validate() error {
	var errs []error
	bad := func(f float64) bool { return math.IsNaN(f) || math.IsInf(f, 0) }
	seen := map[string]bool{}
	for _, p := range r.ProgRun {
		seen[p.Name] = true
		if p.Runs == 0 || bad(p.MeanNs) || bad(p.MedianNs) || p.MedianNs <= 0 || bad(p.FloorX) {
			errs = append(errs, fmt.Errorf("prog_run %q: no numbers: %+v", p.Name, p))
		}
		if p.Valid && p.WrongRets != 0 {
			errs = append(errs, fmt.Errorf("prog_run %q: %d runs returned another verdict than %s", p.Name, p.WrongRets, p.Verdict))
		}
	}
	for _, n := range r.Expected.ProgRun {
		if !seen[n] {
			errs = append(errs, fmt.Errorf("prog_run: row %q missing", n))
		}
	}
	seen = map[string]bool{}
	for _, l := range r.LiveCost {
		seen[l.Name] = true
		if l.Runs == 0 || bad(l.RelayMedianNs) || l.RelayMedianNs <= 0 || bad(l.Ratio) || (len(l.FloorNs) > 0 && !(l.Ratio > 0)) {
			errs = append(errs, fmt.Errorf("live_cost %q: no numbers: %+v", l.Name, l))
		}
	}
	for _, n := range r.Expected.LiveCost {
		if !seen[n] {
			errs = append(errs, fmt.Errorf("live_cost: row %q missing", n))
		}
	}
	if r.Expected.Memory {
		if len(r.Memory) == 0 {
			errs = append(errs, errors.New("map_memory: missing"))
		}
		if len(r.MapOps) == 0 {
			errs = append(errs, errors.New("map_ops: missing"))
		}
	}
	for _, o := range r.MapOps {
		if !(o.PerSecond > 0) || bad(o.P99Us) {
			errs = append(errs, fmt.Errorf("map_ops %q: no numbers: %+v", o.Op, o))
		}
	}
	perServer := map[string]int{}
	for _, p := range r.Relay {
		perServer[p.Server]++
		for name, f := range map[string]float64{"offered": p.OfferedPPS, "delivered": p.DeliveredPPS, "loss": p.LossPercent,
			"process": p.ProcUsPerPkt, "softirq": p.SoftUsPerPkt, "total": p.TotalUsPerPkt, "busy": p.BusyUsPerPkt} {
			if bad(f) {
				errs = append(errs, fmt.Errorf("relay %s %d B %.0f pps: %s is %v", p.Server, p.Payload, p.TargetPPS, name, f))
			}
		}
		if p.Sent == 0 {
			errs = append(errs, fmt.Errorf("relay %s %d B %.0f pps: nothing sent", p.Server, p.Payload, p.TargetPPS))
		}
		if (p.Server == ServerXDPNative || p.Server == ServerXDPGeneric) && !(p.ProgNsPerRun > 0) {
			errs = append(errs, fmt.Errorf("relay %s %d B %.0f pps: no live program cost", p.Server, p.Payload, p.TargetPPS))
		}
	}
	for _, s := range r.Expected.RelayServers {
		if perServer[s] != r.Expected.RelayPoints {
			errs = append(errs, fmt.Errorf("relay %s: %d points, want %d", s, perServer[s], r.Expected.RelayPoints))
		}
	}
	errs = append(errs, validateUserspace(r)...)
	seen = map[string]bool{}
	for _, l := range r.Latency {
		seen[l.Server] = true
		if l.Received == 0 || bad(l.P50Us) || bad(l.P99Us) || bad(l.P999Us) || bad(l.AddedP99Us) {
			errs = append(errs, fmt.Errorf("latency %s: no numbers: %+v", l.Server, l))
		}
	}
	for _, s := range r.Expected.LatencyServers {
		if !seen[s] {
			errs = append(errs, fmt.Errorf("latency: row %q missing", s))
		}
	}
	seen = map[string]bool{}
	for _, i := range r.Iperf {
		seen[i.Server] = true
		if i.Sent == 0 || bad(i.LossPercent) || bad(i.TotalUsPerPkt) {
			errs = append(errs, fmt.Errorf("iperf %s: no numbers: %+v", i.Server, i))
		}
	}
	for _, s := range r.Expected.IperfServers {
		if !seen[s] {
			errs = append(errs, fmt.Errorf("iperf: row %q missing", s))
		}
	}
	errs = append(errs, r.validateShapes()...)
	errs = append(errs, r.validateSessions()...)
	errs = append(errs, r.validateJunk()...)
	if c := r.Control; c == nil {
		errs = append(errs, errors.New("control: missing"))
	} else if c.Installed != c.Bindings || c.BindingsPerSecond <= 0 || bad(c.HeapBytesPerBinding) || c.MapBytesPerSlot <= 0 {
		errs = append(errs, fmt.Errorf("control: incomplete: %+v", *c))
	}
	if len(r.Scaling) != r.Expected.ScalingPoints {
		errs = append(errs, fmt.Errorf("scaling: %d points, want %d", len(r.Scaling), r.Expected.ScalingPoints))
	}
	for _, s := range r.Scaling {
		// Traffic spreads over the channels: at least half of those the relayed
		// packets could reach carry some (under overload datagrams drop at random
		// before XDP, so fewer distinct channels are hit than packets relayed).
		if s.Sent == 0 || bad(s.DeliveredPPS) || bad(s.SoftUsPerPkt) || uint64(s.ChannelsHit)*2 < min(uint64(s.Channels), s.XDPRelayed) {
			errs = append(errs, fmt.Errorf("scaling %d channels: incomplete: %+v", s.Channels, s))
		}
	}
	if len(r.Targets) == 0 {
		errs = append(errs, errors.New("targets: missing"))
	}
	return errors.Join(errs...)
}

// WriteJSON writes report.json into dir.
func (r *Report) WriteJSON(dir string) error {
	b, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, "report.json"), append(b, '\n'), 0o644)
}

// table is a Markdown table under construction.
type table struct {
	head []string
	rows [][]string
}

func (t *table) add(cells ...string) { t.rows = append(t.rows, cells) }

func (t *table) String() string {
	var b strings.Builder
	b.WriteString("| " + strings.Join(t.head, " | ") + " |\n")
	b.WriteString("|" + strings.Repeat("---|", len(t.head)) + "\n")
	for _, r := range t.rows {
		b.WriteString("| " + strings.Join(r, " | ") + " |\n")
	}
	return b.String()
}

// f formats a figure with the given decimals and thousands separators.
func f(v float64, decimals int) string {
	if math.IsNaN(v) || math.IsInf(v, 0) {
		return "–"
	}
	s := fmt.Sprintf("%.*f", decimals, v)
	neg := strings.HasPrefix(s, "-")
	s = strings.TrimPrefix(s, "-")
	intPart, frac, _ := strings.Cut(s, ".")
	var out []byte
	for i := range intPart {
		if i > 0 && (len(intPart)-i)%3 == 0 {
			out = append(out, ',')
		}
		out = append(out, intPart[i])
	}
	s = string(out)
	if frac != "" {
		s += "." + frac
	}
	if neg {
		s = "-" + s
	}
	return s
}

func rateLabel(pps float64) string {
	if pps == 0 {
		return "max"
	}
	return f(pps, 0)
}

// Summary is one row per server of the headline table.
type Summary struct {
	Server       string
	MaxDelivered float64 // 100 B, any rung
	CPULow       float64 // server total µs/pkt at the low reference rate, 100 B
	CPUHigh      float64 // at the high reference rate, 100 B
	AboveLow     float64 // CPULow minus the delivery floor's at the same rate
	AboveRatio   float64 // AboveLow / XDP native's AboveLow
	RatioLow     float64 // CPULow / XDP native's CPULow
	P50, P99     float64
	AddedP99     float64
	IperfLoss    float64
	IperfCPU     float64
}

// Summaries builds the headline table for the reference rates lo and hi (pps, 100 B).
func (r *Report) Summaries(lo, hi float64) []Summary {
	var out []Summary
	servers := r.Expected.RelayServers
	for _, s := range servers {
		sum := Summary{Server: s, CPULow: math.NaN(), CPUHigh: math.NaN(), RatioLow: math.NaN(), AboveLow: math.NaN(), AboveRatio: math.NaN(), P50: math.NaN(), P99: math.NaN(),
			AddedP99: math.NaN(), IperfLoss: math.NaN(), IperfCPU: math.NaN()}
		for _, p := range r.Relay {
			if p.Server != s || p.Payload != 100 {
				continue
			}
			sum.MaxDelivered = math.Max(sum.MaxDelivered, p.DeliveredPPS)
			if p.TargetPPS == lo {
				sum.CPULow = p.TotalUsPerPkt
			}
			if p.TargetPPS == hi {
				sum.CPUHigh = p.TotalUsPerPkt
			}
		}
		for _, l := range r.Latency {
			if l.Server == s {
				sum.P50, sum.P99, sum.AddedP99 = l.P50Us, l.P99Us, l.AddedP99Us
			}
		}
		for _, i := range r.Iperf {
			if i.Server == s {
				sum.IperfLoss, sum.IperfCPU = i.LossPercent, i.TotalUsPerPkt
			}
		}
		sum.AboveLow = sum.CPULow - r.CPUAt(ServerDeliveryFloor, 100, lo)
		out = append(out, sum)
	}
	var base, baseAbove float64
	for _, s := range out {
		if s.Server == ServerXDPNative {
			base, baseAbove = s.CPULow, s.AboveLow
		}
	}
	for i := range out {
		out[i].RatioLow = out[i].CPULow / base
		out[i].AboveRatio = out[i].AboveLow / baseAbove
	}
	return out
}

// CPUAt is a server's total CPU per packet at one rung; NaN if not measured.
func (r *Report) CPUAt(server string, payload int, rate float64) float64 {
	for _, p := range r.Relay {
		if p.Server == server && p.Payload == payload && p.TargetPPS == rate {
			return p.TotalUsPerPkt
		}
	}
	return math.NaN()
}

// SummaryTable renders the headline table.
func (r *Report) SummaryTable(lo, hi float64) string {
	t := table{head: []string{"server", "max delivered pps (100 B)",
		fmt.Sprintf("server CPU µs/pkt @ %s pps", f(lo, 0)), fmt.Sprintf("× XDP native @ %s", f(lo, 0)),
		fmt.Sprintf("above delivery floor µs/pkt @ %s", f(lo, 0)), "× XDP native (above floor)",
		fmt.Sprintf("server CPU µs/pkt @ %s pps", f(hi, 0)),
		"RTT p50 / p99 µs", "added p99 µs", "iperf+turncat loss %", "iperf server µs/pkt"}}
	for _, s := range r.Summaries(lo, hi) {
		t.add(s.Server, f(s.MaxDelivered, 0), f(s.CPULow, 2), f(s.RatioLow, 1), f(s.AboveLow, 2), f(s.AboveRatio, 1), f(s.CPUHigh, 2),
			f(s.P50, 0)+" / "+f(s.P99, 0), f(s.AddedP99, 0), f(s.IperfLoss, 3), f(s.IperfCPU, 2))
	}
	return t.String()
}

// WriteMarkdown writes report.md into dir.
func (r *Report) WriteMarkdown(dir string, lo, hi float64, plots []string) error {
	var b strings.Builder
	m := r.Meta
	fmt.Fprintf(&b, "# stunnerd-xdp benchmark (%s run)\n\n", m.Mode)
	fmt.Fprintf(&b, "Run %s, %s. Machine: %s, %d CPUs, %s RAM, kernel %s, %s. Clock tick %d Hz.\n\n",
		m.Started.UTC().Format("2006-01-02 15:04 MST"), m.Duration, m.CPU, m.CPUs, m.MemTotal, m.Kernel, m.Go, m.ClockTick)
	b.WriteString("Software: " + strings.Join(m.Versions, "; ") + ".\n\n")
	fmt.Fprintf(&b, "Daemon binary: %s. /proc/loadavg at start and end: %s — anything above the benchmark's own load is other work sharing these cores.\n\n",
		m.Daemon, strings.Join(m.LoadAvg, " → "))
	b.WriteString("Every number below was measured by `bench/` in this one run; ratios compare rows of this run only. ")
	b.WriteString("All traffic stays inside three network namespaces joined by veth pairs " +
		"(client 10.100.0.2 — 10.100.0.1 server 10.200.0.1 — 10.200.0.2 peer, `test/netns.NewRouted`), and every process — " +
		"load generator, relay, peer sink, softirq — shares the same cores: these are rig numbers.\n\n")

	b.WriteString("## Summary\n\n")
	b.WriteString(r.SummaryTable(lo, hi))
	b.WriteString("\nServer CPU = the server process's utime+stime (/proc/PID/stat) plus softirq time of all CPUs (/proc/stat), per packet delivered to the peer. ")
	b.WriteString("XDP runs in softirq, so for the XDP rows nearly all of it is softirq, and softirq also contains the peer's UDP receive " +
		"and the veth hops, for every server alike (the `kernel forwarding` row is that floor without any relay). RTT: timestamped " +
		"datagrams echoed by the peer through the relay; added = RTT minus the same percentile of the direct path (kernel forwarding).\n\n")
	b.WriteString("### Targets (reported, not asserted)\n\n")
	tt := table{head: []string{"target", "measured", "met"}}
	for _, t := range r.Targets {
		tt.add(t.Target, t.Measured, t.Met)
	}
	b.WriteString(tt.String() + "\n")
	for _, n := range r.Notes {
		b.WriteString("- " + n + "\n")
	}
	if len(r.Notes) > 0 {
		b.WriteString("\n")
	}
	for _, p := range plots {
		fmt.Fprintf(&b, "![%s](%s)\n", strings.TrimSuffix(p, ".png"), p)
	}

	b.WriteString("\n## 1. Per-packet cost of the XDP program (BPF_PROG_RUN)\n\n")
	pt := table{head: []string{"program / frame", "verdict", "runs", "mean ns", "median ns", "p99 ns", "median above floor ns", "× floor",
		"wall ns per syscall (Go)", "wall above floor ns", "method"}}
	for _, p := range r.ProgRun {
		name := p.Name
		if !p.Valid {
			name += " (invalid, see method)"
		}
		pt.add(name+": "+p.Frame, p.Verdict, f(float64(p.Runs), 0), f(p.MeanNs, 1), f(p.MedianNs, 0), f(p.P99Ns, 0), f(p.AboveNs, 0), f(p.FloorX, 2), f(p.WallNs, 0), f(p.WallAboveNs, 0), p.Method)
	}
	b.WriteString(pt.String())
	b.WriteString("\nMethod: BPF_PROG_RUN with repeat=1, once per syscall, many syscalls, in the server namespace (routes, permanent " +
		"neighbours, forwarding on, devmap entries, so `bpf_fib_lookup` succeeds and the relay takes its full fast path every time: " +
		"each syscall copies the original frame in afresh). The time is the kernel's own per-run figure (`duration` of " +
		"BPF_PROG_TEST_RUN: ktime around the program, including one timer read and bh disable/enable), and the same method on " +
		"a two-instruction XDP_TX program gives the floor that is subtracted. Every run's verdict is checked. With repeat>1 " +
		"the kernel re-runs the program on the buffer the previous iteration modified, so a relaying program takes the fast " +
		"path only once (shown as the invalid row). BPF_F_TEST_XDP_LIVE_FRAMES was not used: per the kernel's " +
		"Documentation/bpf/bpf_prog_run.rst, live-frame mode resets only the frame's metadata when it recycles a page, so a " +
		"program that rewrites the packet may see its own output again, and redirected frames are really transmitted, adding " +
		"the veth and peer cost. Caveat: one program run per syscall sees microarchitectural state disturbed by the syscall " +
		"(branch predictors, caches), which costs a branchy program with helper calls (bpf_fib_lookup, map lookups, " +
		"adjust_head, redirect_map) more than a two-instruction floor, so the figures are an upper bound for a warm run.\n")

	r.writeLiveCost(&b)

	b.WriteString("\n## 2. End to end: ChannelData over a real allocation\n\n")
	b.WriteString("One pion/turn client in the client namespace allocates, creates a permission and binds channels 0x4000 " +
		"(to a sink at 10.200.0.2:5001) and 0x4001 (to an echo at 10.200.0.2:5002); then a Go generator sends raw ChannelData " +
		"from the same UDP socket (same 5-tuple) with sendmmsg (raw syscall, batches of up to 64), paced to each rung of the ladder " +
		"for its duration (max = no pacing). Delivered = Udp.InDatagrams + Udp.RcvbufErrors + Udp.NoPorts growth in the peer namespace: " +
		"the sink socket is never read, so it costs only the kernel's UDP receive and drop. The `kernel forwarding` row sends the " +
		"same payloads as plain UDP straight to the peer through the server's IP forwarding (no TURN). XDP share = the daemon's " +
		"stunnerd_xdp_packets_total{path=\"xdp\"} share of client→peer packets during the rung. XDP program ns/run = the " +
		"attached relay program's run_time_ns / run_cnt growth during the rung (kernel.bpf_stats_enabled): its live cost per frame.\n\n")
	rt := table{head: []string{"server", "payload B", "target pps", "offered pps", "delivered pps", "loss %", "server process µs/pkt",
		"softirq µs/pkt (system)", "server total µs/pkt", "busy µs/pkt (all CPUs)", "XDP share", "XDP program ns/run", "server rcvbuf drops"}}
	for _, p := range r.Relay {
		share, prog := "–", "–"
		if p.XDPShare >= 0 {
			share = f(100*p.XDPShare, 1) + " %"
		}
		if p.ProgNsPerRun > 0 {
			prog = f(p.ProgNsPerRun, 0)
		}
		rt.add(p.Server, f(float64(p.Payload), 0), rateLabel(p.TargetPPS), f(p.OfferedPPS, 0), f(p.DeliveredPPS, 0),
			f(p.LossPercent, 2), f(p.ProcUsPerPkt, 2), f(p.SoftUsPerPkt, 2), f(p.TotalUsPerPkt, 2), f(p.BusyUsPerPkt, 2), share,
			prog, f(float64(p.ServerRcvbuf), 0))
	}
	b.WriteString(rt.String())

	b.WriteString("\n### Latency (round trip through the relay)\n\n")
	lt := table{head: []string{"server", "rate pps", "payload B", "sent", "echoed", "p50 µs", "p99 µs", "p99.9 µs", "added p50 µs", "added p99 µs", "added p99.9 µs"}}
	for _, l := range r.Latency {
		lt.add(l.Server, f(l.RatePPS, 0), f(float64(l.Payload), 0), f(float64(l.Sent), 0), f(float64(l.Received), 0),
			f(l.P50Us, 1), f(l.P99Us, 1), f(l.P999Us, 1), f(l.AddedP50Us, 1), f(l.AddedP99Us, 1), f(l.AddedP999Us, 1))
	}
	b.WriteString(lt.String())
	b.WriteString("\nThe client stamps each datagram with a monotonic send time and measures when the echo comes back on the same " +
		"socket; both ends are Go programs, so the RTT includes two Go wake-ups, and the direct path (kernel forwarding, no TURN) has " +
		"the same. Samples whose echo never came are counted as lost, not as a latency.\n")

	writeUserspace(&b, r)
	writeShapes(&b, r)
	writeSessions(&b, r)
	writeJunk(&b, r)

	b.WriteString("\n## 3. The user's benchmark: iperf2 through turncat\n\n")
	it := table{head: []string{"server", "rate pps", "payload B", "seconds", "iperf sent", "received", "loss %", "server total µs/pkt", "server process µs/pkt", "turncat µs/pkt"}}
	for _, i := range r.Iperf {
		it.add(i.Server, f(float64(i.RatePPS), 0), f(float64(i.Payload), 0), f(float64(i.Seconds), 0), f(float64(i.Sent), 0),
			f(float64(i.Received), 0), f(i.LossPercent, 3), f(i.TotalUsPerPkt, 2), f(i.ProcUsPerPkt, 2), f(i.TurncatUs, 2))
	}
	b.WriteString(it.String())
	b.WriteString("\n`iperf -c 127.0.0.1 -p 5000 -u -l SIZE -b RATEpps -t SECONDS -e` in the client namespace → STUNner v1.1.0 turncat → " +
		"server → `iperf -s -u -p 5001 -e -w 4M` in the peer namespace, net.core.rmem_default raised to 4 MiB during this stage as " +
		"in test/e2e (turncat has no socket-buffer flag). turncat itself is a userspace relay and costs about as much CPU as the server.\n")

	b.WriteString("\n## 4. Control plane\n\n")
	if c := r.Control; c != nil {
		ct := table{head: []string{"what", "value"}}
		ct.add("bindings installed through mirror.Mirror's EventHandler hooks", fmt.Sprintf("%s (%s allocations, %s hook events)", f(float64(c.Bindings), 0), f(float64(c.Allocations), 0), f(float64(c.Events), 0)))
		ct.add("time until all were in the maps", f(c.Seconds, 3)+" s")
		ct.add("bindings mirrored per second", f(c.BindingsPerSecond, 0))
		ct.add("time to remove them all (OnAllocationDeleted)", f(c.RemoveSeconds, 3)+" s")
		ct.add("map slots (--max-bindings)", f(float64(c.MaxEntries), 0))
		keys := make([]string, 0, len(c.MapMemlock))
		for k := range c.MapMemlock {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		for _, k := range keys {
			ct.add("memlock of map "+k, f(float64(c.MapMemlock[k]), 0)+" B")
		}
		ct.add("kernel memory per binding slot (memlock of the three per-binding maps / slots)", f(c.MapBytesPerSlot, 1)+" B")
		ct.add(fmt.Sprintf("computed: key+value of c2p and p2c + state slot with the counters (the same on %d possible CPUs as on any number)", c.PossibleCPUs), f(c.MapBytesPerSlotComputed, 1)+" B")
		ct.add("Go heap per binding (mirror + channelmap, after GC)", f(c.HeapBytesPerBinding, 1)+" B")
		b.WriteString(ct.String())
		b.WriteString("\nThe maps are preallocated: their memory is paid for all --max-bindings slots at load, whatever is bound. " +
			"The hooks are called from one goroutine as pion/turn would call them (queue, never block); the time runs from the first " +
			"hook to the mirror's Sync barrier returning with every binding in the maps (checked with channelmap Len). pion/turn's " +
			"own per-allocation state is not included in the heap figure.\n")
	}

	b.WriteString("\n## 5. Scaling with the number of bound channels (XDP native)\n\n")
	st := table{head: []string{"channels", "allocations", "target pps", "offered pps", "delivered pps", "loss %", "softirq µs/pkt (system)", "busy µs/pkt", "XDP relayed", "channels with traffic", "install s"}}
	for _, s := range r.Scaling {
		st.add(f(float64(s.Channels), 0), f(float64(s.Allocations), 0), rateLabel(s.TargetPPS), f(s.OfferedPPS, 0), f(s.DeliveredPPS, 0),
			f(s.LossPercent, 2), f(s.SoftUsPerPkt, 2), f(s.BusyUsPerPkt, 2), f(float64(s.XDPRelayed), 0), f(float64(s.ChannelsHit), 0), f(s.InstallSecond, 2))
	}
	b.WriteString(st.String())
	b.WriteString("\nHow the channels were made: not by pion/turn. The relay program and maps are loaded and attached natively to the " +
		"server's veths exactly as the daemon does it (`loader.Load`, `Program.Attach`, `channelmap.New`), and the bindings are " +
		"installed by calling `mirror.Mirror`'s EventHandler hooks with synthetic allocations (client ports in the client namespace, " +
		"one relay port each, 1,000 channels per allocation, one peer port per channel). The generator sends from the same client " +
		"sockets, round-robin over every bound channel, so every binding in the maps carries traffic. There is no userspace relay " +
		"here, hence no process CPU.\n")

	b.WriteString("\n## Commands\n\n")
	for _, c := range m.Commands {
		b.WriteString("    " + c + "\n")
	}
	b.WriteString("\n## Stage durations\n\n")
	for _, s := range r.Stages {
		fmt.Fprintf(&b, "- %s: %.1f s\n", s.Stage, s.Seconds)
	}
	return os.WriteFile(filepath.Join(dir, "report.md"), []byte(b.String()), 0o644)
}

// Server names, as they appear in the report.
const (
	ServerXDPNative  = "stunnerd-xdp XDP native"
	ServerXDPGeneric = "stunnerd-xdp XDP generic"
	ServerXDPOff     = "stunnerd-xdp userspace (--xdp-mode=off)"
	// ServerXDPOffSteered is the same with the listener in a steered
	// SO_REUSEPORT group (--handover-dir): what rolling-update support costs
	// the packets that reach the listener socket.
	ServerXDPOffSteered = "stunnerd-xdp userspace, steered listener (--xdp-mode=off --handover-dir)"
	ServerStunnerd      = "STUNner stunnerd v1.1.0"
	// The userspace comparison (its own stage, several allocations).
	ServerUser1         = "stunnerd-xdp userspace, 1 read loop (--xdp-mode=off --udp-thread-num=1)"
	ServerUserN         = "stunnerd-xdp userspace, a read loop per CPU (--xdp-mode=off --udp-thread-num=CPUs)"
	ServerUser16        = "stunnerd-xdp userspace, the operator's 16 read loops (--xdp-mode=off --udp-thread-num=16)"
	ServerStunnerd121N  = "STUNner stunnerd v1.2.1 -u CPUs"
	ServerStunnerd12116 = "STUNner stunnerd v1.2.1 -u 16"
	ServerCoturn        = "coturn"
	ServerKernelFwd     = "kernel forwarding (no TURN)"
	// ServerDeliveryFloor sends from the server namespace to the peer: the
	// softirq of delivering a packet to the peer, with no relay at all.
	ServerDeliveryFloor = "delivery floor (server ns → peer, no relay)"
)

// Plot renders the PNGs with gnuplot and returns their file names (in dir).
func (r *Report) Plot(dir string) ([]string, error) {
	type series struct {
		title, file string
	}
	write := func(name string, lines []string) error {
		return os.WriteFile(filepath.Join(dir, name), []byte(strings.Join(lines, "\n")+"\n"), 0o644)
	}
	var relaySeries []series
	for i, s := range r.Expected.RelayServers {
		for _, size := range []int{100, 1200} {
			var lines []string
			var pts []RelayPoint
			for _, p := range r.Relay {
				if p.Server == s && p.Payload == size {
					pts = append(pts, p)
				}
			}
			if len(pts) == 0 {
				continue
			}
			sort.Slice(pts, func(a, b int) bool { return pts[a].OfferedPPS < pts[b].OfferedPPS })
			for _, p := range pts {
				lines = append(lines, fmt.Sprintf("%g %g %g", p.OfferedPPS, p.DeliveredPPS, p.TotalUsPerPkt))
			}
			file := fmt.Sprintf("data/relay-%d-%d.dat", i, size)
			if err := write(file, lines); err != nil {
				return nil, err
			}
			relaySeries = append(relaySeries, series{title: fmt.Sprintf("%s, %d B", s, size), file: file})
		}
	}
	var lat []string
	for i, l := range r.Latency {
		lat = append(lat, fmt.Sprintf("%d \"%s\" %g %g %g", i, strings.ReplaceAll(l.Server, " ", "\\n"), l.P50Us, l.P99Us, l.P999Us))
	}
	if err := write("data/latency.dat", lat); err != nil {
		return nil, err
	}
	var scMax, scFixed []string
	for _, s := range r.Scaling {
		line := fmt.Sprintf("%d %g %g %g", s.Channels, s.TargetPPS, s.DeliveredPPS, s.SoftUsPerPkt)
		if s.TargetPPS == 0 {
			scMax = append(scMax, line)
		} else {
			scFixed = append(scFixed, line)
		}
	}
	if err := write("data/scaling-max.dat", scMax); err != nil {
		return nil, err
	}
	if err := write("data/scaling-fixed.dat", scFixed); err != nil {
		return nil, err
	}

	plotLines := func(col string) string {
		var parts []string
		for i, s := range relaySeries {
			dash := 1
			if strings.HasSuffix(s.title, "1200 B") {
				dash = 2
			}
			parts = append(parts, fmt.Sprintf("'%s' using 1:%s with linespoints lc %d dt %d pt 7 title '%s'", s.file, col, i/2+1, dash, s.title))
		}
		return "plot " + strings.Join(parts, ", \\\n  ")
	}
	script := []string{
		"set terminal png size 1100,650 font ',10'",
		"set grid",
		"set key outside right",
		"set output 'throughput.png'",
		"set title 'Delivered vs offered packets/s (ChannelData over one allocation; dashed: 1200 B)'",
		"set xlabel 'offered packets/s'", "set ylabel 'delivered packets/s at the peer'",
		plotLines("2"),
		"set output 'cpu.png'",
		"set title 'Server CPU per relayed packet (process + softirq of all CPUs), log scale'",
		"set logscale y", "set ylabel 'µs per delivered packet'",
		plotLines("3"),
		"unset logscale y",
		"set output 'latency.png'",
		"set title 'Round-trip time through the relay (echo at the peer)'",
		"set style data histogram", "set style histogram clustered gap 1", "set style fill solid 0.8 border -1",
		"set ylabel 'µs'", "set xlabel ''", "set xtics font ',8'", "set logscale y", "set bmargin 5",
		"plot 'data/latency.dat' using 3:xtic(2) title 'p50', '' using 4 title 'p99', '' using 5 title 'p99.9'",
		"unset logscale y", "set style data linespoints", "set xtics font ',10'", "set bmargin",
		"set output 'scaling.png'",
		"set title 'XDP native: bound channels vs delivered rate and softirq CPU per packet'",
		"set logscale x", "set xlabel 'bound channels (all carrying traffic)'", "set ylabel 'delivered packets/s'",
		"set y2label 'softirq µs per packet'", "set y2tics", "set ytics nomirror",
		"set yrange [0:*]", "set y2range [0:*]",
		"plot 'data/scaling-max.dat' using 1:3 axes x1y1 with linespoints pt 7 title 'delivered pps (max offered)', " +
			"'data/scaling-fixed.dat' using 1:3 axes x1y1 with linespoints pt 7 dt 2 title 'delivered pps (fixed rate)', " +
			"'data/scaling-max.dat' using 1:4 axes x1y2 with linespoints pt 5 title 'softirq µs/pkt (max offered)', " +
			"'data/scaling-fixed.dat' using 1:4 axes x1y2 with linespoints pt 9 dt 2 title 'softirq µs/pkt (fixed rate)'",
	}
	pngs := []string{"throughput.png", "cpu.png", "latency.png", "scaling.png"}
	sessions, err := r.plotSessions(dir)
	if err != nil {
		return nil, err
	}
	if len(sessions) > 0 {
		script = append(script, "unset logscale", "unset y2tics", "set ytics mirror")
		script = append(script, sessions...)
		pngs = append(pngs, "sessions.png")
	}
	if err := write("plots.gp", script); err != nil {
		return nil, err
	}
	cmd := exec.Command("gnuplot", "plots.gp")
	cmd.Dir = dir
	if out, err := cmd.CombinedOutput(); err != nil {
		return nil, fmt.Errorf("gnuplot: %w\n%s", err, out)
	}
	return pngs, nil
}

// ReadJSON reads a report written by WriteJSON.
func ReadJSON(path string) (*Report, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var r Report
	return &r, json.Unmarshal(b, &r)
}
