package bpf_test

import (
	"net"
	"net/netip"
	"os"
	"testing"

	"github.com/vishvananda/netlink"

	"github.com/l7mp/stunnerd-xdp/bpf"
	"github.com/l7mp/stunnerd-xdp/internal/channelmap"
	"github.com/l7mp/stunnerd-xdp/test/model"
	"github.com/l7mp/stunnerd-xdp/test/packet"
)

// The stack's reverse-path filter on the kernel path (model rule 11): with
// rp_filter on an ingress, what the stack would drop as arriving on the wrong
// device (strict) or from a source it has no route back to (loose) passes to
// it, before it teaches the binding anything; what the stack would take is
// relayed as before. Both engines, against the model.

// rpBindings are clients the golden environment has no ordinary route back
// to, beside the golden bindings: one without any route, one behind the
// unreachable route on b0, one at the server's own address on b0, and one
// whose reply source is still to learn.
var rpBindings = []channelmap.Binding{
	{Client: ap("10.99.0.2:40000"), Listener: wildcard4, Channel: 0x4000,
		Peer: ap("10.200.0.2:5090"), Relay: ap("10.200.0.1:50090"), ReplySource: netip.MustParseAddr("10.100.0.1")},
	{Client: ap("10.250.0.2:40000"), Listener: wildcard4, Channel: 0x4000,
		Peer: ap("10.200.0.2:5091"), Relay: ap("10.200.0.1:50091"), ReplySource: netip.MustParseAddr("10.100.0.1")},
	{Client: ap("10.200.0.1:40000"), Listener: wildcard4, Channel: 0x4000,
		Peer: ap("10.200.0.2:5092"), Relay: ap("10.200.0.1:50092"), ReplySource: netip.MustParseAddr("10.100.0.1")},
	{Client: ap("10.100.0.2:40020"), Listener: wildcard4, Channel: 0x4000,
		Peer: ap("10.200.0.2:5093"), Relay: ap("10.200.0.1:50093")},
}

// installRP installs the golden bindings and rpBindings.
func (e *env) installRP(t testing.TB) *model.Model {
	t.Helper()
	bs := append(sortedBindings(), rpBindings...)
	e.replace(t, bs)
	return e.newModel(t, bs)
}

// setRP sets the reverse-path mode of the named interface in its dev_caps
// entry and in the model (restored when t ends).
func (e *env) setRP(t testing.TB, m *model.Model, name string, mode model.RPFilter) {
	t.Helper()
	c := *e.ifaces[name].caps
	c.RPFilter = mode
	e.setCaps(t, m, name, &c)
}

// setLoopbackForwarding sets net.ipv4.conf.lo.forwarding (restored when t
// ends) and moves the FIB generation, as the loader's watch would.
func (e *env) setLoopbackForwarding(t testing.TB, m *model.Model, on bool) {
	t.Helper()
	set := func(on bool) {
		if err := e.ns.Do(func() error {
			return os.WriteFile("/proc/sys/net/ipv4/conf/lo/forwarding", []byte(bit(on)), 0)
		}); err != nil {
			t.Fatal(err)
		}
		e.loFwd = on
		if err := e.prog.FibGen().Bump(); err != nil {
			t.Fatal(err)
		}
		m.SetEnv(e.modelEnv())
	}
	old := e.loFwd
	set(on)
	t.Cleanup(func() { set(old) })
}

// addRoute adds a gateway route (removed when t ends) and moves the FIB
// generation.
func (e *env) addRoute(t testing.TB, m *model.Model, r model.Route) {
	t.Helper()
	_, dst, _ := net.ParseCIDR(r.Dst.String())
	nr := &netlink.Route{Dst: dst, Gw: net.IP(r.Via.AsSlice())}
	change := func(f func(*netlink.Route) error, routes []model.Route) {
		if err := e.ns.Do(func() error { return f(nr) }); err != nil {
			t.Fatal(err)
		}
		e.routes = routes
		if err := e.prog.FibGen().Bump(); err != nil {
			t.Fatal(err)
		}
		m.SetEnv(e.modelEnv())
	}
	old := e.routes
	change(netlink.RouteAdd, append(append([]model.Route(nil), old...), r))
	t.Cleanup(func() { change(netlink.RouteDel, old) })
}

// rpRow is one frame on one ingress with the reverse-path modes it meets,
// and the reason both engines must give.
type rpRow struct {
	name    string
	rp      map[string]model.RPFilter
	loOff   bool // forwarding off on lo
	ingress string
	frame   func(e *env) []byte
	want    bpf.RelayReason
}

func rpRows() []rpRow {
	redirect, v6 := bindings["redirect"], bindings["v6redirect"]
	noRoute, unreach, local := rpBindings[0], rpBindings[1], rpBindings[2]
	smallBack, smallPeer := bindings["clientsmallmtu"], bindings["smallmtu"]
	c2p := func(b channelmap.Binding, listener string) func(*env) []byte {
		return func(*env) []byte {
			return fromClient(b, listener, packet.ChannelData(b.Channel, data(100), nil)).Marshal()
		}
	}
	p2c := func(b channelmap.Binding) func(*env) []byte {
		return func(*env) []byte { return fromPeer(b, data(100)).Marshal() }
	}
	strict := func(names ...string) map[string]model.RPFilter {
		m := map[string]model.RPFilter{}
		for _, n := range names {
			m[n] = model.RPStrict
		}
		return m
	}
	loose := func(names ...string) map[string]model.RPFilter {
		m := map[string]model.RPFilter{}
		for _, n := range names {
			m[n] = model.RPLoose
		}
		return m
	}
	return []rpRow{
		// The client's route back leaves through a0, where it arrives.
		{name: "c2p/strict/right-device", rp: strict("a0", "b0"), ingress: "a0", frame: c2p(redirect, "10.100.0.1"),
			want: bpf.RelayReasonREASON_RELAY_C2P_REDIRECT},
		// Forged: the client's address arriving on b0.
		{name: "c2p/strict/other-device", rp: strict("a0", "b0"), ingress: "b0", frame: c2p(redirect, "10.100.0.1"),
			want: bpf.RelayReasonREASON_RP_FILTER},
		// Loose: a route back exists (through a0): the stack takes it, and so
		// does the relay (out of b0 again: XDP_TX).
		{name: "c2p/loose/other-device", rp: loose("b0"), ingress: "b0", frame: c2p(redirect, "10.100.0.1"),
			want: bpf.RelayReasonREASON_RELAY_C2P_TX},
		// No filter on b0: as before.
		{name: "c2p/off/other-device", rp: strict("a0"), ingress: "b0", frame: c2p(redirect, "10.100.0.1"),
			want: bpf.RelayReasonREASON_RELAY_C2P_TX},
		// The route back leaves through c0, whose MTU (100) the frame is over:
		// the filter does not measure, nor may the lookup (TC's measures the
		// skb itself against the route's device unless given a length).
		{name: "c2p/strict/route-back-small-mtu", rp: strict("a0"), ingress: "a0", frame: c2p(smallBack, "10.201.0.1"),
			want: bpf.RelayReasonREASON_RP_FILTER},
		{name: "c2p/loose/route-back-small-mtu", rp: loose("a0"), ingress: "a0", frame: c2p(smallBack, "10.201.0.1"),
			want: bpf.RelayReasonREASON_RELAY_C2P_REDIRECT},
		{name: "p2c/strict/route-back-small-mtu", rp: strict("b0"), ingress: "b0", frame: p2c(smallPeer),
			want: bpf.RelayReasonREASON_RP_FILTER},
		{name: "p2c/loose/route-back-small-mtu", rp: loose("b0"), ingress: "b0", frame: p2c(smallPeer),
			want: bpf.RelayReasonREASON_RELAY_P2C_REDIRECT},
		{name: "c2p/loose/no-route-back", rp: loose("a0"), ingress: "a0", frame: c2p(noRoute, "10.100.0.1"),
			want: bpf.RelayReasonREASON_RP_FILTER},
		{name: "c2p/strict/no-route-back", rp: strict("a0"), ingress: "a0", frame: c2p(noRoute, "10.100.0.1"),
			want: bpf.RelayReasonREASON_RP_FILTER},
		{name: "c2p/off/no-route-back", ingress: "a0", frame: c2p(noRoute, "10.100.0.1"),
			want: bpf.RelayReasonREASON_RELAY_C2P_REDIRECT},
		{name: "c2p/loose/unreachable-source", rp: loose("a0"), ingress: "a0", frame: c2p(unreach, "10.100.0.1"),
			want: bpf.RelayReasonREASON_RP_FILTER},
		{name: "c2p/loose/local-source", rp: loose("a0"), ingress: "a0", frame: c2p(local, "10.100.0.1"),
			want: bpf.RelayReasonREASON_RP_FILTER},
		// bpf_fib_lookup makes no input lookup from a device with forwarding
		// off: the stack decides.
		{name: "c2p/strict/lo-forwarding-off", rp: strict("a0"), loOff: true, ingress: "a0", frame: c2p(redirect, "10.100.0.1"),
			want: bpf.RelayReasonREASON_RP_UNCHECKED},
		{name: "c2p/off/lo-forwarding-off", loOff: true, ingress: "a0", frame: c2p(redirect, "10.100.0.1"),
			want: bpf.RelayReasonREASON_RELAY_C2P_REDIRECT},
		// IPv6 has no rp_filter.
		{name: "c2p/strict/ipv6-client", rp: strict("a0", "b0"), ingress: "a0", frame: c2p(v6, "fd00:100::1"),
			want: bpf.RelayReasonREASON_RELAY_C2P_REDIRECT},
		// The peer's route back leaves through b0.
		{name: "p2c/strict/right-device", rp: strict("a0", "b0"), ingress: "b0", frame: p2c(redirect),
			want: bpf.RelayReasonREASON_RELAY_P2C_REDIRECT},
		{name: "p2c/strict/other-device", rp: strict("a0", "b0"), ingress: "a0", frame: p2c(redirect),
			want: bpf.RelayReasonREASON_RP_FILTER},
		{name: "p2c/loose/other-device", rp: loose("a0"), ingress: "a0", frame: p2c(redirect),
			want: bpf.RelayReasonREASON_RELAY_P2C_TX},
		{name: "p2c/strict/lo-forwarding-off", rp: strict("b0"), loOff: true, ingress: "b0", frame: p2c(redirect),
			want: bpf.RelayReasonREASON_RP_UNCHECKED},
	}
}

// apply gives the environment and the model the row's reverse-path modes.
func (r rpRow) apply(t *testing.T, e *env, m *model.Model) {
	for name, mode := range r.rp {
		e.setRP(t, m, name, mode)
	}
	if r.loOff {
		e.setLoopbackForwarding(t, m, false)
	}
}

// TestReversePathGoldenPackets runs every rpRows row twice (the second run
// meets what the first cached) through the XDP program and the model.
func TestReversePathGoldenPackets(t *testing.T) {
	e := newEnv(t)
	m := e.installRP(t)
	for _, r := range rpRows() {
		t.Run(r.name, func(t *testing.T) {
			r.apply(t, e, m)
			for run := 0; run < 2; run++ {
				got, _ := e.check(t, m, r.ingress, r.frame(e))
				if got.reason != r.want {
					t.Errorf("run %d: %s, want %s", run, reasonName(got.reason), reasonName(r.want))
				}
			}
		})
	}
}

// TestTCReversePathGoldenPackets: the same rows through the TC engine.
func TestTCReversePathGoldenPackets(t *testing.T) {
	e := newTCEnv(t)
	m := e.installRP(t)
	for _, r := range rpRows() {
		t.Run(r.name, func(t *testing.T) {
			r.apply(t, e.env, m)
			for run := 0; run < 2; run++ {
				got, _ := e.checkTC(t, m, r.ingress, r.frame(e.env), model.SKB{Checksum: model.ChecksumNone})
				if got.reason != r.want {
					t.Errorf("run %d: %s, want %s", run, tcReasonName(got.reason), tcReasonName(r.want))
				}
			}
		})
	}
}

// TestReversePathGenFlag: the program looks at the ingress's reverse-path
// mode only while the FIB generation says some device filters
// (GEN_RP_FILTER), as the loader keeps it; with it clear, a forged packet on
// a strict device is relayed, so the flag is what the loader must keep true.
// Generation 0 (the caches off) carries no flag: the program looks. Both
// engines.
func TestReversePathGenFlag(t *testing.T) {
	b := bindings["redirect"]
	forged := fromClient(b, "10.100.0.1", packet.ChannelData(b.Channel, data(100), nil)).Marshal()
	steps := []struct {
		name string
		set  func(*bpf.FibGen) error
		want bpf.RelayReason
	}{
		{"flag-set", func(g *bpf.FibGen) error { return g.SetReversePath(true) }, bpf.RelayReasonREASON_RP_FILTER},
		{"flag-clear", func(g *bpf.FibGen) error { return g.SetReversePath(false) }, bpf.RelayReasonREASON_RELAY_C2P_TX},
		{"caches-off", (*bpf.FibGen).Disable, bpf.RelayReasonREASON_RP_FILTER},
	}
	run := func(t *testing.T, e *env, check func() bpf.RelayReason) {
		t.Helper()
		m := e.installRP(t)
		e.setRP(t, m, "b0", model.RPStrict)
		t.Cleanup(func() {
			if err := e.prog.FibGen().Enable(); err != nil {
				t.Error(err)
			}
		})
		for _, s := range steps {
			if err := s.set(e.prog.FibGen()); err != nil {
				t.Fatal(err)
			}
			if got := check(); got != s.want {
				t.Errorf("%s: %s, want %s", s.name, tcReasonName(got), tcReasonName(s.want))
			}
		}
	}
	// The model knows no flag: the program's output is compared with the
	// step's reason only.
	t.Run("xdp", func(t *testing.T) {
		e := newEnv(t)
		run(t, e, func() bpf.RelayReason {
			before := e.verdicts(t)
			e.run(t, "b0", forged)
			return movedByOne(t, before, e.verdicts(t), bpf.RelayReasonREASON_MAX, reasonName)
		})
	})
	t.Run("tc", func(t *testing.T) {
		e := newTCEnv(t)
		run(t, e.env, func() bpf.RelayReason {
			before := e.tcVerdicts(t)
			if _, _, err := e.runTC(t, "b0", forged, model.SKB{}); err != nil {
				t.Fatal(err)
			}
			return movedByOne(t, before, e.tcVerdicts(t), bpf.RelayReason(bpf.RelayTcTcReasonTC_REASON_MAX), tcReasonName)
		})
	})
}

// TestReversePathTeachesNothing: a client packet forged from another device
// passes without teaching its binding the address it was sent to (the peer's
// replies keep waiting, or keep their source); the client's own packet
// teaches it. Both engines.
func TestReversePathTeachesNothing(t *testing.T) {
	learn := rpBindings[3]
	forged := fromClient(learn, "10.100.0.100", packet.ChannelData(learn.Channel, data(10), nil)).Marshal()
	real := fromClient(learn, "10.100.0.1", packet.ChannelData(learn.Channel, data(10), nil)).Marshal()
	reply := fromPeer(learn, data(10)).Marshal()
	steps := []struct {
		ingress string
		frame   []byte
		want    bpf.RelayReason
	}{
		{"b0", reply, bpf.RelayReasonREASON_CLIENT_ADDR_UNKNOWN},
		{"b0", forged, bpf.RelayReasonREASON_RP_FILTER},
		{"b0", reply, bpf.RelayReasonREASON_CLIENT_ADDR_UNKNOWN},
		{"a0", real, bpf.RelayReasonREASON_RELAY_C2P_REDIRECT},
		{"b0", forged, bpf.RelayReasonREASON_RP_FILTER},
		{"b0", reply, bpf.RelayReasonREASON_RELAY_P2C_REDIRECT},
	}
	t.Run("xdp", func(t *testing.T) {
		e := newEnv(t)
		m := e.installRP(t)
		e.setRP(t, m, "b0", model.RPStrict)
		for i, s := range steps {
			if got, _ := e.check(t, m, s.ingress, s.frame); got.reason != s.want {
				t.Errorf("step %d: %s, want %s", i, reasonName(got.reason), reasonName(s.want))
			}
		}
	})
	t.Run("tc", func(t *testing.T) {
		e := newTCEnv(t)
		m := e.installRP(t)
		e.setRP(t, m, "b0", model.RPStrict)
		for i, s := range steps {
			if got, _ := e.checkTC(t, m, s.ingress, s.frame, model.SKB{}); got.reason != s.want {
				t.Errorf("step %d: %s, want %s", i, tcReasonName(got.reason), tcReasonName(s.want))
			}
		}
	})
}

// TestReversePathRouteChange: XDP keeps the check's answer with the
// binding's next hop; a route that turns the client's way back to another
// device moves the FIB generation, and the next packet from the old device
// is checked again and passes.
func TestReversePathRouteChange(t *testing.T) {
	e := newEnv(t)
	m := e.installRP(t)
	redirect := bindings["redirect"]
	e.setRP(t, m, "a0", model.RPStrict)
	frame := fromClient(redirect, "10.100.0.1", packet.ChannelData(redirect.Channel, data(100), nil)).Marshal()
	for run := 0; run < 2; run++ {
		if got, _ := e.check(t, m, "a0", frame); got.reason != bpf.RelayReasonREASON_RELAY_C2P_REDIRECT {
			t.Fatalf("before the route: %s", reasonName(got.reason))
		}
	}
	// The client now routed back through the peer's side (b0).
	e.addRoute(t, m, model.Route{Dst: netip.MustParsePrefix("10.100.0.2/32"), Via: netip.MustParseAddr("10.200.0.2")})
	for run := 0; run < 2; run++ {
		if got, _ := e.check(t, m, "a0", frame); got.reason != bpf.RelayReasonREASON_RP_FILTER {
			t.Errorf("after the route, run %d: %s, want %s", run, reasonName(got.reason), reasonName(bpf.RelayReasonREASON_RP_FILTER))
		}
	}
}
