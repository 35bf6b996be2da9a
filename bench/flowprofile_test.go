package bench

import (
	"bytes"
	"fmt"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/l7mp/stunnerd-xdp/bpf"
	"github.com/l7mp/stunnerd-xdp/internal/loader"
	"github.com/l7mp/stunnerd-xdp/test/netns"
	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// TestFlowProfile profiles the sessions stage's kernel rows at a few N
// (issue 27: where the cost at 10,000 sessions goes). It is no stage of the
// report: it prints per row and interval the program's ns/run, which CPU
// relayed each direction, the flow caches' hits and misses (when the loaded
// object counts them in a flow_stats map: a profiling build), how many flows
// sit in both CPUs' regions, and, with BENCH_FLOWPROF_PERF=DIR, a perf
// cpu-clock profile of one interval per row mapped to source lines by
// test/cmd/jitprof (built at /tmp/jitprof).
//
//	BENCH_FLOWPROF=1,10000 go test ./bench -run '^TestFlowProfile$' -v -count=1   # as root
//
// BENCH_FLOWPROF_ROUNDS (3) intervals of BENCH_FLOWPROF_SECONDS (4) per row,
// the rows of one N in turns as in the sessions stage.
func TestFlowProfile(t *testing.T) {
	spec := os.Getenv("BENCH_FLOWPROF")
	if spec == "" {
		t.Skip("set BENCH_FLOWPROF=N[,N...] to profile the sessions stage's kernel rows (as root)")
	}
	var ns []int
	for _, f := range strings.Split(spec, ",") {
		n, err := strconv.Atoi(f)
		if err != nil || n < 1 {
			t.Fatalf("BENCH_FLOWPROF=%q", spec)
		}
		ns = append(ns, n)
	}
	rounds, secs := 3, 4.0
	if v, err := strconv.Atoi(os.Getenv("BENCH_FLOWPROF_ROUNDS")); err == nil && v > 0 {
		rounds = v
	}
	if v, err := strconv.ParseFloat(os.Getenv("BENCH_FLOWPROF_SECONDS"), 64); err == nil && v > 0 {
		secs = v
	}
	perfDir := os.Getenv("BENCH_FLOWPROF_PERF")
	netns.RequirePrivileged(t, "go")
	h := &harness{cfg: configs["full"], rep: &Report{}}
	h.pins = testenv.BPFFS(t)
	h.rig = netns.New(t, netns.WithIPv6())
	h.startPeers(t)
	defer enableBPFStats(t).Close()
	trivial := h.trivialProgs(t)
	defer func() {
		for _, p := range trivial {
			_ = p.Close()
		}
	}()
	load := h.sessionLoad(t, ns[len(ns)-1])
	// BENCH_FLOWPROF_AB=<relay object>: each round loads the embedded
	// program (A) and that object (B) in turns (the order alternating), each
	// with maps of its own and the sessions installed afresh, and measures
	// the rows on both: the paired ratios B/A per row.
	ab := os.Getenv("BENCH_FLOWPROF_AB")
	if ab == "" {
		h.profileSessions(t, "", ns, rounds, secs, perfDir, load, trivial)
		return
	}
	res := map[string][]float64{}
	for round := range rounds {
		order := []string{"", ab}
		if round%2 == 1 {
			order = []string{ab, ""}
		}
		for _, obj := range order {
			side := "A"
			if obj != "" {
				side = "B"
			}
			t.Run(fmt.Sprintf("%s%d", side, round), func(t *testing.T) {
				for k, v := range h.profileSessions(t, obj, ns, 1, secs, "", load, trivial) {
					res[side+" "+k] = append(res[side+" "+k], v...)
				}
			})
		}
	}
	for k, a := range res {
		if !strings.HasPrefix(k, "A ") {
			continue
		}
		b := res["B "+k[2:]]
		var ratios []float64
		for i := range min(len(a), len(b)) {
			ratios = append(ratios, b[i]/a[i])
		}
		sort.Float64s(ratios)
		t.Logf("A/B %s: A %.0f ns/run, B %.0f ns/run; B/A median %.3f (rounds %.3f-%.3f)", k[2:], median(a), median(b),
			quantile(ratios, 0.5), ratios[0], ratios[len(ratios)-1])
	}
}

// profileSessions loads the relay program (object: the embedded one),
// installs the sessions of every N in ns and measures the rows of each;
// it returns the ns/run of every interval by row.
func (h *harness) profileSessions(t *testing.T, object string, ns []int, rounds int, secs float64, perfDir string,
	load *mixLoad, trivial []*ebpf.Program) map[string][]float64 {
	r := h.rig
	cfg := func(noFlow bool) loader.Config {
		c := scalingConfig()
		c.NoFlowCache = noFlow
		c.Object = object
		return c
	}
	prog, maps, m := h.attachMirrored(t, cfg(false))
	noFlow := func(off bool) {
		if err := r.Server.Do(func() error { return prog.Reconfigure(cfg(off)) }); err != nil {
			t.Fatal(err)
		}
	}
	out := map[string][]float64{}
	installed := 0
	for _, n := range ns {
		installSessions(t, m, maps, load, installed, n)
		installed = n
		target := float64(n * sessionPPS)
		type row struct {
			name string
			sess *mixLoad
			rate float64
			ns   []float64
		}
		rows := []*row{{name: "flow cache", sess: load.first(n), rate: target}, {name: "no flow cache", sess: load.first(n), rate: target}}
		if n > 1 {
			rows = append(rows, &row{name: "one flow", sess: load.first(1)})
		}
		for round := range rounds {
			for i, rw := range rows {
				if i == 1 {
					noFlow(true)
				}
				var perfOut string
				if perfDir != "" && round == rounds-1 {
					perfOut = filepath.Join(perfDir, fmt.Sprintf("n%d-%s", n, strings.ReplaceAll(rw.name, " ", "-")))
				}
				got := h.profileInterval(t, n, rw.name, rw.sess, rw.rate, secs, prog, trivial, perfOut, &rw.ns)
				if i == 1 {
					noFlow(false)
				}
				if i == 0 && len(rows) > 2 {
					rows[2].rate = math.Min(target, float64(max(got.c2p, got.p2c))/got.elapsed.Seconds())
				}
			}
		}
		for _, rw := range rows {
			t.Logf("N=%d %s: program ns/run median %.0f over %.0f", n, rw.name, median(rw.ns), rw.ns)
			out[fmt.Sprintf("N=%d %s", n, rw.name)] = rw.ns
		}
	}
	return out
}

// mapOf finds the relay program's map called name, or nil.
func mapOf(t *testing.T, p *ebpf.Program, name string) *ebpf.Map {
	info, err := p.Info()
	if err != nil {
		t.Fatal(err)
	}
	ids, _ := info.MapIDs()
	for _, id := range ids {
		mp, err := ebpf.NewMapFromID(id)
		if err != nil {
			continue
		}
		if mi, err := mp.Info(); err == nil && mi.Name == name {
			return mp
		}
		_ = mp.Close()
	}
	return nil
}

// perCPU reads entries [0, n) of a per-CPU array map as [entry][cpu].
func perCPU(t *testing.T, mp *ebpf.Map, n int) [][]uint64 {
	out := make([][]uint64, n)
	if mp == nil {
		return out
	}
	for i := range n {
		var v []uint64
		if err := mp.Lookup(uint32(i), &v); err != nil {
			t.Fatal(err)
		}
		out[i] = v
	}
	return out
}

func cpuDelta(a, b [][]uint64, i, cpu int) uint64 {
	if len(a[i]) <= cpu || len(b[i]) <= cpu {
		return 0
	}
	return b[i][cpu] - a[i][cpu]
}

// profileInterval offers rate packets/s per direction of sess for secs and
// logs what the program did.
func (h *harness) profileInterval(t *testing.T, n int, name string, sess *mixLoad, rate, secs float64, prog *loader.Program,
	trivial []*ebpf.Program, perfOut string, nsOut *[]float64) mixSent {
	t.Helper()
	x := prog.XDP()
	verdicts, fstats := mapOf(t, x, "verdicts"), mapOf(t, x, "flow_stats")
	defer func() {
		for _, mp := range []*ebpf.Map{verdicts, fstats} {
			if mp != nil {
				_ = mp.Close()
			}
		}
	}()
	sess.send(rate, 100*time.Millisecond)
	time.Sleep(200 * time.Millisecond)
	v0, f0 := perCPU(t, verdicts, 4), perCPU(t, fstats, 4)
	s0, _ := statsOf(x)
	tr0, _ := trivialStats(trivial)
	var perf *exec.Cmd
	if perfOut != "" {
		if err := os.MkdirAll(filepath.Dir(perfOut), 0o755); err != nil {
			t.Fatal(err)
		}
		lines, err := exec.Command("/tmp/jitprof", "lines").Output()
		if err != nil {
			t.Fatalf("jitprof lines: %v", err)
		}
		if err := os.WriteFile(perfOut+".lines", lines, 0o644); err != nil {
			t.Fatal(err)
		}
		perf = exec.Command("perf", "record", "-q", "-e", "cpu-clock", "-F", "10000", "-a", "-g", "-o", perfOut+".data", "--",
			"sleep", strconv.FormatFloat(secs-0.5, 'f', 1, 64))
		if err := perf.Start(); err != nil {
			t.Fatal(err)
		}
	}
	sent := sess.send(rate, time.Duration(secs*float64(time.Second)))
	if perf != nil {
		if err := perf.Wait(); err != nil {
			t.Errorf("perf record: %v", err)
		}
	}
	time.Sleep(200 * time.Millisecond)
	s1, _ := statsOf(x)
	tr1, _ := trivialStats(trivial)
	v1, f1 := perCPU(t, verdicts, 4), perCPU(t, fstats, 4)
	nsRun := s1.nsPerRunSince(s0)
	*nsOut = append(*nsOut, nsRun)
	var b strings.Builder
	fmt.Fprintf(&b, "N=%d %-13s offered %.0f/s each way: %.0f ns/run (%d runs), trivial %.0f ns/run; load %s",
		n, name, float64(sent.c2p)/sent.elapsed.Seconds(), nsRun, s1.runs-s0.runs, tr1.nsPerRunSince(tr0), loadavg())
	for cpu := range 2 {
		c2p := cpuDelta(v0, v1, 0, cpu) + cpuDelta(v0, v1, 1, cpu)
		p2c := cpuDelta(v0, v1, 2, cpu) + cpuDelta(v0, v1, 3, cpu)
		fmt.Fprintf(&b, "\n  cpu%d relayed c2p %d p2c %d", cpu, c2p, p2c)
		if fstats != nil {
			ch, cm, ph, pm := cpuDelta(f0, f1, 0, cpu), cpuDelta(f0, f1, 1, cpu), cpuDelta(f0, f1, 2, cpu), cpuDelta(f0, f1, 3, cpu)
			fmt.Fprintf(&b, "; flow cache c2p %d hits %d misses (%.1f %%), p2c %d hits %d misses (%.1f %%)",
				ch, cm, pct(ch, ch+cm), ph, pm, pct(ph, ph+pm))
		}
	}
	if name == "flow cache" {
		fmt.Fprintf(&b, "\n  %s", flowDuplicates(t, prog))
	}
	t.Log(b.String())
	if perf != nil {
		script := exec.Command("sh", "-c", fmt.Sprintf("perf script -F ip,sym,symoff -i %s.data 2>/dev/null | /tmp/jitprof report %s.lines > %s.txt", perfOut, perfOut, perfOut))
		var errb bytes.Buffer
		script.Stderr = &errb
		if err := script.Run(); err != nil {
			t.Errorf("jitprof report: %v: %s", err, errb.String())
		}
	}
	return sent
}

func pct(a, b uint64) float64 {
	if b == 0 {
		return math.NaN()
	}
	return 100 * float64(a) / float64(b)
}

// flowDuplicates counts the valid entries of each CPU's region of both flow
// caches and the flows cached in both regions.
func flowDuplicates(t *testing.T, prog *loader.Program) string {
	mp := prog.Maps()
	fi, err := mp.C2pFlows.Info()
	if err != nil {
		t.Fatal(err)
	}
	per := int(fi.MaxEntries) / 2
	var c2p bpf.RelayC2pFlow
	var p2c bpf.RelayP2cFlow
	return fmt.Sprintf("c2p entries %s; p2c entries %s",
		regionsOf(t, mp.C2pFlows, per, &c2p, func() (string, bool) {
			return fmt.Sprint(c2p.ClientAddr.B, c2p.DstAddr.B, c2p.ClientPort, c2p.DstPort, c2p.Channel), c2p.FibGen != 0
		}),
		regionsOf(t, mp.P2cFlows, per, &p2c, func() (string, bool) {
			return fmt.Sprint(p2c.PeerAddr, p2c.RelayAddr, p2c.PeerPort, p2c.RelayPort), p2c.FibGen != 0
		}))
}

// regionsOf reads the two CPUs' regions of per entries of a flow cache into
// *into one by one, keyed by key (false: empty), and counts the flows of each
// region and those in both.
func regionsOf(t *testing.T, m *ebpf.Map, per int, into any, key func() (string, bool)) string {
	seen := [2]map[string]bool{{}, {}}
	for i := range 2 * per {
		if err := m.Lookup(uint32(i), into); err != nil {
			t.Fatal(err)
		}
		if k, ok := key(); ok {
			seen[i/per][k] = true
		}
	}
	both := 0
	for k := range seen[0] {
		if seen[1][k] {
			both++
		}
	}
	return fmt.Sprintf("cpu0 %d cpu1 %d, in both %d", len(seen[0]), len(seen[1]), both)
}
