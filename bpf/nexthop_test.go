package bpf_test

import (
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/l7mp/stunnerd-xdp/bpf"
	"github.com/l7mp/stunnerd-xdp/test/model"
	"github.com/l7mp/stunnerd-xdp/test/packet"
)

// TestNextHopCache: a binding's next hops are cached per direction, and every
// change of the tables bpf_fib_lookup reads (neighbour, route, interface down
// and up) reaches the program through the FIB generation that loader.WatchFIB
// moves: once it moved, no packet goes to the next hop the kernel stopped
// using. Each step changes the namespace, waits for the generation, tells the
// model the kernel's new tables, and relays both ways (e.check compares the
// program with the model: verdict, reason, bytes).
func TestNextHopCache(t *testing.T) {
	e := newEnv(t)
	m := e.install(t)
	b := bindings["redirect"] // client 10.100.0.2 on a0, peer 10.200.0.2 on b0
	a0, b0 := e.ifaces["a0"], e.ifaces["b0"]
	c2p := fromClient(b, "10.100.0.1", packet.ChannelData(b.Channel, data(100), nil)).Marshal()
	p2c := fromPeer(b, data(100)).Marshal()
	relay := func(t *testing.T, wantC2P, wantP2C uint32) {
		t.Helper()
		if got, _ := e.check(t, m, "a0", c2p); got.verdict != wantC2P {
			t.Errorf("client->peer: verdict %d, want %d", got.verdict, wantC2P)
		}
		if got, _ := e.check(t, m, "b0", p2c); got.verdict != wantP2C {
			t.Errorf("peer->client: verdict %d, want %d", got.verdict, wantP2C)
		}
	}

	// Both packets in one generation: an event of the namespace's (its
	// setup still being reported, IPv6 router solicitations: on a slow
	// machine, a guest of test/kernels) moves it between them now and then.
	var (
		st  bpf.RelayBindingState
		gen uint32
	)
	for try := 0; ; try++ {
		gen = e.fibGen(t)
		relay(t, xdpRedirect, xdpRedirect)
		if _, st = e.slot(t, b); e.fibGen(t) == gen || try == 20 {
			break
		}
	}
	if st.C2pHop.Gen != gen || st.C2pHop.Dmac != peerMAC || int(st.C2pHop.Ifindex) != b0.index ||
		st.P2cHop.Gen != gen || st.P2cHop.Dmac != clientMAC || int(st.P2cHop.Ifindex) != a0.index {
		t.Fatalf("next hops not cached in generation %d: %+v", gen, st)
	}

	t.Run("cache is used until the generation moves", func(t *testing.T) {
		// A stale entry, as if the neighbour had moved without an event.
		stale := [6]byte{0x02, 0xde, 0xad, 0, 0, 1}
		id, st := e.slot(t, b)
		st.C2pHop.Dmac = stale
		if err := e.prog.Maps().BindingStates.Put(id, st); err != nil {
			t.Fatal(err)
		}
		got := e.observe(t, "a0", c2p)
		if got.verdict != xdpRedirect || len(got.out) < 6 || [6]byte(got.out[:6]) != stale {
			t.Fatalf("the cached next hop was not used: verdict %d, dst MAC %x", got.verdict, got.out[:min(6, len(got.out))])
		}
		if err := e.maps.InvalidateNextHops(); err != nil {
			t.Fatal(err)
		}
		relay(t, xdpRedirect, xdpRedirect) // resolved again: the model's MACs
	})

	cur := e.modelEnv()
	index := func(name string) int {
		for i, ifc := range cur.Interfaces {
			if ifc.Name == name {
				return i
			}
		}
		t.Fatalf("no interface %s", name)
		return -1
	}
	var lag time.Duration
	// change applies f in the namespace and waits until the FIB generation
	// moved, then gives the model the kernel's new tables.
	// A fresh namespace has events of its own for a while (IPv6 addrconf,
	// MLD): the generation must be quiet before a change, so that it moving
	// right after shows this change reached the program.
	const quiet, within = 300 * time.Millisecond, 100 * time.Millisecond
	change := func(t *testing.T, f func() error, update func(*model.Env)) {
		t.Helper()
		before, since := e.fibGen(t), time.Now()
		for deadline := time.Now().Add(10 * time.Second); time.Since(since) < quiet; time.Sleep(5 * time.Millisecond) {
			if g := e.fibGen(t); g != before {
				before, since = g, time.Now()
			}
			if time.Now().After(deadline) {
				t.Fatal("the FIB generation never stays still for 300 ms")
			}
		}
		if err := e.ns.Do(f); err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		for e.fibGen(t) == before {
			if time.Since(start) > within {
				t.Fatalf("the FIB generation did not move within %v of the change", within)
			}
			time.Sleep(100 * time.Microsecond)
		}
		lag = max(lag, time.Since(start))
		update(&cur)
		m.SetEnv(cur)
	}
	neigh := func(ifc *iface, ip string, mac [6]byte) func() error {
		return func() error {
			return netlink.NeighSet(&netlink.Neigh{LinkIndex: ifc.index, State: netlink.NUD_PERMANENT,
				IP: net.ParseIP(ip), HardwareAddr: net.HardwareAddr(mac[:])})
		}
	}
	moved := [6]byte{0x02, 0, 0, 0, 0x20, 0x99}
	movedClient := [6]byte{0x02, 0, 0, 0, 0x10, 0x99}

	t.Run("neighbour changes", func(t *testing.T) {
		change(t, neigh(b0, "10.200.0.2", moved), func(me *model.Env) {
			me.Interfaces[index("b0")].Neighbours[netip.MustParseAddr("10.200.0.2")] = moved
		})
		change(t, neigh(a0, "10.100.0.2", movedClient), func(me *model.Env) {
			me.Interfaces[index("a0")].Neighbours[netip.MustParseAddr("10.100.0.2")] = movedClient
		})
		relay(t, xdpRedirect, xdpRedirect)
	})

	route := &netlink.Route{Dst: &net.IPNet{IP: net.ParseIP("10.200.0.2").To4(), Mask: net.CIDRMask(32, 32)},
		Gw: net.ParseIP("10.100.0.3"), LinkIndex: a0.index}
	t.Run("route changes", func(t *testing.T) {
		// The peer now lies behind a gateway on the client's side: out the
		// ingress (XDP_TX) to the gateway's MAC.
		change(t, func() error { return netlink.RouteAdd(route) }, func(me *model.Env) {
			me.Routes = []model.Route{{Dst: netip.MustParsePrefix("10.200.0.2/32"), Via: netip.MustParseAddr("10.100.0.3")}}
		})
		relay(t, xdpTX, xdpRedirect)
		change(t, func() error { return netlink.RouteDel(route) }, func(me *model.Env) { me.Routes = nil })
		relay(t, xdpRedirect, xdpRedirect)
	})

	t.Run("interface down and up", func(t *testing.T) {
		link := func(up bool) func() error {
			return func() error {
				l, err := netlink.LinkByIndex(b0.index)
				if err != nil {
					return err
				}
				if up {
					return netlink.LinkSetUp(l)
				}
				return netlink.LinkSetDown(l)
			}
		}
		change(t, link(false), func(me *model.Env) { me.Interfaces[index("b0")].Down = true })
		// Nothing may leave through b0 now: to userspace, untouched. (What
		// arrives on b0 still reaches the client through a0.)
		relay(t, xdpPass, xdpRedirect)
		change(t, link(true), func(me *model.Env) {
			me.Interfaces[index("b0")].Down = false
			me.Interfaces[index("b0")].Neighbours = map[netip.Addr][6]byte{}
		})
		// Down flushed b0's neighbours (permanent ones too): until the peer's
		// is back, the kernel resolves it, so the program passes.
		if got, _ := e.check(t, m, "a0", c2p); got.reason != bpf.RelayReasonREASON_FIB_NO_NEIGH {
			t.Errorf("client->peer after up: %s, want pass_fib_no_neigh", reasonName(got.reason))
		}
		change(t, neigh(b0, "10.200.0.2", peerMAC), func(me *model.Env) {
			me.Interfaces[index("b0")].Neighbours = map[netip.Addr][6]byte{netip.MustParseAddr("10.200.0.2"): peerMAC}
		})
		relay(t, xdpRedirect, xdpRedirect)
	})
	t.Logf("longest wait from a change to the FIB generation moving: %v", lag)
}
