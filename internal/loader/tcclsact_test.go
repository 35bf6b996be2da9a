package loader_test

import (
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/l7mp/stunnerd-xdp/internal/loader"
	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// TestTCClsactQdiscs: with clsact, the engine's filter goes last onto the
// ingress qdisc a device has (the bandwidth plugin's ingress qdisc, a
// CNI's clsact), and onto a clsact qdisc of its own where there is none; at
// Close it removes its filters and only the qdisc it made.
func TestTCClsactQdiscs(t *testing.T) {
	ns, cfg, log := tcTestNS(t)
	_, _, do := tcChecks(t, ns)
	var tc *loader.TC
	do(func() error {
		for _, n := range []string{"bare", "bw", "cls"} {
			if err := addVeth(n); err != nil {
				return err
			}
		}
		if err := bandwidthPlugin("bw"); err != nil {
			return err
		}
		if err := netlink.QdiscAdd(clsactQdisc("cls")); err != nil {
			return err
		}
		var err error
		if tc, err = loadTC(t, ns, cfg, log, loader.TCAttachClsact); err != nil {
			return err
		}
		_, err = tc.AttachMatching("bare", "bw", "cls")
		return err
	})
	for name, qdisc := range map[string]string{"bare": "clsact", "bw": "ingress", "cls": "clsact"} {
		if got := ingressQdisc(t, ns, name); got != qdisc {
			t.Errorf("%s: ingress qdisc %q, want %q", name, got, qdisc)
		}
		do(func() error {
			fs, err := ingressFilters(name)
			if err != nil {
				return err
			}
			last := fs[len(fs)-1]
			b, ok := last.(*netlink.BpfFilter)
			if !ok || b.Name != "stunnerd-xdp" || !b.DirectAction || last.Attrs().Priority != 0xffff {
				return fmt.Errorf("%s: the last ingress filter is %+v, want the engine's, direct-action, at priority 65535", name, last)
			}
			if name == "bw" {
				if _, ok := fs[0].(*netlink.U32); !ok || len(fs) != 2 {
					return fmt.Errorf("bw: filters %+v, want the plugin's u32, then the engine's", fs)
				}
			}
			return nil
		})
	}
	do(tc.Close)
	for name, qdisc := range map[string]string{"bare": "", "bw": "ingress", "cls": "clsact"} {
		if got := ingressQdisc(t, ns, name); got != qdisc {
			t.Errorf("%s after Close: ingress qdisc %q, want %q", name, got, qdisc)
		}
		if n := tcEngines(t, ns, name); n != 0 {
			t.Errorf("%s after Close: %d TC engines", name, n)
		}
	}
	do(func() error {
		if fs, err := ingressFilters("bw"); err != nil || len(fs) != 1 {
			return fmt.Errorf("bw after Close: filters %+v (%v), want the plugin's", fs, err)
		}
		return nil
	})
}

// TestTCOrderBesideBandwidthPlugin: traffic control keeps its say with
// clsact. On a pod's host veth with the CNI bandwidth plugin's egress limit
// (an ingress qdisc, a match-all u32 whose mirred steals every frame to an
// ifb), the engine's filter, last, sees none of the pod's frames; tcx runs
// before every tc filter and sees them all (issue 35's first row).
func TestTCOrderBesideBandwidthPlugin(t *testing.T) {
	forEachTCAttach(t, func(t *testing.T, how loader.TCAttach) {
		ns, cfg, log := tcTestNS(t)
		_, _, do := tcChecks(t, ns)
		var tc *loader.TC
		do(func() error {
			for _, n := range []string{"bw", "plain"} {
				if err := addVeth(n); err != nil {
					return err
				}
				if err := setUp("p" + n); err != nil {
					return err
				}
			}
			if err := bandwidthPlugin("bw"); err != nil {
				return err
			}
			var err error
			if tc, err = loadTC(t, ns, cfg, log, how); err != nil {
				return err
			}
			_, err = tc.AttachMatching("bw", "plain")
			return err
		})
		const frames = 50
		seen := func(into string) uint64 {
			t.Helper()
			before := verdictSum(t, tc)
			do(func() error { return testenv.SendNonIP("p"+into, into, frames) })
			var n uint64
			for deadline := time.Now().Add(2 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
				if n = verdictSum(t, tc) - before; n >= frames {
					break
				}
			}
			return n
		}
		if n := seen("plain"); n < frames {
			t.Fatalf("plain veth: the engine saw %d of %d frames", n, frames)
		}
		// The counters are the engine's, not the device's: what else
		// arrives on plain (IPv6 neighbour discovery) must not count below.
		do(func() error { return tc.Detach("plain") })
		n := seen("bw")
		t.Logf("%s: the engine saw %d of %d frames behind the bandwidth plugin's filter", how, n, frames)
		switch how {
		case loader.TCAttachClsact:
			if n != 0 {
				t.Errorf("clsact: the engine saw %d frames the plugin's filter had taken first", n)
			}
		case loader.TCAttachTCX:
			if n < frames {
				t.Errorf("tcx: the engine saw %d of %d frames: tcx no longer runs before tc filters?", n, frames)
			}
		}
	})
}

// TestTCClsactSweep: filters outlive the process that made them. A new
// engine removes those of a daemon that is gone (its handle unclaimed) and
// leaves those of a live one (another Gateway's, or the previous pod's of a
// rolling update), and the live ones get handles of their own.
func TestTCClsactSweep(t *testing.T) {
	ns, cfg, log := tcTestNS(t)
	_, _, do := tcChecks(t, ns)
	var prog *loader.Program
	var live, next *loader.TC
	do(func() error {
		for _, n := range []string{"a", "b"} {
			if err := addVeth(n); err != nil {
				return err
			}
		}
		var err error
		if prog, err = loader.Load(cfg, log); err != nil {
			return err
		}
		t.Cleanup(func() { _ = ns.Do(prog.Close) })
		if live, err = prog.LoadTCWith(loader.TCAttachClsact); err != nil {
			return err
		}
		t.Cleanup(func() { _ = ns.Do(live.Close) })
		if err := live.Attach("a"); err != nil {
			return err
		}
		// A crashed daemon's filter: the engine's name, priority and a
		// handle of the range that no process holds.
		l, err := netlink.LinkByName("b")
		if err != nil {
			return err
		}
		if err := netlink.QdiscAdd(clsactQdisc("b")); err != nil {
			return err
		}
		stale := &netlink.BpfFilter{FilterAttrs: netlink.FilterAttrs{LinkIndex: l.Attrs().Index, Parent: netlink.HANDLE_MIN_INGRESS,
			Handle: loader.ClsactHandleBase + 7, Priority: 0xffff, Protocol: unix.ETH_P_ALL},
			Fd: live.Prog().FD(), Name: "stunnerd-xdp", DirectAction: true}
		if err := netlink.FilterAdd(stale); err != nil {
			return err
		}
		if next, err = prog.LoadTCWith(loader.TCAttachClsact); err != nil {
			return err
		}
		t.Cleanup(func() { _ = ns.Do(next.Close) })
		return next.Attach("a")
	})
	swept, err := next.Swept()
	if err != nil || !slices.Equal(swept, []string{"b"}) {
		t.Errorf("swept %v (%v), want b", swept, err)
	}
	if n := tcEngines(t, ns, "b"); n != 0 {
		t.Errorf("b: %d engines' filters left, want the stale one removed", n)
	}
	if n := tcEngines(t, ns, "a"); n != 2 {
		t.Errorf("a: %d engines' filters, want the live engine's and the new one's", n)
	}
	do(live.Close)
	if n := tcEngines(t, ns, "a"); n != 1 {
		t.Errorf("a: %d engines' filters after the first engine's Close, want the new one's", n)
	}
}

// TestTCReconfigureSwapsTheHook: Reconfigure puts the new program into the
// tcx link or the cls_bpf filter in place.
func TestTCReconfigureSwapsTheHook(t *testing.T) {
	forEachTCAttach(t, func(t *testing.T, how loader.TCAttach) {
		ns, cfg, log := tcTestNS(t)
		_, _, do := tcChecks(t, ns)
		do(func() error {
			if err := addVeth("a"); err != nil {
				return err
			}
			prog, err := loader.Load(cfg, log)
			if err != nil {
				return err
			}
			defer prog.Close()
			tc, err := prog.LoadTCWith(how)
			if err != nil {
				return err
			}
			defer tc.Close()
			if err := tc.Attach("a"); err != nil {
				return err
			}
			cfg.ListenerPorts = []uint16{3479}
			if err := prog.Reconfigure(cfg); err != nil {
				return err
			}
			if err := tc.Reconfigure(prog); err != nil {
				return err
			}
			info, err := tc.Prog().Info()
			if err != nil {
				return err
			}
			want, _ := info.ID()
			got, err := testenv.IngressPrograms("a")
			if err != nil {
				return err
			}
			if !slices.Equal(got, []ebpf.ProgramID{want}) {
				return fmt.Errorf("a runs programs %v, want the new one, %d", got, want)
			}
			return nil
		})
	})
}

// TestTCDiscoverWaitsForTheCNI: with clsact, discovery leaves a new device
// alone for a while, so that the CNI chain's bandwidth plugin can add its
// ingress qdisc (an exclusive create, which a clsact qdisc already there
// fails); then the engine's filter goes onto that qdisc, last.
func TestTCDiscoverWaitsForTheCNI(t *testing.T) {
	ns, cfg, log := tcTestNS(t)
	pod := testenv.NewNSWorker(t)
	_, eventually, do := tcChecks(t, ns)
	stop := make(chan struct{})
	do(func() error {
		tc, err := loadTC(t, ns, cfg, log, loader.TCAttachClsact)
		if err != nil {
			return err
		}
		t.Cleanup(func() { close(stop) })
		loader.SetSettle(tc, 500*time.Millisecond)
		return tc.Discover(stop, loader.DefaultTCPatterns, log)
	})
	do(func() error {
		if err := addPodVeth("eni1a2b3c4d", pod); err != nil {
			return err
		}
		// The main plugin is done: the bandwidth plugin runs next.
		return bandwidthPlugin("eni1a2b3c4d")
	})
	eventually("eni1a2b3c4d", 1)
	if q := ingressQdisc(t, ns, "eni1a2b3c4d"); q != "ingress" {
		t.Errorf("eni1a2b3c4d: ingress qdisc %q, want the plugin's", q)
	}
}

// TestTCPodVeths: with the default patterns the engine attaches to every
// pod's host-side veth whatever the CNI calls it (EKS eni*, AKS azv*, Calico
// cali*), whether the CNI made the pair in the pod's namespace and moved the
// host end out, or made it on the node and moved the pod's end in; present at
// start or appearing later; and to no veth whose both ends are on the node.
func TestTCPodVeths(t *testing.T) {
	forEachTCAttach(t, func(t *testing.T, how loader.TCAttach) {
		ns, cfg, log := tcTestNS(t)
		pod := testenv.NewNSWorker(t)
		tcx, eventually, do := tcChecks(t, ns)
		stop := make(chan struct{})
		do(func() error {
			if err := addPodVeth("eni1a2b3c4d", pod); err != nil {
				return err
			}
			if err := addVeth("veth0"); err != nil { // both ends on the node
				return err
			}
			tc, err := loadTC(t, ns, cfg, log, how)
			if err != nil {
				return err
			}
			t.Cleanup(func() { close(stop) })
			return tc.Discover(stop, loader.DefaultTCPatterns, log)
		})
		eventually("eni1a2b3c4d", 1)
		if err := podMakesVeth("azv1234abcd", pod, ns); err != nil {
			t.Fatal(err)
		}
		do(func() error {
			if err := addPodVeth("cali0a1b2c3", pod); err != nil {
				return err
			}
			return addVeth("veth1")
		})
		eventually("azv1234abcd", 1)
		eventually("cali0a1b2c3", 1)
		time.Sleep(testSettle + 200*time.Millisecond)
		for _, n := range []string{"veth0", "pveth0", "veth1", "pveth1"} {
			if tcx(n) != 0 {
				t.Errorf("%s (its peer on the node) attached", n)
			}
		}
	})
}

// bandwidthPlugin sets up what the CNI bandwidth plugin makes for a pod's
// egress limit on its host-side veth: an ingress qdisc (an exclusive create)
// and a match-all u32 filter whose mirred action steals every frame to an
// ifb device (where a TBF shapes it).
func bandwidthPlugin(veth string) error {
	l, err := netlink.LinkByName(veth)
	if err != nil {
		return err
	}
	la := netlink.NewLinkAttrs()
	la.Name = "bwp" + veth[:min(len(veth), 8)]
	if err := netlink.LinkAdd(&netlink.Ifb{LinkAttrs: la}); err != nil {
		return fmt.Errorf("ifb: %w", err)
	}
	if err := setUp(la.Name); err != nil {
		return err
	}
	ifb, err := netlink.LinkByName(la.Name)
	if err != nil {
		return err
	}
	ingress := &netlink.Ingress{QdiscAttrs: netlink.QdiscAttrs{LinkIndex: l.Attrs().Index,
		Handle: netlink.MakeHandle(0xffff, 0), Parent: netlink.HANDLE_INGRESS}}
	if err := netlink.QdiscAdd(ingress); err != nil {
		return fmt.Errorf("the plugin's ingress qdisc: %w", err)
	}
	mirred := netlink.NewMirredAction(ifb.Attrs().Index)
	return netlink.FilterAdd(&netlink.U32{
		FilterAttrs: netlink.FilterAttrs{LinkIndex: l.Attrs().Index, Parent: netlink.MakeHandle(0xffff, 0), Priority: 1, Protocol: unix.ETH_P_ALL},
		Actions:     []netlink.Action{mirred},
	})
}

func clsactQdisc(name string) netlink.Qdisc {
	l, _ := netlink.LinkByName(name)
	idx := 0
	if l != nil {
		idx = l.Attrs().Index
	}
	return &netlink.GenericQdisc{QdiscType: "clsact", QdiscAttrs: netlink.QdiscAttrs{LinkIndex: idx,
		Handle: netlink.MakeHandle(0xffff, 0), Parent: netlink.HANDLE_CLSACT}}
}

// ingressFilters lists the device's ingress filters in the order they run
// (the kernel dumps them by priority).
func ingressFilters(name string) ([]netlink.Filter, error) {
	l, err := netlink.LinkByName(name)
	if err != nil {
		return nil, err
	}
	fs, err := netlink.FilterList(l, netlink.HANDLE_MIN_INGRESS)
	if err == nil && len(fs) == 0 {
		err = errors.New("no filter")
	}
	return fs, err
}

// addPodVeth adds a pod's veth as Cilium and Calico make it: the pair on the
// node, then the pod's end ("eth0") moved into the pod's namespace and up.
func addPodVeth(host string, pod *testenv.NSWorker) error {
	la := netlink.NewLinkAttrs()
	la.Name = host
	if err := netlink.LinkAdd(&netlink.Veth{LinkAttrs: la, PeerName: "p" + host}); err != nil {
		return err
	}
	peer, err := netlink.LinkByName("p" + host)
	if err != nil {
		return err
	}
	if err := netlink.LinkSetNsFd(peer, int(pod.NS)); err != nil {
		return err
	}
	if err := setUp(host); err != nil {
		return err
	}
	return pod.Do(func() error { return setUp("p" + host) })
}

// podMakesVeth adds a pod's veth as the CNI plugins' ip.SetupVeth makes it:
// the pair in the pod's namespace, then the host end moved to the node. Call
// it from neither worker.
func podMakesVeth(host string, pod, node *testenv.NSWorker) error {
	err := pod.Do(func() error {
		la := netlink.NewLinkAttrs()
		la.Name = host
		if err := netlink.LinkAdd(&netlink.Veth{LinkAttrs: la, PeerName: "p" + host}); err != nil {
			return err
		}
		l, err := netlink.LinkByName(host)
		if err != nil {
			return err
		}
		if err := netlink.LinkSetNsFd(l, int(node.NS)); err != nil {
			return err
		}
		return setUp("p" + host)
	})
	if err != nil {
		return err
	}
	return node.Do(func() error { return setUp(host) })
}

func setUp(name string) error {
	l, err := netlink.LinkByName(name)
	if err != nil {
		return err
	}
	return netlink.LinkSetUp(l)
}

// verdictSum is how many packets the engine has counted, all reasons.
func verdictSum(t *testing.T, tc *loader.TC) uint64 {
	t.Helper()
	v, err := tc.Verdicts()
	if err != nil {
		t.Fatal(err)
	}
	var n uint64
	for _, c := range v {
		n += c
	}
	return n
}
