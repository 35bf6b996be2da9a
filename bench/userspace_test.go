package bench

import (
	"fmt"
	"net"
	"os"
	"runtime"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// ---- stage: the userspace relays side by side (issue 12, items 3 and 4) ----
//
// stunnerd-xdp without XDP at one read loop, at one per CPU and at the
// operator's 16 (the flag the operator gives stunnerd, which stunnerd-xdp
// takes too), coturn with its default thread model, and STUNner's current
// stunnerd (v1.2.1) with one read loop per CPU and with the operator's 16. Several allocations carry the load
// (one client socket each): the kernel's SO_REUSEPORT hash keeps a 4-tuple on
// one socket, so a single flow can never use more than one read loop.

// userspaceFlows is the number of allocations the generator spreads over.
const userspaceFlows = 4

// daemonThreadsSpec runs stunnerd-xdp in userspace with threads read loops
// per listener (0: its default, one per CPU).
func daemonThreadsSpec(name string, threads int) serverSpec {
	base := daemonSpec(name, "off", false)
	return serverSpec{name: name, xdpMode: "off", argv: func(h *harness, dir string) []string {
		argv := base.argv(h, dir)
		return append(argv[:len(argv)-1], "--udp-thread-num="+strconv.Itoa(threads), argv[len(argv)-1])
	}}
}

func stunnerd121Spec(name string, threads int) serverSpec {
	return serverSpec{name: name, argv: func(h *harness, _ string) []string {
		return []string{h.stunnerd121Bin, "-l", "all:WARN", "-u", strconv.Itoa(threads), turnURI}
	}}
}

var (
	specUser1        = daemonThreadsSpec(ServerUser1, 1)
	specUserN        = daemonThreadsSpec(ServerUserN, runtime.NumCPU())
	specUser16       = daemonThreadsSpec(ServerUser16, 16)
	specStunnerd121N = stunnerd121Spec(ServerStunnerd121N, runtime.NumCPU())
	specStunnerd1216 = stunnerd121Spec(ServerStunnerd12116, 16)
)

// userspaceSpecs are the stage's servers, in the report's order, each with
// the key BENCH_USERSPACE names it by.
var userspaceSpecs = []struct {
	key  string
	spec serverSpec
}{
	{"user1", specUser1}, {"userN", specUserN}, {"user16", specUser16}, {"coturn", specCoturn},
	{"stunnerd121N", specStunnerd121N}, {"stunnerd12116", specStunnerd1216},
}

// userspaceOnly is the stage's servers, or with BENCH_USERSPACE (debugging,
// comma-separated keys) only those named; the report is then incomplete.
func userspaceOnly() []serverSpec {
	only := os.Getenv("BENCH_USERSPACE")
	var out []serverSpec
	for _, s := range userspaceSpecs {
		if only == "" || listed(only, s.key) {
			out = append(out, s.spec)
		}
	}
	return out
}

// stageUserspace runs the servers in turns: round r starts with the r-th
// server, so that none is always first or last, and a drift of the shared
// machine's load falls on every server.
func (h *harness) stageUserspace(t *testing.T) {
	specs := userspaceOnly()
	for round := 1; round <= h.cfg.userspaceRounds; round++ {
		for i := range specs {
			spec := specs[(i+round-1)%len(specs)]
			t.Run(fmt.Sprintf("round%d/%s", round, spec.name), func(t *testing.T) { h.userspaceOne(t, spec, round) })
		}
	}
}

func (h *harness) userspaceOne(t *testing.T, spec serverSpec, round int) {
	rs := h.startServer(t, spec)
	defer h.stopServer(t, rs)
	var streams []*stream
	// BENCH_USERSPACE_P2C (debugging: the report's rows then hold the other
	// direction): the sink sends to each allocation's relay address, on the
	// channel bound to it, and the client namespace counts what arrives.
	h.userspaceP2C = os.Getenv("BENCH_USERSPACE_P2C") != ""
	defer func() { h.userspaceP2C = false }()
	sinkFd, err := fdOf(h.peers.sink)
	if err != nil {
		t.Fatal(err)
	}
	for range userspaceFlows {
		sess := newSession(t, h, listenAddr)
		defer sess.close()
		if h.userspaceP2C {
			relay := sess.relay.LocalAddr().(*net.UDPAddr)
			streams = append(streams, &stream{fd: sinkFd, dst: sockaddr(relay.IP, relay.Port), payloads: [][]byte{make([]byte, 100)}})
			continue
		}
		streams = append(streams, sess.stream(100))
	}
	pids := []int{rs.proc.PID()}
	// rung measures one rung and records it.
	rung := func(rate float64, pinned, search bool) RelayPoint {
		p := h.measure(t, spec, streams, rate, pids)
		p.Payload, p.Pinned, p.Search, p.Flows, p.Round = 100, pinned, search, userspaceFlows, round
		h.rep.Userspace = append(h.rep.Userspace, p)
		target := rateLabel(p.TargetPPS)
		if p.Search {
			target += " (search)"
		}
		t.Logf("round %d: %s target %s pinned %v: offered %.0f delivered %.0f pps, loss %.2f %%, server %.2f µs/pkt (process %.2f + softirq %.2f)",
			round, spec.name, target, pinned, p.OfferedPPS, p.DeliveredPPS, p.LossPercent, p.TotalUsPerPkt, p.ProcUsPerPkt, p.SoftUsPerPkt)
		return p
	}
	ladder := h.cfg.userspaceLadder
	if l := os.Getenv("BENCH_USERSPACE_LADDER"); l != "" { // debugging: these rungs only (comma-separated pps, 0 = max)
		ladder = nil
		for _, f := range strings.Split(l, ",") {
			r, err := strconv.ParseFloat(f, 64)
			if err != nil {
				t.Fatalf("BENCH_USERSPACE_LADDER: %v", err)
			}
			ladder = append(ladder, r)
		}
	}
	for _, rate := range ladder {
		rung(rate, false, false)
	}
	// The pinned rungs: the generator on CPU 0 and the relay on the other
	// CPUs, so that the relay, not a generator short of CPU, sets the
	// loss-free rate (the softirq of the client->server veth still runs where
	// the generator sends).
	if runtime.NumCPU() < 2 {
		t.Fatalf("the pinned rungs need 2 CPUs, have %d", runtime.NumCPU())
	}
	restore := pin(t, os.Getpid(), cpuSet(0))
	defer restore()
	restoreServer := pin(t, rs.proc.PID(), cpuSet(cpusFrom(1)...))
	defer restoreServer()
	var points []RelayPoint
	for _, rate := range h.cfg.userspacePinned {
		points = append(points, rung(rate, true, false))
	}
	// The loss-free search: halve the gap between the highest pinned rung
	// carried loss-free and the next one up, as RFC 2544 searches for a
	// throughput.
	if lo, hi, ok := searchBounds(points); ok {
		for range h.cfg.userspaceSearch {
			rate := searchNext(lo, hi)
			if p := rung(rate, true, true); p.LossPercent <= lossFree {
				lo = rate
			} else {
				hi = rate
			}
		}
	}
	rung(0, true, false)
}

func cpusFrom(first int) []int {
	var out []int
	for c := first; c < runtime.NumCPU(); c++ {
		out = append(out, c)
	}
	return out
}

func cpuSet(cpus ...int) unix.CPUSet {
	var s unix.CPUSet
	for _, c := range cpus {
		s.Set(c)
	}
	return s
}

// pin sets the CPU affinity of every thread of pid (threads made later
// inherit it from their creator) and returns what allows every CPU again.
func pin(t *testing.T, pid int, set unix.CPUSet) func() {
	t.Helper()
	pinned := 0
	for _, tid := range tasks(pid) {
		if unix.SchedSetaffinity(tid, &set) == nil {
			pinned++
		}
	}
	if pinned == 0 {
		t.Fatalf("pid %d: no thread pinned", pid)
	}
	return func() {
		all := cpuSet(cpusFrom(0)...)
		for _, tid := range tasks(pid) {
			_ = unix.SchedSetaffinity(tid, &all)
		}
	}
}

// tasks are the thread ids of pid.
func tasks(pid int) []int {
	dir, _ := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	var out []int
	for _, task := range dir {
		if tid, err := strconv.Atoi(task.Name()); err == nil {
			out = append(out, tid)
		}
	}
	return out
}
