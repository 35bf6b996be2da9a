package daemon

import (
	"net"
	"net/netip"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/l7mp/stunnerd-xdp/internal/loader"
	"github.com/l7mp/stunnerd-xdp/test/netns"
	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// TestTCVerdictsScraped: with the TC engine loaded (as the command's default
// --tc-engine does), the daemon's scrape carries the engine's own verdict
// counters. Frames that are not IP, sent into the XDP interface from its veth
// peer, pass XDP and then the TC engine at tcx ingress, which counts each as
// pass_not_ip; the scrape shows them under stunnerd_xdp_tc_verdicts_total.
func TestTCVerdictsScraped(t *testing.T) {
	if !testenv.InNetns() {
		netns.RequirePrivileged(t)
		ns := netns.NewNS(t, "tcverdicts")
		testenv.RunInNetns(t, ns.Name, 2*time.Minute)
		return
	}
	d := startOnLink(t, "xt0", netip.MustParseAddr("10.99.0.1"), true)
	if got := d.Attached(); got["xt0"] != loader.ModeGeneric {
		t.Fatalf("attached %v, want xt0 in generic mode", got)
	}
	before := tcVerdict(t, d, "pass_not_ip")
	if before < 0 {
		t.Fatal(`no stunnerd_xdp_tc_verdicts_total{reason="pass_not_ip"} with the TC engine loaded`)
	}

	const frames = 3
	sendNonIP(t, "xt0p", "xt0", frames)
	eventually(t, 5*time.Second, "the TC engine's pass_not_ip verdicts in the scrape", func() bool {
		return tcVerdict(t, d, "pass_not_ip") >= before+frames
	})
}

// tcVerdict is the scraped stunnerd_xdp_tc_verdicts_total of the reason, -1
// when the scrape has no such series.
func tcVerdict(t *testing.T, d *Daemon, reason string) float64 {
	t.Helper()
	mfs, err := d.Registry().Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != "stunnerd_xdp_tc_verdicts_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, lp := range m.GetLabel() {
				if lp.GetName() == "reason" && lp.GetValue() == reason {
					return m.GetCounter().GetValue()
				}
			}
		}
	}
	return -1
}

// sendNonIP sends n minimal Ethernet frames of a local experimental
// EtherType (IEEE 802 0x88B5, no IP) out of from, addressed to to's MAC: on a
// veth pair they arrive at to's ingress.
func sendNonIP(t *testing.T, from, to string, n int) {
	t.Helper()
	src, err := net.InterfaceByName(from)
	if err != nil {
		t.Fatal(err)
	}
	dst, err := net.InterfaceByName(to)
	if err != nil {
		t.Fatal(err)
	}
	// Protocol 0: the socket only sends.
	fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_RAW, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	frame := make([]byte, 60)
	copy(frame[0:6], dst.HardwareAddr)
	copy(frame[6:12], src.HardwareAddr)
	frame[12], frame[13] = 0x88, 0xb5
	sa := &unix.SockaddrLinklayer{Ifindex: src.Index, Protocol: 0xb588, Halen: 6}
	copy(sa.Addr[:], dst.HardwareAddr)
	for range n {
		if err := unix.Sendto(fd, frame, 0, sa); err != nil {
			t.Fatal(err)
		}
	}
}
