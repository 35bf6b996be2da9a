package bpf_test

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/l7mp/stunnerd-xdp/bpf"
	"github.com/l7mp/stunnerd-xdp/internal/channelmap"
	"github.com/l7mp/stunnerd-xdp/internal/loader"
	"github.com/l7mp/stunnerd-xdp/test/model"
	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// The environment every privileged test in this package shares: the golden
// tables, the hostile-input table and the fuzz targets all see the same
// interfaces, neighbours, MTUs, forwarding settings and program configuration,
// and the reference model is given exactly the same (modelEnv).

const (
	listenerPort = 3478
	xdpPass      = uint32(model.Pass)
	xdpTX        = uint32(model.TX)
	xdpRedirect  = uint32(model.Redirect)
)

var progConfig = loader.Config{
	// Room for the fuzz targets, which replace up to 8 bindings per input while
	// freed ids rest in quarantine (channelmap) for 100 ms.
	ListenerPorts: []uint16{listenerPort}, MinRelayPort: 49152, MaxRelayPort: 65535, MaxBindings: 65536,
}

// The listeners of the environment: a wildcard for each family, which the
// golden bindings use, and a specific one on a0 (10.100.0.5, fd00:100::5) that
// shares their port.
var (
	wildcard4 = netip.MustParseAddrPort("0.0.0.0:3478")
	wildcard6 = netip.MustParseAddrPort("[::]:3478")
	specific4 = netip.MustParseAddrPort("10.100.0.5:3478")
	specific6 = netip.MustParseAddrPort("[fd00:100::5]:3478")
)

// destTable is what the listeners accept: the wildcards the server's own
// addresses and two VIPs each (as if the node DNATed them), the specific
// listeners their own address. Everything else on the listener port is not a
// listener's (transit, broadcast, multicast, other hosts).
var destTable = func() map[netip.AddrPort]netip.AddrPort {
	d := map[netip.AddrPort]netip.AddrPort{specific4: specific4, specific6: specific6}
	for _, a := range []string{"10.100.0.1", "10.200.0.1", "10.201.0.1", "10.202.0.1", "10.203.0.1", "10.204.0.1",
		"10.100.0.100", "10.100.0.77"} {
		d[netip.AddrPortFrom(netip.MustParseAddr(a), listenerPort)] = wildcard4
	}
	for _, a := range []string{"fd00:100::1", "fd00:202::1", "fd00:203::1", "fd00:204::1", "fd00:100::100", "fd00:100::77"} {
		d[netip.AddrPortFrom(netip.MustParseAddr(a), listenerPort)] = wildcard6
	}
	// NodePorts: the node (and a VIP in front of it) DNATs nodePort to the
	// wildcard listeners' port; and one translated port inside the relay
	// range, where the relay port wins (the program takes it as a relay
	// port).
	for _, a := range []string{"10.100.0.1", "10.100.0.100"} {
		d[netip.AddrPortFrom(netip.MustParseAddr(a), nodePort)] = wildcard4
	}
	for _, a := range []string{"fd00:100::1", "fd00:100::100"} {
		d[netip.AddrPortFrom(netip.MustParseAddr(a), nodePort)] = wildcard6
	}
	d[netip.AddrPortFrom(netip.MustParseAddr("10.100.0.1"), relayRangeNodePort)] = wildcard4
	return d
}()

// nodePort is a port the environment's node DNATs to listenerPort (a
// kube-proxy NodePort); relayRangeNodePort one inside the relay port range.
const (
	nodePort           = 31478
	relayRangeNodePort = 50000
)

var (
	clientMAC = [6]byte{0x02, 0, 0, 0, 0x10, 0x02}
	peerMAC   = [6]byte{0x02, 0, 0, 0, 0x20, 0x02}
	peer2MAC  = [6]byte{0x02, 0, 0, 0, 0x10, 0x03}
	smallMAC  = [6]byte{0x02, 0, 0, 0, 0x21, 0x02}
	offMAC    = [6]byte{0x02, 0, 0, 0, 0x22, 0x02}
	otherMAC  = [6]byte{0x02, 0, 0, 0, 0x23, 0x02}
	f0MAC     = [6]byte{0x02, 0, 0, 0, 0x24, 0x02}
)

// iface is one server-side interface of the environment.
type iface struct {
	name    string
	addr    string // server address, /24
	addr6   string // server IPv6 address, /64 (optional; needs an MTU of 1280 or more)
	mtu     int
	fwd     bool // net.ipv4.conf.<name>.forwarding
	fwd6    bool // net.ipv6.conf.<name>.forwarding
	devmap  bool
	index   int
	mac     [6]byte
	neigh   map[string][6]byte // IPv4 and IPv6
	unreach string             // a route of type unreachable added with this interface
	// unreach6 is an IPv6 route of type unreachable added with this interface.
	unreach6 string
	// caps is the interface's dev_caps entry (nil: none), as the loader
	// would write it: by default, in the devmap means attached natively with
	// XDP frames transmitted (a NIC, or a veth whose far end runs XDP); e0
	// (not attached) transmits none.
	caps *model.DevCaps
}

// ifaceNames is the fixed order in which fuzz inputs choose an ingress.
var ifaceNames = []string{"a0", "b0", "c0", "d0", "e0", "f0"}

func ifaceTable() []*iface {
	return []*iface{
		// Client (IPv4 and IPv6) and a second peer.
		{name: "a0", addr: "10.100.0.1", addr6: "fd00:100::1", mtu: 1500, fwd: true, fwd6: true, devmap: true,
			neigh: map[string][6]byte{"10.100.0.2": clientMAC, "10.100.0.3": peer2MAC, "fd00:100::2": clientMAC, "fd00:100::3": peer2MAC}},
		// Peer; behind it an unreachable subnet, and an unreachable IPv6 prefix.
		// IPv6 forwarding on (peer->client lookups for IPv6 clients start here),
		// no IPv6 address.
		{name: "b0", addr: "10.200.0.1", mtu: 1500, fwd: true, fwd6: true, devmap: true,
			neigh: map[string][6]byte{"10.200.0.2": peerMAC}, unreach: "10.250.0.0/24", unreach6: "fd00:250::/64"},
		// MTU 100: results above it need fragmentation. No IPv6 (below 1280).
		{name: "c0", addr: "10.201.0.1", mtu: 100, fwd: true, devmap: true,
			neigh: map[string][6]byte{"10.201.0.2": smallMAC}},
		// IPv4 forwarding off, IPv6 forwarding on.
		{name: "d0", addr: "10.202.0.1", addr6: "fd00:202::1", mtu: 1500, fwd: false, fwd6: true, devmap: true,
			neigh: map[string][6]byte{"10.202.0.2": offMAC, "fd00:202::2": offMAC}},
		// Not in the devmap: the program is not attached there. IPv6 forwarding off.
		{name: "e0", addr: "10.203.0.1", addr6: "fd00:203::1", mtu: 1500, fwd: true, fwd6: false, devmap: false,
			neigh: map[string][6]byte{"10.203.0.2": otherMAC, "fd00:203::2": otherMAC}},
		// IPv6's minimum MTU: an IPv6 reply is 24 bytes longer than the IPv4
		// datagram it carries.
		{name: "f0", addr: "10.204.0.1", addr6: "fd00:204::1", mtu: 1280, fwd: true, fwd6: true, devmap: true,
			neigh: map[string][6]byte{"10.204.0.2": f0MAC, "fd00:204::2": f0MAC}},
	}
}

// env is a network namespace whose routing and neighbour tables drive
// bpf_fib_lookup, and the relay program loaded into it.
type env struct {
	ns     *testenv.NSWorker
	prog   *loader.Program
	maps   *channelmap.Maps
	ifaces map[string]*iface
	// ranAt is CLOCK_MONOTONIC just before the last BPF_PROG_RUN: check
	// gives it to the model as its clock, so that rate-limit charges are
	// compared at the program's time, not at whenever the model ran.
	ranAt uint64
	// loFwd is net.ipv4.conf.lo.forwarding (the reverse-path lookup's
	// input device); routes are the gateway routes added since setup.
	loFwd  bool
	routes []model.Route
	// shield is the listener shield as set (setShield), allocs and
	// nodeAllocs what alloc_flows and node_flows hold.
	shield             model.Shield
	allocs, nodeAllocs map[model.Allocation]bool
}

func newEnv(t testing.TB) *env {
	t.Helper()
	return newEnvWith(t, progConfig)
}

// newEnvWith is newEnv with the program loaded with cfg.
func newEnvWith(t testing.TB, cfg loader.Config) *env {
	t.Helper()
	if testing.Short() {
		t.Skip("BPF_PROG_RUN in a network namespace: not in -short mode")
	}
	testenv.RequireRoot(t)
	e := &env{ns: testenv.NewNSWorker(t), ifaces: map[string]*iface{}}
	for _, i := range ifaceTable() {
		e.ifaces[i.name] = i
	}
	if !xdpRunsTakeContext() {
		// The program that reads the ingress ifindex in front of the frame
		// (e.run puts it there).
		obj := filepath.Join(t.TempDir(), "relay_ingress.o")
		if err := os.WriteFile(obj, bpf.RelayIngressObject, 0o600); err != nil {
			t.Fatal(err)
		}
		cfg.Object = obj
	}
	prog, err := loader.Load(cfg, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { prog.Close() })
	e.prog = prog
	e.maps = channelmap.New(prog.Maps())
	e.maps.SetCharge(prog.Charge())
	if err := e.maps.SetDestinations(destTable); err != nil {
		t.Fatal(err)
	}
	if err := e.ns.Do(func() error { return e.setup() }); err != nil {
		t.Fatal(err)
	}
	// Every run on one CPU (the first this process may use): the flow caches
	// are per CPU, and a row's second run (and a fuzz input's repeats) must
	// find what its first one cached.
	if err := e.ns.Do(func() error {
		var allowed, one unix.CPUSet
		if err := unix.SchedGetaffinity(0, &allowed); err != nil {
			return err
		}
		for c := 0; c < 1024; c++ {
			if allowed.IsSet(c) {
				one.Set(c)
				break
			}
		}
		return unix.SchedSetaffinity(0, &one)
	}); err != nil {
		t.Fatal(err)
	}
	// The next-hop cache on, kept valid as the daemon keeps it: every change
	// of the namespace's tables moves the FIB generation.
	// A change may still be delivered after stop closed, once the test (and
	// the program's maps) are gone: the watcher's callback and the cleanup
	// that ends it exclude each other, and the callback does nothing after it.
	stop := make(chan struct{})
	var (
		watchMu sync.Mutex
		stopped bool
	)
	t.Cleanup(func() {
		watchMu.Lock()
		defer watchMu.Unlock()
		stopped = true
		close(stop)
	})
	fibGen := prog.FibGen()
	err = e.ns.Do(func() error {
		return loader.WatchFIB(stop, func() {
			watchMu.Lock()
			defer watchMu.Unlock()
			if stopped {
				return
			}
			if err := fibGen.Enable(); err != nil {
				select {
				case <-stop:
					// The watcher may call once more after stop (a message
					// read as the test ended): the map is closed by then,
					// and the test may be over.
				default:
					t.Errorf("FIB generation: %v", err)
				}
			}
		}, slog.New(slog.NewTextHandler(io.Discard, nil)))
	})
	if err != nil {
		t.Fatal(err)
	}
	return e
}

// setFlowsAside sets the program's flow caches aside or uses them (as
// channelmap does for the number of bindings installed).
func (e *env) setFlowsAside(t testing.TB, aside bool) {
	t.Helper()
	if err := bpf.NewFibGen(e.prog.Maps().FibGen).SetFlowsAside(aside); err != nil {
		t.Fatal(err)
	}
}

// fibGen reads the program's FIB generation.
func (e *env) fibGen(t testing.TB) uint32 {
	t.Helper()
	var gen uint32
	if err := e.prog.Maps().FibGen.Lookup(uint32(0), &gen); err != nil {
		t.Fatal(err)
	}
	return gen
}

func (e *env) setup() error {
	if err := os.WriteFile("/proc/sys/net/ipv4/conf/all/forwarding", []byte("0"), 0); err != nil {
		return err
	}
	// Forwarding on lo, as on a node with ip_forward=1 (all=0 turned it
	// off): the reverse-path lookups are inputs from lo.
	if err := os.WriteFile("/proc/sys/net/ipv4/conf/lo/forwarding", []byte("1"), 0); err != nil {
		return err
	}
	e.loFwd = true
	for _, f := range []string{"all", "default"} {
		if err := os.WriteFile("/proc/sys/net/ipv6/conf/"+f+"/disable_ipv6", []byte("0"), 0); err != nil {
			return err
		}
	}
	for _, i := range e.ifaces {
		la := netlink.NewLinkAttrs()
		la.Name = i.name
		la.MTU = i.mtu
		if err := netlink.LinkAdd(&netlink.Veth{LinkAttrs: la, PeerName: i.name[:1] + "1"}); err != nil {
			return fmt.Errorf("add veth %s: %w", i.name, err)
		}
		l, err := netlink.LinkByName(i.name)
		if err != nil {
			return err
		}
		p, err := netlink.LinkByName(i.name[:1] + "1")
		if err != nil {
			return err
		}
		// The far ends send nothing: no IPv6 of their own (DAD, router
		// solicitations, MLD reports), so that a test with a program attached
		// to a server interface counts only its own frames (a 5.10 guest's
		// TestTCReconfigure met an MLD report: pass_ipv6_extension).
		// (Below an MTU of 1280 a device has no IPv6, nor the file.)
		if err := os.WriteFile("/proc/sys/net/ipv6/conf/"+p.Attrs().Name+"/disable_ipv6", []byte("1"), 0); err != nil && !errors.Is(err, os.ErrNotExist) {
			return err
		}
		addr, _ := netlink.ParseAddr(i.addr + "/24")
		if err := netlink.AddrAdd(l, addr); err != nil {
			return fmt.Errorf("add address to %s: %w", i.name, err)
		}
		for _, up := range []netlink.Link{l, p} {
			if err := netlink.LinkSetUp(up); err != nil {
				return err
			}
		}
		if i.addr6 != "" {
			addr6, _ := netlink.ParseAddr(i.addr6 + "/64")
			addr6.Flags = 0x02 // IFA_F_NODAD: usable at once
			if err := netlink.AddrAdd(l, addr6); err != nil {
				return fmt.Errorf("add IPv6 address to %s: %w", i.name, err)
			}
		}
		if err := os.WriteFile("/proc/sys/net/ipv4/conf/"+i.name+"/forwarding", []byte(bit(i.fwd)), 0); err != nil {
			return err
		}
		if i.mtu >= 1280 { // below it the interface has no IPv6 (and no such file)
			if err := os.WriteFile("/proc/sys/net/ipv6/conf/"+i.name+"/forwarding", []byte(bit(i.fwd6)), 0); err != nil {
				return err
			}
		} else if i.fwd6 || i.addr6 != "" {
			return fmt.Errorf("%s: IPv6 needs an MTU of 1280", i.name)
		}
		for ip, mac := range i.neigh {
			if err := netlink.NeighAdd(&netlink.Neigh{LinkIndex: l.Attrs().Index, State: netlink.NUD_PERMANENT,
				IP: net.ParseIP(ip), HardwareAddr: net.HardwareAddr(mac[:])}); err != nil {
				return fmt.Errorf("add neighbour %s: %w", ip, err)
			}
		}
		for _, u := range []string{i.unreach, i.unreach6} {
			if u == "" {
				continue
			}
			_, dst, _ := net.ParseCIDR(u)
			if err := netlink.RouteAdd(&netlink.Route{Dst: dst, Type: 7 /* RTN_UNREACHABLE */}); err != nil {
				return fmt.Errorf("add unreachable route %s: %w", u, err)
			}
		}
		i.index = l.Attrs().Index
		copy(i.mac[:], l.Attrs().HardwareAddr)
		if i.devmap {
			if err := e.prog.Maps().TxPorts.Put(uint32(i.index), uint32(i.index)); err != nil {
				return fmt.Errorf("devmap %s: %w", i.name, err)
			}
			i.caps = &model.DevCaps{Native: true, XDPXmit: true, XDPTX: true, MTU: i.mtu}
		} else {
			i.caps = &model.DevCaps{MTU: i.mtu}
		}
		if err := e.writeCaps(i); err != nil {
			return err
		}
	}
	return waitLocal6(e.ifaces)
}

// writeCaps writes i.caps into the program's dev_caps map (nil: no entry).
func (e *env) writeCaps(i *iface) error {
	if i.caps == nil {
		if err := e.prog.Maps().DevCaps.Delete(uint32(i.index)); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return fmt.Errorf("dev_caps %s: %w", i.name, err)
		}
		return nil
	}
	var v bpf.RelayDevCap
	for _, f := range []struct {
		on   bool
		flag bpf.RelayDevFlag
	}{{i.caps.Native, bpf.RelayDevFlagDEV_ATTACHED_NATIVE}, {i.caps.Generic, bpf.RelayDevFlagDEV_ATTACHED_GENERIC},
		{i.caps.XDPXmit, bpf.RelayDevFlagDEV_XDP_XMIT}, {i.caps.XDPTX, bpf.RelayDevFlagDEV_XDP_TX},
		{i.caps.NeedsRoute, bpf.RelayDevFlagDEV_XMIT_NEEDS_ROUTE},
		{i.caps.RPFilter == model.RPStrict, bpf.RelayDevFlagDEV_RP_STRICT},
		{i.caps.RPFilter == model.RPLoose, bpf.RelayDevFlagDEV_RP_LOOSE}} {
		if f.on {
			v.Flags |= f.flag
		}
	}
	v.Mtu = uint32(i.caps.MTU)
	if err := e.prog.Maps().DevCaps.Put(uint32(i.index), v); err != nil {
		return fmt.Errorf("dev_caps %s: %w", i.name, err)
	}
	return nil
}

// setCaps gives the named interface caps (nil: no entry) in the program and
// in the model m (when not nil), and moves the FIB generation as the loader
// does, so that cached next hops are decided again; the test's end restores
// the interface's caps.
func (e *env) setCaps(t testing.TB, m *model.Model, name string, caps *model.DevCaps) {
	t.Helper()
	i := e.ifaces[name]
	old := i.caps
	set := func(c *model.DevCaps) {
		i.caps = c
		if err := e.writeCaps(i); err != nil {
			t.Fatal(err)
		}
		// As the loader's device follower tells it (GEN_RP_FILTER).
		if err := e.prog.FibGen().SetReversePath(e.anyRP()); err != nil {
			t.Fatal(err)
		}
		if err := e.prog.FibGen().Bump(); err != nil {
			t.Fatal(err)
		}
	}
	set(caps)
	if m != nil {
		m.SetEnv(e.modelEnv())
	}
	t.Cleanup(func() {
		set(old)
		if m != nil {
			m.SetEnv(e.modelEnv())
		}
	})
}

// anyRP tells whether any interface's dev_caps entry filters by reverse path.
func (e *env) anyRP() bool {
	for _, i := range e.ifaces {
		if i.caps != nil && i.caps.RPFilter != model.RPOff {
			return true
		}
	}
	return false
}

func bit(b bool) string {
	if b {
		return "1"
	}
	return "0"
}

// waitLocal6 waits until every IPv6 address is a local route: even without
// DAD, addrconf completes an address from a workqueue.
func waitLocal6(ifaces map[string]*iface) error {
	deadline := time.Now().Add(5 * time.Second)
	for _, i := range ifaces {
		if i.addr6 == "" {
			continue
		}
		for {
			rs, err := netlink.RouteGet(net.ParseIP(i.addr6))
			if err == nil && len(rs) > 0 && rs[0].Type == 2 /* RTN_LOCAL */ {
				break
			}
			if time.Now().After(deadline) {
				if err == nil {
					err = fmt.Errorf("routes %v", rs)
				}
				return fmt.Errorf("%s: IPv6 address %s never became local: %w", i.name, i.addr6, err)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	return nil
}

// modelEnv describes the namespace to the reference model: the same table
// setup built the interfaces, routes and neighbours from.
func (e *env) modelEnv() model.Env {
	me := model.Env{
		ListenerPorts:      progConfig.ListenerPorts,
		MinRelayPort:       progConfig.MinRelayPort,
		MaxRelayPort:       progConfig.MaxRelayPort,
		Destinations:       destTable,
		LoopbackForwarding: e.loFwd,
		Routes:             e.routes,
		Shield:             e.shield,
		Allocations:        e.allocs,
		NodeAllocations:    e.nodeAllocs,
	}
	for _, name := range ifaceNames {
		i := e.ifaces[name]
		mi := model.Interface{Name: i.name, Index: i.index, MAC: i.mac, MTU: i.mtu, Forwarding: i.fwd, Forwarding6: i.fwd6,
			Attached: i.devmap, Addr: netip.MustParsePrefix(i.addr + "/24"), Neighbours: map[netip.Addr][6]byte{}}
		if i.addr6 != "" {
			mi.Addr6 = netip.MustParsePrefix(i.addr6 + "/64")
		}
		if i.caps != nil {
			c := *i.caps
			mi.Caps = &c
		}
		for ip, mac := range i.neigh {
			mi.Neighbours[netip.MustParseAddr(ip)] = mac
		}
		me.Interfaces = append(me.Interfaces, mi)
		for _, u := range []string{i.unreach, i.unreach6} {
			if u != "" {
				me.Unreachable = append(me.Unreachable, netip.MustParsePrefix(u))
			}
		}
	}
	return me
}

// newModel returns the model of this environment with the given bindings.
func (e *env) newModel(t testing.TB, bs []channelmap.Binding) *model.Model {
	t.Helper()
	m, err := model.New(e.modelEnv(), bs)
	if err != nil {
		t.Fatal(err)
	}
	return m
}

type xdpMD struct {
	Data, DataEnd, DataMeta, IngressIfindex, RxQueueIndex, EgressIfindex uint32
}

// BPF_PROG_RUN takes frames of at least an Ethernet header and at most a page
// less the XDP headroom and the skb_shared_info tailroom.
const (
	minRunFrame = 14
	maxRunFrame = 3000
)

// xdpRunsTakeContext tells whether this kernel's BPF_PROG_RUN takes an XDP
// context (struct xdp_md: the ingress ifindex), which 5.15 added. Before it,
// the tests load relay_ingress.c's build of the program (newEnvWith) and
// pass the ingress in front of the frame (e.run).
var xdpRunsTakeContext = sync.OnceValue(func() bool {
	var uts unix.Utsname
	if err := unix.Uname(&uts); err != nil {
		return true
	}
	var major, minor int
	if _, err := fmt.Sscanf(unix.ByteSliceToString(uts.Release[:]), "%d.%d", &major, &minor); err != nil {
		return true
	}
	return major > 5 || major == 5 && minor >= 15
})

// run runs the program once on frame as if it arrived on the named interface.
func (e *env) run(t testing.TB, ingress string, frame []byte) (uint32, []byte) {
	t.Helper()
	var (
		ret uint32
		out []byte
	)
	err := e.ns.Do(func() error {
		var err error
		ctx := xdpMD{DataEnd: uint32(len(frame)), IngressIfindex: uint32(e.ifaces[ingress].index)}
		buf := make([]byte, len(frame)+512)
		opts := ebpf.RunOptions{Data: frame, DataOut: buf, Context: ctx}
		if !xdpRunsTakeContext() {
			opts.Data = binary.NativeEndian.AppendUint32(nil, ctx.IngressIfindex)
			opts.Data = append(opts.Data, frame...)
			opts.Context = nil
		}
		e.ranAt = model.MonotonicNow()
		ret, err = e.prog.XDP().Run(&opts)
		out = opts.DataOut
		return err
	})
	if err != nil {
		t.Fatalf("BPF_PROG_RUN: %v", err)
	}
	return ret, out
}

func (e *env) verdicts(t testing.TB) []uint64 {
	t.Helper()
	v, err := e.maps.Verdicts()
	if err != nil {
		t.Fatal(err)
	}
	return v
}

func (e *env) totals(t testing.TB) channelmap.Stats {
	t.Helper()
	s, err := e.maps.Totals()
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// listeners reads every binding's reply source (address and port) as the
// kernel has it; "not known" is 0.0.0.0:0, as in the model.
func (e *env) listeners(t testing.TB) map[channelmap.Key]netip.AddrPort {
	t.Helper()
	d, err := e.maps.Dump()
	if err != nil {
		t.Fatal(err)
	}
	out := make(map[channelmap.Key]netip.AddrPort, len(d))
	for k, b := range d {
		out[k] = knownOrZero(b)
	}
	return out
}

// knownOrZero is b's reply source, 0.0.0.0:0 when not known.
func knownOrZero(b channelmap.Binding) netip.AddrPort {
	from := b.ReplyFrom()
	if !from.IsValid() {
		return netip.AddrPortFrom(netip.IPv4Unspecified(), 0)
	}
	return netip.AddrPortFrom(from.Addr().Unmap(), from.Port())
}

// observation is what one BPF_PROG_RUN did, as far as it can be seen.
type observation struct {
	verdict uint32
	out     []byte
	reason  bpf.RelayReason // the one verdict counter that moved
	counted channelmap.Stats
	neigh   uint64 // the TC engine's tc_redirect_neigh moved by this (beside reason)
}

// observe runs frame through the program and reads back the verdict counter
// that moved (exactly one must move, by one) and what the per-binding counters
// gained. The counters are global: they are read before and after rather than
// assumed to start at zero.
func (e *env) observe(t testing.TB, ingress string, frame []byte) observation {
	t.Helper()
	before, beforeTotals := e.verdicts(t), e.totals(t)
	ret, out := e.run(t, ingress, frame)
	after, afterTotals := e.verdicts(t), e.totals(t)
	o := observation{verdict: ret, out: out, reason: movedByOne(t, before, after, bpf.RelayReasonREASON_MAX, reasonName)}
	if o.reason == bpf.RelayReasonREASON_MAX {
		t.Errorf("no verdict counter moved")
	}
	o.counted = statsDelta(beforeTotals, afterTotals)
	return o
}

// movedByOne returns the one counter that moved from before to after (none
// when none did); more than one, or by more than one, fails t.
func movedByOne(t testing.TB, before, after []uint64, none bpf.RelayReason, name func(bpf.RelayReason) string) bpf.RelayReason {
	t.Helper()
	moved := none
	for r := range after {
		switch d := after[r] - before[r]; {
		case d == 0:
		case d == 1 && moved == none:
			moved = bpf.RelayReason(r)
		default:
			t.Errorf("verdict counter %s moved by %d (one counter must move by one)", name(bpf.RelayReason(r)), d)
		}
	}
	return moved
}

func statsDelta(before, after channelmap.Stats) channelmap.Stats {
	return channelmap.Stats{
		ClientToPeerPackets: after.ClientToPeerPackets - before.ClientToPeerPackets,
		ClientToPeerBytes:   after.ClientToPeerBytes - before.ClientToPeerBytes,
		PeerToClientPackets: after.PeerToClientPackets - before.PeerToClientPackets,
		PeerToClientBytes:   after.PeerToClientBytes - before.PeerToClientBytes,
	}
}

// check runs frame through the program and the model (which it advances) and
// fails on any difference: verdict, reason, output bytes, learned listener
// addresses and per-binding counters.
func (e *env) check(t testing.TB, m *model.Model, ingress string, frame []byte) (observation, model.Result) {
	t.Helper()
	got := e.observe(t, ingress, frame)
	clock := m.Now
	m.Now = func() uint64 { return e.ranAt }
	want := m.Process(e.ifaces[ingress].index, frame)
	m.Now = clock
	if got.verdict != uint32(want.Verdict) || got.reason != want.Reason {
		t.Errorf("program: %v %s; model: %v %s", model.Verdict(got.verdict), reasonName(got.reason), want.Verdict, reasonName(want.Reason))
	}
	if !bytes.Equal(got.out, want.Frame) {
		t.Errorf("output differs from the model's\nprogram %x\n  model %x", got.out, want.Frame)
	}
	e.checkEffects(t, m, got.counted, want.Reason, want.Counted, want.DataLen)
	return got, want
}

// checkEffects compares what a run did besides its verdict and bytes with the
// model's: the per-binding counters gained (counted, with dataLen bytes, in
// the direction of reason) and the reply sources learned.
func (e *env) checkEffects(t testing.TB, m *model.Model, gained channelmap.Stats, reason bpf.RelayReason, counted *channelmap.Key, dataLen int) {
	t.Helper()
	var want channelmap.Stats
	if counted != nil {
		if reason == bpf.RelayReasonREASON_RELAY_C2P_TX || reason == bpf.RelayReasonREASON_RELAY_C2P_REDIRECT {
			want.ClientToPeerPackets, want.ClientToPeerBytes = 1, uint64(dataLen)
		} else {
			want.PeerToClientPackets, want.PeerToClientBytes = 1, uint64(dataLen)
		}
	}
	if gained != want {
		t.Errorf("per-binding counters gained %+v, model %+v", gained, want)
	}
	kernel := e.listeners(t)
	for _, b := range m.Bindings() {
		if k, ok := kernel[b.Key()]; !ok || k != knownOrZero(b) {
			t.Errorf("binding %v: reply source %v in the kernel, %v in the model", b.Key(), k, knownOrZero(b))
		}
	}
	if len(kernel) != len(m.Bindings()) {
		t.Errorf("%d bindings in the kernel, %d in the model", len(kernel), len(m.Bindings()))
	}
}

// restore puts learned reply sources back to what the bindings say, so that
// fuzz iterations are independent of each other.
func (e *env) restore(t testing.TB, bs []channelmap.Binding) {
	t.Helper()
	kernel := e.listeners(t)
	for _, b := range bs {
		if kernel[b.Key()] != knownOrZero(b) {
			e.teach(t, b)
		}
	}
}

// slot returns b's binding id and state slot.
func (e *env) slot(t testing.TB, b channelmap.Binding) (uint32, bpf.RelayBindingState) {
	t.Helper()
	var k bpf.RelayP2cKey
	k.PeerAddr.B, k.RelayAddr.B = b.Peer.Addr().As16(), b.OnWire().Addr().As16()
	k.PeerPort, k.RelayPort = htons(b.Peer.Port()), htons(b.OnWire().Port())
	var v bpf.RelayP2cVal
	var st bpf.RelayBindingState
	if err := e.prog.Maps().P2cBindings.Lookup(k, &v); err != nil {
		t.Fatalf("binding %v: %v", b, err)
	}
	if err := e.prog.Maps().BindingStates.Lookup(v.Bind.BindingId, &st); err != nil {
		t.Fatalf("binding %v: state: %v", b, err)
	}
	return v.Bind.BindingId, st
}

// teach writes b's reply source (ReplyFrom: address and port) into b's state
// slot (zero when invalid), as if the program had learned it from a client
// packet: Upsert never seeds it.
func (e *env) teach(t testing.TB, b channelmap.Binding) {
	t.Helper()
	id, st := e.slot(t, b)
	st.ListenerAddr.B, st.ListenerPort = [16]byte{}, 0
	if from := b.ReplyFrom(); from.IsValid() {
		st.ListenerAddr.B, st.ListenerPort = from.Addr().As16(), htons(from.Port())
	}
	if err := e.prog.Maps().BindingStates.Put(id, st); err != nil {
		t.Fatalf("teach %v: %v", b, err)
	}
}

func htons(v uint16) uint16 { return v>>8 | v<<8 }

// replace makes bs the only bindings in the maps.
func (e *env) replace(t testing.TB, bs []channelmap.Binding) {
	t.Helper()
	for _, b := range e.maps.Installed() {
		if err := e.maps.Delete(b.Key()); err != nil {
			t.Fatalf("delete %v: %v", b, err)
		}
	}
	for _, b := range bs {
		if err := e.maps.Upsert(b); err != nil {
			t.Fatalf("install %v: %v", b, err)
		}
		e.teach(t, b)
	}
}

// sortedBindings returns the golden bindings in a fixed order.
func sortedBindings() []channelmap.Binding {
	names := make([]string, 0, len(bindings))
	for n := range bindings {
		names = append(names, n)
	}
	slices.Sort(names)
	out := make([]channelmap.Binding, len(names))
	for i, n := range names {
		out[i] = bindings[n]
	}
	return out
}

// reasonName is the metric label of a reason, for readable failures.
func reasonName(r bpf.RelayReason) string {
	if n, ok := channelmap.ReasonNames[r]; ok {
		return n
	}
	return fmt.Sprintf("reason(%d)", uint32(r))
}
