package bench

import (
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestReportValidate runs unprivileged (also under -short): a report missing a
// row or holding a NaN must not pass, and a complete one renders.
func TestReportValidate(t *testing.T) {
	complete := func() *Report {
		r := &Report{Expected: ExpectedRows{ProgRun: []string{rowFloor}, RelayServers: []string{ServerXDPNative},
			RelayPoints: 1, LatencyServers: []string{ServerXDPNative}, IperfServers: []string{ServerXDPNative}, ScalingPoints: 1,
			LiveCost: []string{liveC2P4}, Memory: true}}
		r.LiveCost = []LiveCostRow{{Name: liveC2P4, Runs: 1, RelayNs: []float64{300}, FloorNs: []float64{60}, RelayMedianNs: 300, FloorMedianNs: 60, Ratio: 5}}
		r.Memory = []MemoryRow{{Bindings: 1, CPUs: 2, Maps: map[string]uint64{"c2p_bindings": 100}, Total: 100, Measured: true}}
		r.MapOps = []MapOpsRow{{Op: "install", Bindings: 1, PerSecond: 1, P99Us: 1}}
		r.ProgRun = []ProgRunRow{{Name: rowFloor, Runs: 1, MeanNs: 1, MedianNs: 1, FloorX: 1, Valid: true}}
		r.Relay = []RelayPoint{{Server: ServerXDPNative, Payload: 100, TargetPPS: 20000, Sent: 1, OfferedPPS: 1, DeliveredPPS: 1, XDPShare: 1, ProgNsPerRun: 300}}
		r.Latency = []LatencyRow{{Server: ServerXDPNative, Received: 1, P50Us: 1, P99Us: 1, P999Us: 1}}
		r.Iperf = []IperfRow{{Server: ServerXDPNative, Sent: 1}}
		r.Control = &ControlResult{Bindings: 1, Installed: 1, BindingsPerSecond: 1, MapBytesPerSlot: 1}
		r.Scaling = []ScalingPoint{{Channels: 1, Sent: 1, XDPRelayed: 1, ChannelsHit: 1}}
		r.Targets = []TargetResult{{Target: "t"}}
		return r
	}
	if err := complete().Validate(); err != nil {
		t.Fatalf("complete report: %v", err)
	}
	for name, spoil := range map[string]func(r *Report){
		"missing prog row":   func(r *Report) { r.ProgRun = nil },
		"missing relay":      func(r *Report) { r.Relay = nil },
		"NaN cpu":            func(r *Report) { r.Relay[0].TotalUsPerPkt = math.NaN() },
		"missing latency":    func(r *Report) { r.Latency = nil },
		"missing iperf":      func(r *Report) { r.Iperf = nil },
		"missing control":    func(r *Report) { r.Control = nil },
		"scaling unreached":  func(r *Report) { r.Scaling[0].ChannelsHit = 0 },
		"wrong verdicts":     func(r *Report) { r.ProgRun[0].WrongRets = 3 },
		"missing targets":    func(r *Report) { r.Targets = nil },
		"no scaling at all":  func(r *Report) { r.Scaling = nil },
		"nothing sent relay": func(r *Report) { r.Relay[0].Sent = 0 },
		"no program cost":    func(r *Report) { r.Relay[0].ProgNsPerRun = 0 },
		"missing live cost":  func(r *Report) { r.LiveCost = nil },
		"live cost no ratio": func(r *Report) { r.LiveCost[0].Ratio = 0 },
		"missing memory":     func(r *Report) { r.Memory = nil },
		"missing map ops":    func(r *Report) { r.MapOps = nil },
	} {
		r := complete()
		spoil(r)
		if err := r.Validate(); err == nil {
			t.Errorf("%s: Validate passed", name)
		}
	}
	dir := t.TempDir()
	r := complete()
	if err := r.WriteMarkdown(dir, 20000, 100000, nil); err != nil {
		t.Fatal(err)
	}
	if err := r.WriteJSON(dir); err != nil {
		t.Fatal(err)
	}
	md, err := os.ReadFile(filepath.Join(dir, "report.md"))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(md), "| "+ServerXDPNative+" |") {
		t.Errorf("report.md has no row for %s:\n%s", ServerXDPNative, md)
	}
	for _, want := range []string{"| " + liveC2P4 + " |", "### Map memory", "### Binding writes at scale"} {
		if !strings.Contains(string(md), want) {
			t.Errorf("report.md has no %q", want)
		}
	}
}

func TestFormat(t *testing.T) {
	for _, tc := range []struct {
		v    float64
		d    int
		want string
	}{{1234567.891, 0, "1,234,568"}, {-1234.5, 1, "-1,234.5"}, {12, 2, "12.00"}, {math.NaN(), 1, "–"}} {
		if got := f(tc.v, tc.d); got != tc.want {
			t.Errorf("f(%v, %d) = %q, want %q", tc.v, tc.d, got, tc.want)
		}
	}
}
