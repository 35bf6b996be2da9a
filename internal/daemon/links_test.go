package daemon

import (
	"context"
	"maps"
	"net/netip"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/l7mp/stunnerd-xdp/internal/loader"
	"github.com/l7mp/stunnerd-xdp/internal/logging"
	"github.com/l7mp/stunnerd-xdp/test/netns"
	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// TestFollowsInterfaces: the daemon follows its XDP interface through the
// kernel's link changes. Deleted: /status and stunnerd_xdp_attached stop
// reporting the program at once. Created again: re-attached on the link event
// (the periodic retry is an hour away). Renamed: the program stays on the
// device and is reported under its new name. Deleted once renamed: gone.
func TestFollowsInterfaces(t *testing.T) {
	if !testenv.InNetns() {
		netns.RequirePrivileged(t)
		ns := netns.NewNS(t, "links")
		testenv.RunInNetns(t, ns.Name, 2*time.Minute)
		return
	}
	addr := netip.MustParseAddr("10.99.0.1")
	d := startOnLink(t, "xv0", addr, false)
	generic := func(iface string) map[string]string { return map[string]string{iface: string(loader.ModeGeneric)} }
	reports(t, d, generic("xv0"))

	delLink(t, "xv0")
	reports(t, d, map[string]string{})

	addLink(t, "xv0", addr)
	eventually(t, 5*time.Second, "re-attached to the new xv0", func() bool { return maps.Equal(d.Status().XDP.Attached, generic("xv0")) })
	reports(t, d, generic("xv0"))

	l, err := netlink.LinkByName("xv0")
	if err != nil {
		t.Fatal(err)
	}
	// A running interface cannot be renamed.
	for _, step := range []func() error{
		func() error { return netlink.LinkSetDown(l) },
		func() error { return netlink.LinkSetName(l, "xr0") },
		func() error { return netlink.LinkSetUp(l) },
	} {
		if err := step(); err != nil {
			t.Fatal(err)
		}
	}
	reports(t, d, generic("xr0"))

	delLink(t, "xr0")
	reports(t, d, map[string]string{})
}

// startOnLink starts a daemon listening on addr, put on a new veth iface (see
// addLink), with XDP in generic mode on iface and the TC engine beside it when
// tc; the daemon closes at cleanup.
func startOnLink(t *testing.T, iface string, addr netip.Addr, tc bool) *Daemon {
	t.Helper()
	addLink(t, iface, addr)
	lf, err := logging.New("all:INFO", "text", t.Output())
	if err != nil {
		t.Fatal(err)
	}
	d, err := Start(Config{
		Listen:       netip.AddrPortFrom(addr, 3478),
		Users:        map[string]string{"u": "p"},
		RelayAddress: addr,
		MinRelayPort: 64000, MaxRelayPort: 64999,
		XDPMode:          loader.ModeGeneric,
		Interfaces:       []string{iface},
		XDPRetryInterval: time.Hour,
		TCEngine:         tc,
		Logger:           lf,
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	return d
}

// reports checks that /status, the stunnerd_xdp_attached metric and the kernel
// all say the program runs on exactly the given interfaces.
func reports(t *testing.T, d *Daemon, want map[string]string) {
	t.Helper()
	if got := d.Status().XDP.Attached; !maps.Equal(got, want) {
		t.Errorf("/status says attached %v, want %v", got, want)
	}
	mfs, err := d.Registry().Gather()
	if err != nil {
		t.Fatal(err)
	}
	metric := map[string]string{}
	for _, mf := range mfs {
		if mf.GetName() != "stunnerd_xdp_attached" {
			continue
		}
		for _, m := range mf.GetMetric() {
			if m.GetGauge().GetValue() != 1 {
				continue
			}
			labels := map[string]string{}
			for _, lp := range m.GetLabel() {
				labels[lp.GetName()] = lp.GetValue()
			}
			metric[labels["iface"]] = labels["mode"]
		}
	}
	if !maps.Equal(metric, want) {
		t.Errorf("stunnerd_xdp_attached is 1 for %v, want %v", metric, want)
	}
	for iface := range want {
		l, err := netlink.LinkByName(iface)
		if err != nil {
			t.Errorf("%s: %v", iface, err)
			continue
		}
		if x := l.Attrs().Xdp; x == nil || !x.Attached {
			t.Errorf("reported attached to %s, but the kernel has no XDP program there", iface)
		}
	}
}

// addLink adds a veth pair name/name+"p", up, with addr on name.
func addLink(t *testing.T, name string, addr netip.Addr) {
	t.Helper()
	la := netlink.NewLinkAttrs()
	la.Name = name
	if err := netlink.LinkAdd(&netlink.Veth{LinkAttrs: la, PeerName: name + "p"}); err != nil {
		t.Fatal(err)
	}
	for _, n := range []string{name, name + "p"} {
		l, err := netlink.LinkByName(n)
		if err != nil {
			t.Fatal(err)
		}
		if err := netlink.LinkSetUp(l); err != nil {
			t.Fatal(err)
		}
	}
	l, _ := netlink.LinkByName(name)
	if err := netlink.AddrAdd(l, &netlink.Addr{IPNet: netlink.NewIPNet(addr.AsSlice())}); err != nil {
		t.Fatal(err)
	}
}

func delLink(t *testing.T, name string) {
	t.Helper()
	l, err := netlink.LinkByName(name)
	if err != nil {
		t.Fatal(err)
	}
	if err := netlink.LinkDel(l); err != nil {
		t.Fatal(err)
	}
}

func eventually(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	err := wait.PollUntilContextTimeout(context.Background(), 50*time.Millisecond, timeout, true,
		func(context.Context) (bool, error) { return cond(), nil })
	if err != nil {
		t.Fatalf("not %s within %v", what, timeout)
	}
}
