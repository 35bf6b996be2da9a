package bench

import (
	"bufio"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/l7mp/stunnerd-xdp/test/netns"
	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// config sizes a run. The full run must fit in 15 minutes on a 2-core VM,
// the smoke run (CI) in 2 minutes; the smoke run has every row of the full one.
type config struct {
	mode string

	progRuns int // BPF_PROG_RUN syscalls per program/frame row

	ladder100, ladder1200 []float64 // offered packets/s per rung; 0 = as fast as the generator goes
	point                 time.Duration
	maxWorkers            int // generator threads on the "max" rung

	latencyRate float64
	latencyDur  time.Duration

	iperfRate, iperfSeconds int

	controlBindings int

	scalingChannels []int
	scalingRate     float64 // the fixed-rate rung of each scaling point (plus a max rung)
	scalingPoint    time.Duration

	liveRate   float64       // packets/s of each live-cost interval
	livePoint  time.Duration // one interval
	liveRounds int           // intervals per row, interleaved

	lo, hi float64 // reference rates of the summary (must be rungs of ladder100)

	userspaceLadder []float64 // offered packets/s per unpinned rung of the userspace stage; 0 = max
	userspacePinned []float64 // the fixed pinned rungs the loss-free search starts from (a pinned max rung follows)
	userspaceRounds int       // turns each userspace server takes
	userspaceSearch int       // steps of the loss-free search between pinned rungs

	shapeRate  float64       // packets/s the client sends in each node shape row
	shapePoint time.Duration // how long

	sessionsN       []int         // sessions of the kernel rows, ascending
	sessionsServerN []int         // sessions (real allocations) of the daemon rows
	sessionsPoint   time.Duration // one interval
	sessionsRounds  int           // intervals per row, interleaved

	junkLadder []float64     // junk packets/s per rung: -1 none, 0 max
	junkRounds int           // turns each server takes at every rung
	junkEcho   time.Duration // how long the session echoes under the junk
	junkEchoes int           // echoes sent in that time
}

var configs = map[string]config{
	"full": {
		mode:     "full",
		progRuns: 200000,
		// 5 s per rung: 5 servers + kernel forwarding × 8 rungs ≈ 5 minutes.
		ladder100: []float64{20000, 50000, 100000, 200000, 0}, ladder1200: []float64{20000, 100000, 0},
		point: 5 * time.Second, maxWorkers: 2,
		latencyRate: 5000, latencyDur: 3 * time.Second,
		iperfRate: 20000, iperfSeconds: 10,
		controlBindings: 100000,
		scalingChannels: []int{1, 100, 10000, 100000}, scalingRate: 100000, scalingPoint: 5 * time.Second,
		liveRate: 50000, livePoint: 2 * time.Second, liveRounds: 5,
		lo: 20000, hi: 100000,
		userspaceLadder: []float64{20000, 50000, 100000, 150000, 200000, 0}, userspacePinned: []float64{50000, 100000, 150000, 250000, 350000},
		userspaceRounds: 3, userspaceSearch: 3,
		shapeRate: 5000, shapePoint: 3 * time.Second,
		sessionsN: []int{1, 100, 1000, 10000}, sessionsServerN: []int{100, 1000}, sessionsPoint: 2 * time.Second, sessionsRounds: 3,
		junkLadder: []float64{-1, 20000, 100000, 0}, junkRounds: 2, junkEcho: 8 * time.Second, junkEchoes: 1000,
	},
	"smoke": {
		mode:      "smoke",
		progRuns:  5000,
		ladder100: []float64{20000, 100000, 0}, ladder1200: []float64{20000},
		point: 500 * time.Millisecond, maxWorkers: 2,
		latencyRate: 2000, latencyDur: 500 * time.Millisecond,
		iperfRate: 20000, iperfSeconds: 1,
		controlBindings: 20000,
		scalingChannels: []int{1, 100, 10000, 100000}, scalingRate: 100000, scalingPoint: 500 * time.Millisecond,
		liveRate: 50000, livePoint: 500 * time.Millisecond, liveRounds: 3,
		lo: 20000, hi: 100000,
		userspaceLadder: []float64{20000, 100000, 0}, userspacePinned: []float64{100000}, userspaceRounds: 1, userspaceSearch: 1,
		shapeRate: 2000, shapePoint: 500 * time.Millisecond,
		sessionsN: []int{1, 20}, sessionsServerN: []int{3}, sessionsPoint: 500 * time.Millisecond, sessionsRounds: 1,
		junkLadder: []float64{0}, junkRounds: 1, junkEcho: 2 * time.Second, junkEchoes: 200,
	},
}

// TestBench runs every stage and writes out/report.{md,json} and the plots.
// It runs only with BENCH=full or BENCH=smoke, as root; with CI=true a missing
// privilege or tool fails it instead of skipping.
func TestBench(t *testing.T) {
	mode := os.Getenv("BENCH")
	if mode == "" {
		t.Skip("set BENCH=full or BENCH=smoke to run the benchmark (as root)")
	}
	if mode == "replot" {
		replot(t)
		return
	}
	cfg, ok := configs[mode]
	if !ok {
		t.Fatalf("BENCH=%q: want full or smoke", mode)
	}
	netns.RequirePrivileged(t, "iperf", "gnuplot", "turnserver", "go")
	if w, err := strconv.Atoi(os.Getenv("BENCH_MAX_WORKERS")); err == nil && w > 0 {
		cfg.maxWorkers = w
	}
	started := time.Now()
	// The smoke run must not overwrite the committed report of a full run.
	outDir := filepath.Join(netns.RepoRoot(), "bench", "out")
	if mode == "smoke" {
		outDir = filepath.Join(netns.RepoRoot(), "bench", "out-smoke")
	}
	if err := os.MkdirAll(filepath.Join(outDir, "data"), 0o755); err != nil {
		t.Fatal(err)
	}

	h := &harness{cfg: cfg, rep: &Report{}}
	h.rep.Meta = meta(cfg, started)
	h.rep.Expected = ExpectedRows{
		ProgRun:        progRunNames,
		LiveCost:       liveCostNames,
		Memory:         true,
		RelayServers:   []string{ServerXDPNative, ServerXDPGeneric, ServerXDPOff, ServerXDPOffSteered, ServerStunnerd, ServerCoturn, ServerKernelFwd, ServerDeliveryFloor},
		RelayPoints:    len(cfg.ladder100) + len(cfg.ladder1200),
		LatencyServers: []string{ServerXDPNative, ServerXDPGeneric, ServerXDPOff, ServerXDPOffSteered, ServerStunnerd, ServerCoturn, ServerKernelFwd},
		IperfServers:   []string{ServerXDPNative, ServerXDPOff, ServerStunnerd, ServerCoturn},
		ScalingPoints:  2 * len(cfg.scalingChannels),
		// One row per rung, pinned or not, and the pinned max rung.
		UserspaceServers: []string{ServerUser1, ServerUserN, ServerUser16, ServerCoturn, ServerStunnerd121N, ServerStunnerd12116},
		UserspacePoints:  (len(cfg.userspaceLadder) + len(cfg.userspacePinned) + 1) * cfg.userspaceRounds,
		UserspaceSearch:  cfg.userspaceSearch,
		ShapeRows:        (len(netns.Shapes()) + len(rpShapes)) * len(shapeModes),
		SessionRows:      sessionRows(cfg),
		JunkRows:         len(cfg.junkLadder) * cfg.junkRounds * len(junkSpecs),
	}
	h.daemonBin, h.stunnerdBin, h.turncatBin = netns.RequireBinary(t, netns.Daemon), netns.RequireBinary(t, netns.Stunnerd), netns.RequireBinary(t, netns.Turncat)
	h.stunnerd121Bin = netns.RequireBinary(t, netns.Stunnerd121)
	h.pins = testenv.BPFFS(t)
	h.rep.Meta.Daemon = h.daemonBin
	if os.Getenv("STUNNERD_XDP") == "" {
		h.rep.Meta.Daemon = "built from this tree by the harness (go build ./cmd/stunnerd-xdp)"
	}
	h.rep.Meta.LoadAvg = []string{loadavg()}
	h.rig = netns.New(t, netns.WithIPv6())
	h.startPeers(t)
	h.command("BENCH=%s go test ./bench -run '^TestBench$' -v -count=1 (as root, from the repository root)", mode)

	only := os.Getenv("BENCH_ONLY") // debugging: run only the named stages (comma-separated); the report is then incomplete
	stage := func(name string, fn func(t *testing.T)) {
		if only != "" && !listed(only, name) {
			return
		}
		begin := time.Now()
		t.Run(name, fn)
		h.rep.Stages = append(h.rep.Stages, StageDuration{Stage: name, Seconds: time.Since(begin).Seconds()})
		t.Logf("stage %s: %.1f s", name, time.Since(begin).Seconds())
	}
	stage("progrun", h.stageProgRun)
	stage("livecost", h.stageLiveCost)
	stage("memory", h.stageMemory)
	stage("mapops", h.stageMapOps)
	stage("control", h.stageControl)
	stage("scaling", h.stageScaling)
	stage("relay", h.stageRelay)
	stage("userspace", h.stageUserspace)
	stage("iperf", h.stageIperf)
	stage("shapes", h.stageShapes)
	stage("sessions", h.stageSessions)
	stage("junk", h.stageJunk)

	h.rep.Targets, h.rep.Notes = h.targets()
	h.rep.Meta.Duration = time.Since(started).Round(time.Second).String()
	h.rep.Meta.LoadAvg = append(h.rep.Meta.LoadAvg, loadavg())
	plots, err := h.rep.Plot(outDir)
	if err != nil {
		t.Error(err)
	}
	if err := h.rep.WriteJSON(outDir); err != nil {
		t.Fatal(err)
	}
	if err := h.rep.WriteMarkdown(outDir, cfg.lo, cfg.hi, plots); err != nil {
		t.Fatal(err)
	}
	summary := h.rep.SummaryTable(cfg.lo, cfg.hi)
	fmt.Printf("\nstunnerd-xdp benchmark (%s), %s; report in %s/report.md\n\n%s\n", mode, h.rep.Meta.Duration, outDir, summary)
	for _, tr := range h.rep.Targets {
		fmt.Printf("target: %s: %s (%s)\n", tr.Target, tr.Measured, tr.Met)
	}
	if err := h.rep.Validate(); err != nil {
		t.Errorf("the report is incomplete:\n%v", err)
	}
}

// sessionRows is how many rows the sessions stage makes: per N with the flow
// cache, without it and one flow (N=1: the first is the one flow), and the
// three daemon rows per daemon N.
func sessionRows(cfg config) int {
	n := 3*len(cfg.sessionsN) + 3*len(cfg.sessionsServerN)
	if len(cfg.sessionsN) > 0 && cfg.sessionsN[0] == 1 {
		n--
	}
	return n
}

// listed reports whether name is in the comma-separated list.
func listed(list, name string) bool { return slices.Contains(strings.Split(list, ","), name) }

// harness is the state the stages share: one rig for the whole run.
type harness struct {
	cfg       config
	rep       *Report
	rig       *netns.Rig
	daemonBin string // this tree's (so the benchmark measures the code it sits next to), or $STUNNERD_XDP
	// STUNner v1.1.0's, from test/tools
	stunnerdBin, turncatBin string
	stunnerd121Bin          string
	pins                    string // private bpffs for the steered daemon's maps
	peers                   *peers
	liveObject              string // the relay object the live-cost stage runs ("": the embedded one)
	// userspaceP2C: the userspace stage's load goes peer->client
	// (BENCH_USERSPACE_P2C) and is counted at the client.
	userspaceP2C bool
}

// command records a command line for the report.
func (h *harness) command(format string, args ...any) {
	h.rep.Meta.Commands = append(h.rep.Meta.Commands, fmt.Sprintf(format, args...))
}

// meta describes the machine and the software versions.
func meta(cfg config, started time.Time) Meta {
	m := Meta{Mode: cfg.mode, Started: started, CPUs: runtime.NumCPU(), Go: runtime.Version(), ClockTick: clockTick}
	if out, err := exec.Command("uname", "-r").Output(); err == nil {
		m.Kernel = strings.TrimSpace(string(out))
	}
	m.CPU = firstField("/proc/cpuinfo", "model name")
	if kb, err := strconv.ParseFloat(strings.Fields(firstField("/proc/meminfo", "MemTotal") + " 0")[0], 64); err == nil {
		m.MemTotal = fmt.Sprintf("%.0f GiB", kb/(1<<20))
	}
	if bi, ok := debug.ReadBuildInfo(); ok {
		for _, d := range bi.Deps {
			switch d.Path {
			case "github.com/pion/turn/v4", "github.com/cilium/ebpf":
				m.Versions = append(m.Versions, d.Path+" "+d.Version)
			}
		}
	}
	m.Versions = append(m.Versions, "stunnerd-xdp at "+gitDescribe(),
		"STUNner stunnerd and turncat v1.1.0, stunnerd v1.2.1 (test/tools/build.sh)",
		"coturn "+firstLine("turnserver", "--version"), firstLine("iperf", "-v"), firstLine("gnuplot", "--version"))
	return m
}

func gitDescribe() string {
	out, err := exec.Command("git", "-C", netns.RepoRoot(), "describe", "--always", "--dirty").Output()
	if err != nil {
		return "unknown commit"
	}
	return strings.TrimSpace(string(out))
}

func firstLine(name string, args ...string) string {
	out, _ := exec.Command(name, args...).CombinedOutput()
	line, _, _ := strings.Cut(strings.TrimSpace(string(out)), "\n")
	return line
}

// firstField returns the value of the first "key: value" line of a /proc file.
func firstField(path, key string) string {
	fh, err := os.Open(path)
	if err != nil {
		return ""
	}
	defer fh.Close()
	sc := bufio.NewScanner(fh)
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), ":")
		if ok && strings.TrimSpace(k) == key {
			return strings.TrimSpace(v)
		}
	}
	return ""
}

// Addresses of the rig (test/netns.NewRouted) and the ports the bench uses.
var (
	clientIP   = net.IPv4(10, 100, 0, 2).To4()
	listenIP   = net.IPv4(10, 100, 0, 1).To4()
	relayIP    = net.IPv4(10, 200, 0, 1).To4()
	peerIP     = net.IPv4(10, 200, 0, 2).To4()
	listenPort = 3478
	sinkPort   = 5001 // never read: counts what arrives
	echoPort   = 5002 // echoes every datagram
	iperfPort  = 5010
	// Scaling stage: one sink per channel index of an allocation.
	scalingPeerBase = 10000
)

const (
	user      = "user1"
	password  = "passwd1"
	sinkChan  = 0x4000 // the channel a session binds to the sink first
	echoChan  = 0x4001 // and then to the echo
	chansPerA = 1000   // channels per synthetic allocation in the scaling stage
)

func loadavg() string {
	b, _ := os.ReadFile("/proc/loadavg")
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return "?"
	}
	return strings.Join(f[:3], " ")
}

// replot renders report.md and the plots again from out/report.json
// (BENCH=replot), e.g. after a change to the report's layout; it measures nothing.
func replot(t *testing.T) {
	outDir := filepath.Join(netns.RepoRoot(), "bench", "out")
	rep, err := ReadJSON(filepath.Join(outDir, "report.json"))
	if err != nil {
		t.Fatal(err)
	}
	cfg := configs[rep.Meta.Mode]
	plots, err := rep.Plot(outDir)
	if err != nil {
		t.Fatal(err)
	}
	if err := rep.WriteMarkdown(outDir, cfg.lo, cfg.hi, plots); err != nil {
		t.Fatal(err)
	}
	fmt.Println(rep.SummaryTable(cfg.lo, cfg.hi))
	if err := rep.Validate(); err != nil {
		t.Errorf("the report is incomplete:\n%v", err)
	}
}
