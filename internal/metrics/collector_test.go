package metrics

import (
	"errors"
	"io"
	"log/slog"
	"strings"
	"testing"

	"github.com/prometheus/common/expfmt"

	"github.com/l7mp/stunnerd-xdp/bpf"
	"github.com/l7mp/stunnerd-xdp/internal/channelmap"
	"github.com/l7mp/stunnerd-xdp/internal/loader"
	"github.com/l7mp/stunnerd-xdp/internal/mirror"
	"github.com/l7mp/stunnerd-xdp/internal/nodelabel"
	"github.com/l7mp/stunnerd-xdp/internal/quota"
	"github.com/l7mp/stunnerd-xdp/internal/steering"
	"github.com/l7mp/stunnerd-xdp/internal/userspace"
)

// mirrorSource is a daemon that never loaded XDP: a real mirror, pion's
// counters and the listener accounting, no maps.
type mirrorSource struct {
	m        *mirror.Mirror
	counters userspace.Counters
	traffic  *Traffic
}

func (s *mirrorSource) AllocationCount() int                   { return 0 }
func (s *mirrorSource) Maps() *channelmap.Maps                 { return nil }
func (s *mirrorSource) TCVerdicts() ([]uint64, error)          { return nil, nil }
func (s *mirrorSource) Attached() map[string]loader.Mode       { return nil }
func (s *mirrorSource) Interfaces() []string                   { return []string{"eth0"} }
func (s *mirrorSource) UserspaceCounters() *userspace.Counters { return &s.counters }
func (s *mirrorSource) UserspaceBindings() map[string]int      { return s.m.UserspaceBindings() }
func (s *mirrorSource) NodeLabel() nodelabel.State             { return nodelabel.Absent }
func (s *mirrorSource) Steering() (*steering.Stats, error)     { return nil, nil }
func (s *mirrorSource) Traffic() *Traffic                      { return s.traffic }
func (s *mirrorSource) Quota() quota.Stats                     { return quota.Stats{} }
func (s *mirrorSource) Guards() Guards                         { return Guards{} }
func (s *mirrorSource) Kernel() Kernel {
	return Kernel{Release: "5.10.0-32-amd64", Program: ProgramRefused, TCEngine: "none", Handover: "off", Path: "userspace"}
}
func (s *mirrorSource) MirrorStats() (mirror.Stats, int) {
	_, chans := s.m.Counts()
	return s.m.Stats(), chans
}

// TestScrapeWithoutXDP: a daemon that never loaded XDP exports every series
// that has a value without traffic: the fast path's at zero (each userspace
// reason too, so that alerts on one work before the first binding takes it),
// STUNner's allocations and listener connections, Go's and the process's.
func TestScrapeWithoutXDP(t *testing.T) {
	m := mirror.New(slog.New(slog.NewTextHandler(io.Discard, nil)))
	defer m.Close()
	src := &mirrorSource{m: m, traffic: NewTraffic()}
	src.traffic.SetListeners([]Listener{{Name: "ns/udp"}})
	raw, _ := udpPair(t)
	src.traffic.ListenerConn("ns/udp", raw)
	out, err := scrapeText(t, src)
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range []string{
		`stunnerd_xdp_bindings_userspace{reason="nat"} 0`,
		`stunnerd_xdp_bindings_userspace{reason="no_offload_peer"} 0`,
		`stunnerd_xdp_bindings_userspace{reason="pending"} 0`,
		`stunnerd_xdp_bindings_userspace{reason="full"} 0`,
		`stunnerd_xdp_bindings_full_total 0`,
		`stunnerd_xdp_bindings_userspace{reason="xfrm"} 0`,
		`stunnerd_xdp_bindings_userspace{reason="client_conntrack"} 0`,
		`stunnerd_xdp_bindings_evicted_total{reason="conntrack_deleted"} 0`,
		`stunnerd_xdp_bindings_evicted_total{reason="xfrm"} 0`,
		`stunnerd_xdp_bindings_userspace{reason="program_refused"} 0`,
		`stunnerd_xdp_kernel_info{handover="off",program="refused",release="5.10.0-32-amd64",tc_engine="none",xdp_features="false"} 1`,
		`stunnerd_xdp_packets_total{direction="client_to_peer",path="xdp"} 0`,
		`stunnerd_xdp_mode{mode="off"} 1`,
		`stunnerd_xdp_attached{iface="eth0",mode="native"} 0`,
		`stunner_allocations_active{otel_scope_name="stunner",otel_scope_schema_url="",otel_scope_version=""} 0`,
		`stunner_listener_connections{name="ns/udp",otel_scope_name="stunner",otel_scope_schema_url="",otel_scope_version=""} 1`,
		`stunner_listener_connections_total{name="ns/udp",otel_scope_name="stunner",otel_scope_schema_url="",otel_scope_version=""} 1`,
		`stunner_listener_packets_total{direction="rx",name="ns/udp",otel_scope_name="stunner",otel_scope_schema_url="",otel_scope_version=""} 0`,
		`target_info{service_name="stunner"} 1`,
	} {
		if !strings.Contains(out, line+"\n") {
			t.Errorf("missing %s", line)
		}
	}
	for _, prefix := range []string{"go_goroutines ", "process_cpu_seconds_total "} {
		if !strings.Contains(out, "\n"+prefix) {
			t.Errorf("missing %s", prefix)
		}
	}
	if t.Failed() {
		t.Logf("scrape:\n%s", out)
	}
}

// tcSource is mirrorSource with the TC engine loaded: its verdict counters.
type tcSource struct {
	*mirrorSource
	verdicts []uint64
	err      error
}

func (s *tcSource) TCVerdicts() ([]uint64, error) { return s.verdicts, s.err }

// TestTCVerdicts: the TC engine's counters are exported under the shared
// reasons' names and its own, only while the engine is loaded; the indices
// between the two ranges are never series; an unreadable map is a scrape
// error, not zeros.
func TestTCVerdicts(t *testing.T) {
	m := mirror.New(slog.New(slog.NewTextHandler(io.Discard, nil)))
	defer m.Close()
	base := &mirrorSource{m: m, traffic: NewTraffic()}

	out, err := scrapeText(t, base)
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(out, "stunnerd_xdp_tc_verdicts_total") {
		t.Error("TC verdicts exported without the TC engine")
	}

	v := make([]uint64, bpf.RelayTcTcReasonTC_REASON_MAX)
	v[bpf.RelayReasonREASON_RELAY_C2P_REDIRECT] = 7
	v[bpf.RelayReasonREASON_STUN] = 3
	v[bpf.RelayTcTcReasonTC_REASON_GSO] = 2
	v[bpf.RelayTcTcReasonTC_REASON_PARTIAL_ELSEWHERE] = 5
	v[bpf.RelayTcTcReasonTC_REASON_REWRITE_FAILED] = 1
	out, err = scrapeText(t, &tcSource{mirrorSource: base, verdicts: v})
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range []string{
		`stunnerd_xdp_tc_verdicts_total{reason="relay_client_to_peer_redirect"} 7`,
		`stunnerd_xdp_tc_verdicts_total{reason="pass_stun"} 3`,
		`stunnerd_xdp_tc_verdicts_total{reason="pass_not_ours"} 0`,
		`stunnerd_xdp_tc_verdicts_total{reason="pass_gso"} 2`,
		`stunnerd_xdp_tc_verdicts_total{reason="pass_checksum_partial_elsewhere"} 5`,
		`stunnerd_xdp_tc_verdicts_total{reason="drop_rewrite_failed"} 1`,
	} {
		if !strings.Contains(out, line+"\n") {
			t.Errorf("missing %s", line)
		}
	}
	want := int(bpf.RelayReasonREASON_MAX) + len(channelmap.TCReasonNames)
	if n := strings.Count(out, "\nstunnerd_xdp_tc_verdicts_total{"); n != want {
		t.Errorf("%d TC verdict series, want %d (one per named reason)", n, want)
	}
	if t.Failed() {
		t.Logf("scrape:\n%s", out)
	}

	if _, err := scrapeText(t, &tcSource{mirrorSource: base, err: errors.New("map gone")}); err == nil {
		t.Error("an unreadable TC verdict map scraped without error")
	}
}

// scrapeText is the registry's scrape of src in the text format, and the
// gather's error (what it gathered is there still).
func scrapeText(t *testing.T, src Source) (string, error) {
	t.Helper()
	families, err := NewRegistry(src).Gather()
	var out strings.Builder
	for _, f := range families {
		if _, err := expfmt.MetricFamilyToText(&out, f); err != nil {
			t.Fatal(err)
		}
	}
	return out.String(), err
}
