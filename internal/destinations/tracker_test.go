package destinations

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"net/netip"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"
	"k8s.io/apimachinery/pkg/util/wait"

	vnetns "github.com/vishvananda/netns"

	"github.com/l7mp/stunnerd-xdp/test/netns"
	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// recorder is a sink that keeps what it was given.
type recorder struct {
	mu     sync.Mutex
	last   Table
	pushes int
	fail   int // refuse this many pushes first
	// stall, when set, holds the next push (and the tracker) until closed;
	// stalled is closed when it starts waiting.
	stall, stalled chan struct{}
}

func (r *recorder) sink(t Table) error {
	r.mu.Lock()
	stall, stalled := r.stall, r.stalled
	r.stall = nil
	r.mu.Unlock()
	if stall != nil {
		close(stalled)
		<-stall
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.fail > 0 {
		r.fail--
		return errors.New("maps not ready")
	}
	r.last, r.pushes = t, r.pushes+1
	return nil
}

func (r *recorder) get() (Table, int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return maps.Clone(r.last), r.pushes
}

// waitFor waits until the sink was given want.
func (r *recorder) waitFor(t *testing.T, what string, want Table) {
	t.Helper()
	start := time.Now()
	err := wait.PollUntilContextTimeout(context.Background(), 10*time.Millisecond, 5*time.Second, true,
		func(context.Context) (bool, error) {
			got, _ := r.get()
			return maps.Equal(got, want), nil
		})
	if got, _ := r.get(); err != nil {
		t.Fatalf("%s: the sink has %v, want %v", what, got, want)
	}
	t.Logf("%s: pushed after %v", what, time.Since(start).Round(time.Millisecond))
}

// newTracker starts a tracker on ns that pushes to rec, with cfg's other
// settings.
func newTracker(t *testing.T, ns *netns.NS, rec *recorder, cfg Config, listeners ...netip.AddrPort) (*Tracker, *testenv.LockedBuffer) {
	t.Helper()
	h, err := vnetns.GetFromName(ns.Name)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.Close() })
	var logs testenv.LockedBuffer
	cfg.Sink, cfg.NetNS = rec.sink, h
	cfg.Log = slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	tr := New(cfg, listeners)
	t.Cleanup(func() {
		tr.Close()
		t.Logf("tracker log:\n%s", logs.String())
	})
	return tr, &logs
}

// noFailures fails the test when the tracker logged a failure.
func noFailures(t *testing.T, logs *testenv.LockedBuffer) {
	t.Helper()
	if s := logs.String(); strings.Contains(s, "level=WARN") || strings.Contains(s, "level=ERROR") {
		t.Errorf("the tracker logged a failure:\n%s", s)
	}
}

var (
	ap = netip.MustParseAddrPort
)

// TestTrackerFollowsAddresses: addresses added to and removed from the
// namespace reach the table, tentative IPv6 addresses only once DAD is done.
func TestTrackerFollowsAddresses(t *testing.T) {
	netns.RequirePrivileged(t)
	ns := netns.NewNS(t, "dest")
	// IPv6 on, but no link-local addresses: the test names every address.
	ns.Run(t, "sysctl", "-q", "-w", "net.ipv6.conf.all.disable_ipv6=0", "net.ipv6.conf.default.disable_ipv6=0",
		"net.ipv6.conf.default.addr_gen_mode=1")
	ns.IP(t, "link", "add", "d0", "type", "veth", "peer", "name", "d1")
	ns.IP(t, "link", "set", "d1", "up")
	ns.IP(t, "link", "set", "d0", "up")
	ns.IP(t, "addr", "add", "10.10.0.1/24", "dev", "d0")

	w4, w6, spec := ap("0.0.0.0:3478"), ap("[::]:3478"), ap("10.10.0.1:3479")
	rec := &recorder{}
	tr, logs := newTracker(t, ns, rec, Config{}, w4, w6, spec)
	rec.waitFor(t, "start", Table{ap("10.10.0.1:3478"): w4, spec: spec})

	ns.IP(t, "addr", "add", "10.20.0.2/24", "dev", "d0")
	rec.waitFor(t, "IPv4 address added", Table{ap("10.10.0.1:3478"): w4, ap("10.20.0.2:3478"): w4, spec: spec})
	ns.IP(t, "addr", "add", "fd00:10::1/64", "dev", "d0", "nodad")
	rec.waitFor(t, "IPv6 address added", Table{ap("10.10.0.1:3478"): w4, ap("10.20.0.2:3478"): w4,
		ap("[fd00:10::1]:3478"): w6, spec: spec})
	ns.IP(t, "addr", "del", "10.10.0.1/24", "dev", "d0")
	// The specific listener keeps its address: a datagram to it still
	// reaches its socket if the address comes back, and the kernel drops it
	// otherwise; the wildcard's entry goes.
	rec.waitFor(t, "IPv4 address removed", Table{ap("10.20.0.2:3478"): w4, ap("[fd00:10::1]:3478"): w6, spec: spec})

	// An address under duplicate address detection does not take traffic
	// yet: a veth whose peer is down keeps it tentative.
	ns.IP(t, "link", "add", "v0", "type", "veth", "peer", "name", "v1")
	ns.Run(t, "sysctl", "-q", "-w", "net.ipv6.conf.v0.accept_dad=1", "net.ipv6.conf.v0.dad_transmits=1")
	ns.IP(t, "link", "set", "v0", "up")
	ns.IP(t, "addr", "add", "fd00:20::1/64", "dev", "v0")
	if out := ns.IP(t, "-6", "addr", "show", "dev", "v0"); !strings.Contains(out, "tentative") {
		t.Fatalf("the address is not tentative:\n%s", out)
	}
	tr.Resync() // a push after the address appeared, to look at
	_, pushes := rec.get()
	if err := wait.PollUntilContextTimeout(context.Background(), 10*time.Millisecond, 5*time.Second, true,
		func(context.Context) (bool, error) { _, n := rec.get(); return n > pushes, nil }); err != nil {
		t.Fatal("Resync pushed nothing")
	}
	if got, _ := rec.get(); !maps.Equal(got, Table{ap("10.20.0.2:3478"): w4, ap("[fd00:10::1]:3478"): w6, spec: spec}) {
		t.Errorf("with a tentative address the sink has %v", got)
	}
	ns.IP(t, "link", "set", "v1", "up")
	rec.waitFor(t, "DAD done", Table{ap("10.20.0.2:3478"): w4, ap("[fd00:10::1]:3478"): w6,
		ap("[fd00:20::1]:3478"): w6, spec: spec})

	// A reload drops the IPv6 wildcard.
	tr.SetListeners([]netip.AddrPort{w4, spec})
	rec.waitFor(t, "listeners changed", Table{ap("10.20.0.2:3478"): w4, spec: spec})
	if got := tr.Table(); !maps.Equal(got, Table{ap("10.20.0.2:3478"): w4, spec: spec}) {
		t.Errorf("Table() = %v", got)
	}
	noFailures(t, logs)
	if !strings.Contains(logs.String(), `msg="destination dropped" dest=[fd00:10::1]:3478`) {
		t.Errorf("the change was not logged")
	}
}

// TestTrackerRetriesTheSink: a sink that fails is retried, and the failure
// is logged once.
func TestTrackerRetriesTheSink(t *testing.T) {
	netns.RequirePrivileged(t)
	ns := netns.NewNS(t, "dest")
	spec := ap("10.10.0.1:3478")
	rec := &recorder{fail: 2}
	_, logs := newTracker(t, ns, rec, Config{}, spec)
	err := wait.PollUntilContextTimeout(context.Background(), 20*time.Millisecond, 10*time.Second, true,
		func(context.Context) (bool, error) {
			got, _ := rec.get()
			return maps.Equal(got, Table{spec: spec}), nil
		})
	if err != nil {
		t.Fatalf("the table never reached the sink:\n%s", logs.String())
	}
	if n := strings.Count(logs.String(), "pushing the table failed"); n != 1 {
		t.Errorf("the failure was logged %d times, want once:\n%s", n, logs.String())
	}
	if !strings.Contains(logs.String(), "pushing the table works again") {
		t.Errorf("the recovery was not logged:\n%s", logs.String())
	}
}

// vipRig is a node with UDP listeners reached through a VIP the node DNATs
// to them, as kube-proxy or a cloud load balancer does.
type vipRig struct {
	*netns.Rig
	vip    netip.Addr
	local  netip.Addr   // the listeners' address, srv0's
	locals []netip.Addr // the server's addresses of the VIP's family
}

// newVIPRig DNATs vip:3478 and vip:3479 to srv0's address in the server of a
// routed rig, over IPv4 or (WithIPv6) IPv6.
func newVIPRig(t *testing.T, ipv6 bool) *vipRig {
	t.Helper()
	netns.RequirePrivileged(t, "iptables", "ip6tables")
	var r *vipRig
	iptables, family := "iptables", "-4"
	if ipv6 {
		r = &vipRig{Rig: netns.New(t, netns.WithIPv6()), vip: netip.MustParseAddr("fd00:99::10")}
		iptables, family = "ip6tables", "-6"
		r.local = r.ServerClientIf.Addr6
		r.locals = []netip.Addr{r.ServerClientIf.Addr6}
	} else {
		r = &vipRig{Rig: netns.NewRouted(t), vip: netip.MustParseAddr("192.0.2.10")}
		r.local = r.ServerClientIf.Addr
		r.locals = []netip.Addr{r.ServerClientIf.Addr, r.ServerPeerIf.Addr}
	}
	// Like a node: the rig's default route, and the NAT rules in the server.
	r.Client.IP(t, family, "route", "add", r.vip.String(), "via", r.local.String())
	for _, port := range []uint16{3478, 3479} {
		r.Server.Run(t, iptables, "-t", "nat", "-A", "PREROUTING", "-d", r.vip.String(), "-p", "udp",
			"--dport", strconv.Itoa(int(port)), "-j", "DNAT", "--to-destination", netip.AddrPortFrom(r.local, port).String())
	}
	return r
}

// exchange sends one datagram from a new socket in the client namespace to
// dst and returns the client's address and where the answer came from.
func exchange(t *testing.T, r *netns.Rig, dst netip.AddrPort) (client, from netip.AddrPort) {
	t.Helper()
	src, network := r.ClientIf.Addr, "udp4"
	if dst.Addr().Is6() {
		src, network = r.ClientIf.Addr6, "udp6"
	}
	var conn *net.UDPConn
	if err := r.Client.Do(func() (err error) {
		conn, err = net.ListenUDP(network, net.UDPAddrFromAddrPort(netip.AddrPortFrom(src, 0)))
		return err
	}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	if _, err := conn.WriteToUDPAddrPort([]byte("hello"), dst); err != nil {
		t.Fatal(err)
	}
	_ = conn.SetReadDeadline(time.Now().Add(5 * time.Second))
	buf := make([]byte, 100)
	_, from, err := conn.ReadFromUDPAddrPort(buf)
	if err != nil {
		t.Fatalf("no answer from %v: %v", dst, err)
	}
	return conn.LocalAddr().(*net.UDPAddr).AddrPort(), netip.AddrPortFrom(from.Addr().Unmap(), from.Port())
}

// TestTrackerLearnsVIPs: an allocation that came through a VIP the node
// DNATs to the listener teaches the VIP, for a specific and a wildcard
// listener, over IPv4 and IPv6, while an allocation through it lives.
func TestTrackerLearnsVIPs(t *testing.T) {
	for _, ipv6 := range []bool{false, true} {
		t.Run(map[bool]string{false: "IPv4", true: "IPv6"}[ipv6], func(t *testing.T) {
			testTrackerLearnsVIPs(t, newVIPRig(t, ipv6))
		})
	}
}

func testTrackerLearnsVIPs(t *testing.T, r *vipRig) {
	spec := netip.AddrPortFrom(r.local, 3478)
	wild := ap("0.0.0.0:3479")
	if r.vip.Is6() {
		wild = ap("[::]:3479")
	}
	r.Server.ServeUDPEcho(t, spec)
	r.Server.ServeUDPEcho(t, wild)
	rec := &recorder{}
	tr, logs := newTracker(t, r.Server, rec, Config{}, spec, wild)
	wildOnly := Table{}
	for _, a := range r.locals {
		wildOnly[netip.AddrPortFrom(a, 3479)] = wild
	}
	static := maps.Clone(wildOnly)
	static[spec] = spec
	rec.waitFor(t, "start", static)

	// Straight to the listener: nothing to learn.
	direct, from := exchange(t, r.Rig, spec)
	if from != spec {
		t.Fatalf("direct answer from %v", from)
	}
	tr.AllocationCreated(direct, spec)

	viaVIP := func(l netip.AddrPort) netip.AddrPort {
		vip := netip.AddrPortFrom(r.vip, l.Port())
		client, from := exchange(t, r.Rig, vip)
		if from != vip {
			t.Fatalf("the answer through the VIP came from %v, want %v", from, vip)
		}
		tr.AllocationCreated(client, l)
		return client
	}
	c1 := viaVIP(spec)
	c2 := viaVIP(spec)
	c3 := viaVIP(wild)
	learned := maps.Clone(static)
	learned[netip.AddrPortFrom(r.vip, 3478)] = spec
	learned[netip.AddrPortFrom(r.vip, 3479)] = wild
	rec.waitFor(t, "VIPs learned", learned)

	tr.AllocationDeleted(c1, spec)
	tr.AllocationDeleted(direct, spec)
	tr.AllocationDeleted(c3, wild)
	delete(learned, netip.AddrPortFrom(r.vip, 3479))
	rec.waitFor(t, "the wildcard's VIP forgotten, the other kept by its second allocation", learned)
	// A reload removes the specific listener: what it learned goes.
	tr.SetListeners([]netip.AddrPort{wild})
	rec.waitFor(t, "the listener removed", wildOnly)
	tr.SetListeners([]netip.AddrPort{spec, wild})
	rec.waitFor(t, "the listener back", static)
	tr.AllocationDeleted(c2, spec) // already forgotten: a no-op
	noFailures(t, logs)
	if !strings.Contains(logs.String(), "learned a VIP from conntrack") {
		t.Errorf("no learning logged")
	}
}

// TestTrackerWithoutConntrack: without NAT rules nothing hooks conntrack in
// the namespace; an allocation teaches nothing and is no error.
func TestTrackerWithoutConntrack(t *testing.T) {
	netns.RequirePrivileged(t, "conntrack")
	r := netns.NewRouted(t)
	spec := netip.AddrPortFrom(r.ServerClientIf.Addr, 3478)
	r.Server.ServeUDPEcho(t, spec)
	rec := &recorder{}
	tr, logs := newTracker(t, r.Server, rec, Config{}, spec)
	rec.waitFor(t, "start", Table{spec: spec})
	client, _ := exchange(t, r, spec)
	if out := r.Server.Run(t, "conntrack", "-L"); strings.Contains(out, "dport=3478") {
		t.Fatalf("conntrack tracks the flow: the premise does not hold\n%s", out)
	}
	tr.AllocationCreated(client, spec)
	_, pushes := rec.get()
	tr.Resync()
	if err := wait.PollUntilContextTimeout(context.Background(), 10*time.Millisecond, 5*time.Second, true,
		func(context.Context) (bool, error) { _, n := rec.get(); return n > pushes, nil }); err != nil {
		t.Fatal("Resync pushed nothing")
	}
	if got, _ := rec.get(); !maps.Equal(got, Table{spec: spec}) {
		t.Errorf("the sink has %v", got)
	}
	noFailures(t, logs)
}

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// TestTrackerRelistsAfterLoss: a burst of address changes while the tracker
// is busy overruns its netlink socket (ENOBUFS); the tracker subscribes again
// and re-lists, so the table ends up complete and later changes still reach it.
func TestTrackerRelistsAfterLoss(t *testing.T) {
	netns.RequirePrivileged(t)
	ns := netns.NewNS(t, "dest")
	ns.IP(t, "link", "add", "d0", "type", "veth", "peer", "name", "d1")
	ns.IP(t, "link", "set", "d0", "up")
	w4 := ap("0.0.0.0:3478")
	rec := &recorder{}
	// A small buffer, which a thousand notifications overrun.
	tr, logs := newTracker(t, ns, rec, Config{ReceiveBuffer: 16 << 10}, w4)
	rec.waitFor(t, "start", Table{})
	const n = 1000

	// Hold the tracker in its sink while the burst fills the socket.
	stall := make(chan struct{})
	rec.mu.Lock()
	rec.stall, rec.stalled = stall, make(chan struct{})
	stalled := rec.stalled
	rec.mu.Unlock()
	tr.Resync()
	<-stalled
	var batch strings.Builder
	want := Table{}
	for i := range n {
		a := netip.AddrFrom4([4]byte{10, 30, byte(i >> 8), byte(i)})
		fmt.Fprintf(&batch, "addr add %s/32 dev d0\n", a)
		want[netip.AddrPortFrom(a, w4.Port())] = w4
	}
	cmd := exec.Command("ip", "-n", ns.Name, "-batch", "-")
	cmd.Stdin = strings.NewReader(batch.String())
	out, err := cmd.CombinedOutput()
	close(stall)
	if err != nil {
		t.Fatalf("ip -batch: %v\n%s", err, out)
	}
	rec.waitFor(t, "burst of addresses", want)
	// The loss shows once the subscription has handed over what it held.
	if err := wait.PollUntilContextTimeout(context.Background(), 10*time.Millisecond, 5*time.Second, true,
		func(context.Context) (bool, error) { return strings.Contains(logs.String(), "re-listing"), nil }); err != nil {
		t.Fatalf("the burst did not overrun the subscription: the re-listing went untested")
	}
	ns.IP(t, "addr", "add", "10.40.0.1/32", "dev", "d0")
	want[ap("10.40.0.1:3478")] = w4
	rec.waitFor(t, "an address after the loss", want)
}

// TestTrackerLearnsNodePorts: an allocation that came through a DNAT that
// changes the port (a NodePort: the node's address, port 31478, to the
// listener's 3478) teaches the NodePort, forgotten with the allocation;
// while a local socket is bound to the NodePort (on its address or a
// wildcard) the destination has two claimants and is not learned; a socket
// on another address of that port is no claimant.
func TestTrackerLearnsNodePorts(t *testing.T) {
	for _, ipv6 := range []bool{false, true} {
		t.Run(map[bool]string{false: "IPv4", true: "IPv6"}[ipv6], func(t *testing.T) {
			testTrackerLearnsNodePorts(t, newVIPRig(t, ipv6))
		})
	}
}

func testTrackerLearnsNodePorts(t *testing.T, r *vipRig) {
	const nodePort = 31478
	iptables, wild, any, other, bits := "iptables", ap("0.0.0.0:3478"), ap("0.0.0.0:31478"), netip.MustParseAddr("192.0.2.77"), "/32"
	if r.vip.Is6() {
		iptables, wild, any, other, bits = "ip6tables", ap("[::]:3478"), ap("[::]:31478"), netip.MustParseAddr("fd00:100::77"), "/128"
	}
	// Another address of the node's, for a socket on the NodePort that does
	// not take what is sent to the listener's address (deprecated: the echo's
	// unbound replies keep the listener's address as their source).
	r.Server.IP(t, "addr", "add", other.String()+bits, "dev", r.ServerClientIf.Name, "nodad", "preferred_lft", "0")
	// kube-proxy's NodePort rule: any local address, the port translated.
	r.Server.Run(t, iptables, "-t", "nat", "-A", "PREROUTING", "-m", "addrtype", "--dst-type", "LOCAL", "-p", "udp",
		"--dport", strconv.Itoa(nodePort), "-j", "DNAT", "--to-destination", netip.AddrPortFrom(r.local, 3478).String())
	r.Server.ServeUDPEcho(t, wild)
	rec := &recorder{}
	tr, logs := newTracker(t, r.Server, rec, Config{}, wild)
	static := Table{netip.AddrPortFrom(other, 3478): wild}
	for _, a := range r.locals {
		static[netip.AddrPortFrom(a, 3478)] = wild
	}
	rec.waitFor(t, "start", static)

	np := netip.AddrPortFrom(r.local, nodePort)
	viaNodePort := func() netip.AddrPort {
		client, from := exchange(t, r.Rig, np)
		if from != np {
			t.Fatalf("the answer through the NodePort came from %v, want %v", from, np)
		}
		tr.AllocationCreated(client, wild)
		return client
	}
	// A socket on another address of the port takes nothing sent to np.
	closeOther := bindUDP(t, r.Server, netip.AddrPortFrom(other, nodePort))
	c1 := viaNodePort()
	learned := maps.Clone(static)
	learned[np] = wild
	rec.waitFor(t, "NodePort learned", learned)
	closeOther()
	tr.AllocationDeleted(c1, wild)
	rec.waitFor(t, "NodePort forgotten with its allocation", static)

	// A socket bound to the port on a wildcard: a second claimant.
	closeAny := bindUDP(t, r.Server, any)
	c2 := viaNodePort()
	waitLog(t, logs, "a local socket is bound to it")
	if got, _ := rec.get(); !maps.Equal(got, static) {
		t.Fatalf("with a socket on %v: the sink has %v, want %v", any, got, static)
	}
	tr.AllocationDeleted(c2, wild)
	closeAny()
	c3 := viaNodePort()
	rec.waitFor(t, "NodePort learned once the socket is gone", learned)
	tr.AllocationDeleted(c3, wild)
	rec.waitFor(t, "and forgotten", static)
	noFailures(t, logs)
}

// bindUDP binds a UDP socket to addr in ns, and returns its close.
func bindUDP(t *testing.T, ns *netns.NS, addr netip.AddrPort) func() {
	t.Helper()
	var conn *net.UDPConn
	if err := ns.Do(func() (err error) {
		conn, err = net.ListenUDP("udp", net.UDPAddrFromAddrPort(addr))
		return err
	}); err != nil {
		t.Fatal(err)
	}
	var once sync.Once
	closeIt := func() { once.Do(func() { conn.Close() }) }
	t.Cleanup(closeIt)
	return closeIt
}

// waitLog waits until the tracker logged s.
func waitLog(t *testing.T, logs *testenv.LockedBuffer, s string) {
	t.Helper()
	err := wait.PollUntilContextTimeout(context.Background(), 10*time.Millisecond, 5*time.Second, true,
		func(context.Context) (bool, error) { return strings.Contains(logs.String(), s), nil })
	if err != nil {
		t.Fatalf("the tracker never logged %q", s)
	}
}
