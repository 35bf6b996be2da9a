package daemon

import (
	"fmt"
	"net"
	"net/netip"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/l7mp/stunnerd-xdp/internal/loader"
	"github.com/l7mp/stunnerd-xdp/internal/logging"
	"github.com/l7mp/stunnerd-xdp/internal/mirror"
	"github.com/l7mp/stunnerd-xdp/internal/offload"
	"github.com/l7mp/stunnerd-xdp/test/netns"
	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// TestProgramRefused: on a kernel whose verifier refuses the program (5.10,
// 6.1 and 6.12 refused it at 4342c15), the daemon loads it once, not at
// every retry tick nor link event; it serves from userspace and says so:
// /status's kernel section and path, the kernel_info metric, and the
// bindings count as program_refused instead of every gauge at 0.
func TestProgramRefused(t *testing.T) {
	var loads atomic.Int32
	refuse := func(loader.Config) (offload.Program, mirror.Offload, error) {
		loads.Add(1)
		return nil, nil, &ebpf.VerifierError{Cause: unix.EACCES, Log: []string{
			"1234: (0f) r6 += r1",
			"math between pkt pointer and register with unbounded min value is not allowed",
			"processed 2002 insns (limit 1000000)"}}
	}
	d, listen := startOnLoopback(t, func(listen netip.AddrPort) Config {
		return Config{Listen: listen, Users: map[string]string{"u": "p"}, RelayAddress: listen.Addr(),
			MinRelayPort: 64000, MaxRelayPort: 64999, Interfaces: []string{"lo"},
			XDPRetryInterval: 10 * time.Millisecond, UDPThreadNum: 1, load: refuse,
			AllowPeers: []netip.Prefix{netip.MustParsePrefix("127.0.0.1/32")}}
	})
	for range 5 {
		d.linkEvents <- struct{}{} // a link event retries what can change
	}
	time.Sleep(200 * time.Millisecond) // 20 retry ticks
	if n := loads.Load(); n != 1 {
		t.Fatalf("the refused program was loaded %d times, want once", n)
	}

	relay, err := allocateUser(t, listen, "u", "p", false)
	if err != nil {
		t.Fatal(err)
	}
	peer, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	defer peer.Close()
	// pion's client binds a channel to the first peer it writes to.
	if _, err := relay.WriteTo([]byte("bind"), peer.LocalAddr()); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "the channel binding counted as program_refused", 5*time.Second, func() bool {
		return d.UserspaceBindings()[mirror.ReasonRefused] == 1
	})

	st := d.Status()
	k := st.XDP.Kernel
	if st.Status != "READY" || len(st.XDP.Attached) != 0 || k.Path != "userspace" || k.Program != "refused" ||
		k.Userspace != mirror.ReasonRefused || !strings.Contains(k.Refused, "unbounded min value") || strings.Contains(k.Refused, "\n") {
		t.Errorf("/status: %s, attached %v, kernel %+v; want READY, nothing attached, path userspace, program refused with the verifier's last line",
			st.Status, st.XDP.Attached, k)
	}
	if k.Release == "" || k.Handover != "off" || k.TCEngine != "none" {
		t.Errorf("kernel %+v: want the release, handover off, no TC engine", k)
	}
	mfs, err := d.Registry().Gather()
	if err != nil {
		t.Fatal(err)
	}
	var info, refused bool
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			labels := map[string]string{}
			for _, l := range m.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			switch mf.GetName() {
			case "stunnerd_xdp_kernel_info":
				info = labels["program"] == "refused" && labels["release"] == k.Release && m.GetGauge().GetValue() == 1
			case "stunnerd_xdp_bindings_userspace":
				if labels["reason"] == mirror.ReasonRefused {
					refused = m.GetGauge().GetValue() == 1
				}
			}
		}
	}
	if !info || !refused {
		t.Errorf("metrics: kernel_info{program=refused} %v, bindings_userspace{reason=program_refused} 1 %v; want both", info, refused)
	}
}

// TestKernelReport: the real program on this kernel, with the default mode
// (auto) and the TC engine. The daemon's kernel line, /status and
// kernel_info agree with what happened: loaded and attached (path xdp), or
// refused by this kernel's verifier (path userspace, one WARN, loaded once
// over 15 retry ticks and 3 link events); never path xdp with nothing
// attached. xdp_features is true from 6.3 on, the handover on from 5.14. Run on each guest kernel by
// test/kernels/kernels.sh.
func TestKernelReport(t *testing.T) {
	if !testenv.InNetns() {
		netns.RequirePrivileged(t)
		ns := netns.NewNS(t, "kernel")
		testenv.RunInNetns(t, ns.Name, 2*time.Minute)
		return
	}
	addr := netip.MustParseAddr("10.99.0.1")
	addLink(t, "kv0", addr)
	logs := &testenv.LockedBuffer{}
	lf, err := logging.New("all:INFO", "text", logs)
	if err != nil {
		t.Fatal(err)
	}
	d, err := Start(Config{
		Listen: netip.AddrPortFrom(addr, 3478), Users: map[string]string{"u": "p"}, RelayAddress: addr,
		MinRelayPort: 64000, MaxRelayPort: 64999, Interfaces: []string{"kv0"},
		XDPRetryInterval: 20 * time.Millisecond, TCEngine: true, Logger: lf, SteeringDir: testenv.BPFFS(t),
	})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	for range 3 {
		d.linkEvents <- struct{}{}
	}
	time.Sleep(300 * time.Millisecond)
	k := d.Kernel()
	t.Logf("kernel: %+v; attached %v", k, d.Attached())

	var u unix.Utsname
	if err := unix.Uname(&u); err != nil {
		t.Fatal(err)
	}
	release := unix.ByteSliceToString(u.Release[:])
	var major, minor int
	if _, err := fmt.Sscanf(release, "%d.%d", &major, &minor); err != nil {
		t.Fatal(err)
	}
	from := func(ma, mi int) bool { return major > ma || major == ma && minor >= mi }
	if k.Release != release || k.XDPFeatures != from(6, 3) {
		t.Errorf("release %q, xdp features %v on %s", k.Release, k.XDPFeatures, release)
	}
	// The handover's steering program reads sk_reuseport_md.migrating_sk.
	if want := map[bool]string{true: "on", false: "unavailable"}[from(5, 14)]; k.Handover != want {
		t.Errorf("handover %q on %s, want %q", k.Handover, release, want)
	}
	line := ""
	for _, l := range strings.Split(logs.String(), "\n") {
		if strings.Contains(l, "msg=kernel ") {
			line = l
		}
	}
	if line == "" || strings.Count(logs.String(), "msg=kernel ") != 1 {
		t.Fatalf("want one kernel line:\n%s", logs.String())
	}
	st := d.Status()
	if st.XDP.Kernel != k || st.Status != "READY" {
		t.Errorf("/status: %s, kernel %+v; want READY and %+v", st.Status, st.XDP.Kernel, k)
	}
	switch k.Program {
	case "loaded":
		if k.Path != "xdp" || len(d.Attached()) == 0 || !strings.Contains(line, "path=xdp") || k.Userspace != "" {
			t.Errorf("loaded: path %q, attached %v, userspace reason %q, line %q", k.Path, d.Attached(), k.Userspace, line)
		}
	case "refused":
		if k.Path != "userspace" || len(d.Attached()) != 0 || !strings.Contains(line, "path=userspace") ||
			k.Userspace != "program_refused" || k.Refused == "" {
			t.Errorf("refused: path %q, attached %v, userspace reason %q, refused %q, line %q", k.Path, d.Attached(), k.Userspace, k.Refused, line)
		}
		if n := strings.Count(logs.String(), "the kernel refused the XDP program"); n != 1 {
			t.Errorf("the refusal was said %d times, want once (not retried):\n%s", n, logs.String())
		}
	default:
		t.Errorf("program %q after start, want loaded or refused:\n%s", k.Program, logs.String())
	}
}
