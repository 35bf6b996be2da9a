package bpf_test

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/l7mp/stunnerd-xdp/bpf"
	"github.com/l7mp/stunnerd-xdp/internal/channelmap"
	"github.com/l7mp/stunnerd-xdp/internal/loader"
	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// TestTCLivePodPeer: real traffic through a node shaped like a Kubernetes
// node with a peer pod behind a plain veth. A client namespace reaches the
// node over a veth (the NIC) that runs the XDP program natively and the TC
// engine; the pod's namespace sits behind a veth with NO XDP program and
// default offloads (its sender hands over CHECKSUM_PARTIAL skbs), the host
// side addressed and running the TC engine. client->peer: XDP passes (the
// pod's veth is not in its devmap, and could not transmit XDP frames) and TC
// relays into the veth; peer->client enters on the pod's veth, where only TC
// runs. 500 datagrams each way must arrive, intact, relayed by TC and counted
// once. The same again with tx checksumming off on the node's egresses, so
// that the egress computes each CHECKSUM_PARTIAL skb's checksum from
// csum_start, and the receiver verifies it.
func TestTCLivePodPeer(t *testing.T) {
	if testing.Short() {
		t.Skip("network namespaces: not in -short mode")
	}
	testenv.RequireRoot(t)
	var tcCost float64
	for _, noKfunc := range tcSkbReads() {
		for _, v6 := range []bool{false, true} {
			for _, egressSums := range []bool{false, true} {
				t.Run(fmt.Sprintf("%s/client-ipv6=%v/egress-computes-checksum=%v", skbReadName(noKfunc), v6, egressSums), func(t *testing.T) {
					c := livePodPeer(t, egressSums, v6, false, noKfunc)
					if !v6 && !egressSums && tcCost == 0 {
						tcCost = c.tc
					}
				})
			}
		}
	}
	// The same traffic relayed by XDP alone, for the cost of a relay in
	// each engine: the peer is another machine behind a wire (an XDP_PASS
	// program at both far ends, as a NIC receives redirected frames).
	t.Run("peer-behind-a-wire/xdp-relays", func(t *testing.T) {
		c := livePodPeer(t, false, false, true, false)
		if tcCost > 0 && c.xdp > 0 {
			t.Logf("relay cost: TC %.0f ns/run (pod behind a veth) / XDP %.0f ns/run (peer behind a wire) = %.2f", tcCost, c.xdp, tcCost/c.xdp)
		}
	})
}

const (
	liveN       = 500
	liveChannel = 0x4000
)

// livePodPeer runs the rig; with v6 the client is IPv6 (the relay and the pod
// IPv4): the TC engine changes the family with bpf_skb_change_proto, which
// must keep each PARTIAL skb's UDP header where csum_start points.
// With wire, the pod's namespace stands for another machine instead: XDP
// runs on its veth too, an XDP_PASS program at both far ends, and XDP relays
// everything. noKfunc is the TC engine's reading of the skb (newTCEnvWith). It
// returns the programs' mean cost per run.
func livePodPeer(t *testing.T, egressSums, v6, wire, noKfunc bool) liveCost {
	client, node, pod := testenv.NewNSWorker(t), testenv.NewNSWorker(t), testenv.NewNSWorker(t)
	clientAddr, listenerAddr, wildcard, network := "10.1.0.2:40000", "10.1.0.1:3478", "0.0.0.0:3478", "udp4"
	if v6 {
		clientAddr, listenerAddr, wildcard, network = "[fd00:1::2]:40000", "[fd00:1::1]:3478", "[::]:3478", "udp6"
		for _, w := range []*testenv.NSWorker{client, node, pod} {
			if err := w.Do(func() error {
				for _, f := range []string{"all/disable_ipv6", "default/disable_ipv6"} {
					if err := os.WriteFile("/proc/sys/net/ipv6/conf/"+f, []byte("0"), 0); err != nil {
						return err
					}
				}
				return os.WriteFile("/proc/sys/net/ipv6/conf/all/forwarding", []byte("1"), 0)
			}); err != nil {
				t.Fatal(err)
			}
		}
	}
	var clientMAC, podMAC net.HardwareAddr
	var prog *loader.Program
	var tc *loader.TC
	err := node.Do(func() error {
		for _, f := range []string{"all/forwarding", "default/forwarding"} {
			if err := os.WriteFile("/proc/sys/net/ipv4/conf/"+f, []byte("1"), 0); err != nil {
				return err
			}
		}
		// The NIC (n0 <-> c0 in the client's namespace) and the pod's veth
		// (p0 <-> eth0 in the pod's).
		for _, l := range []struct {
			host, peer, addr string
			ns               *testenv.NSWorker
		}{{"n0", "c0", "10.1.0.1/24", client}, {"p0", "eth0", "10.2.0.1/24", pod}} {
			la := netlink.NewLinkAttrs()
			la.Name = l.host
			if err := netlink.LinkAdd(&netlink.Veth{LinkAttrs: la, PeerName: l.peer}); err != nil {
				return err
			}
			h, _ := netlink.LinkByName(l.host)
			p, _ := netlink.LinkByName(l.peer)
			if err := netlink.LinkSetNsFd(p, int(l.ns.NS)); err != nil {
				return err
			}
			a, _ := netlink.ParseAddr(l.addr)
			if err := netlink.AddrAdd(h, a); err != nil {
				return err
			}
			if err := netlink.LinkSetUp(h); err != nil {
				return err
			}
			if v6 && l.host == "n0" {
				if err := addNoDAD(h, "fd00:1::1/64"); err != nil {
					return err
				}
			}
			if egressSums {
				if out, err := exec.Command("ethtool", "-K", l.host, "tx", "off").CombinedOutput(); err != nil {
					return fmt.Errorf("ethtool: %v: %s", err, out)
				}
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, side := range []struct {
		ns         *testenv.NSWorker
		name, addr string
		gw         string
		mac        *net.HardwareAddr
	}{{client, "c0", "10.1.0.2/24", "10.1.0.1", &clientMAC}, {pod, "eth0", "10.2.0.2/24", "10.2.0.1", &podMAC}} {
		err := side.ns.Do(func() error {
			l, err := netlink.LinkByName(side.name)
			if err != nil {
				return err
			}
			a, _ := netlink.ParseAddr(side.addr)
			if err := netlink.AddrAdd(l, a); err != nil {
				return err
			}
			if err := netlink.LinkSetUp(l); err != nil {
				return err
			}
			lo, _ := netlink.LinkByName("lo")
			_ = netlink.LinkSetUp(lo)
			*side.mac = l.Attrs().HardwareAddr
			if v6 && side.name == "c0" {
				if err := addNoDAD(l, "fd00:1::2/64"); err != nil {
					return err
				}
			}
			return netlink.RouteAdd(&netlink.Route{Gw: net.ParseIP(side.gw)}) // a default route
		})
		if err != nil {
			t.Fatal(err)
		}
	}

	cfg := loader.Config{ListenerPorts: []uint16{3478}, MinRelayPort: 49152, MaxRelayPort: 65535, MaxBindings: 1024, TCNoKfunc: noKfunc}
	err = node.Do(func() error {
		// The neighbours resolved, as on a node that has talked to both.
		for _, n := range []struct {
			dev, ip string
			mac     net.HardwareAddr
		}{{"n0", "10.1.0.2", clientMAC}, {"p0", "10.2.0.2", podMAC}, {"n0", "fd00:1::2", clientMAC}} {
			if !v6 && strings.Contains(n.ip, ":") {
				continue
			}
			l, _ := netlink.LinkByName(n.dev)
			if err := netlink.NeighAdd(&netlink.Neigh{LinkIndex: l.Attrs().Index, State: netlink.NUD_PERMANENT,
				IP: net.ParseIP(n.ip), HardwareAddr: n.mac}); err != nil {
				return err
			}
		}
		var err error
		prog, err = loader.Load(cfg, slog.New(slog.NewTextHandler(io.Discard, nil)))
		if err != nil {
			return err
		}
		if _, err := prog.Attach("n0", loader.ModeNative); err != nil {
			return err
		}
		if wire {
			if _, err := prog.Attach("p0", loader.ModeNative); err != nil {
				return err
			}
		}
		if tc, err = prog.LoadTC(); err != nil {
			return err
		}
		for _, dev := range []string{"n0", "p0"} {
			if err := tc.Attach(dev); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = node.Do(func() error { tc.Close(); return prog.Close() })
	})
	if wire {
		for dev, ns := range map[string]*testenv.NSWorker{"c0": client, "eth0": pod} {
			if err := ns.Do(func() error { return attachXDPPass(t, dev) }); err != nil {
				t.Fatal(err)
			}
		}
		// The loader learns that n0 and p0 now transmit XDP frames from
		// the netdev family's notifications, asynchronously: until then
		// XDP rightly passes what would go into them (and TC relays it).
		for _, dev := range []string{"n0", "p0"} {
			var idx int
			if err := node.Do(func() error {
				l, err := netlink.LinkByName(dev)
				if err == nil {
					idx = l.Attrs().Index
				}
				return err
			}); err != nil {
				t.Fatal(err)
			}
			waitXmit(t, prog, idx)
		}
	}
	maps := channelmap.New(prog.Maps())
	if err := maps.SetDestinations(map[netip.AddrPort]netip.AddrPort{ap(listenerAddr): ap(wildcard)}); err != nil {
		t.Fatal(err)
	}
	b := channelmap.Binding{Client: ap(clientAddr), Listener: ap(wildcard), Channel: liveChannel,
		Peer: ap("10.2.0.2:5000"), Relay: ap("10.1.0.1:50000")}
	if err := maps.Upsert(b); err != nil {
		t.Fatal(err)
	}

	var clientConn, podConn *net.UDPConn
	for _, s := range []struct {
		ns            *testenv.NSWorker
		network, addr string
		conn          **net.UDPConn
	}{{client, network, clientAddr, &clientConn}, {pod, "udp4", "10.2.0.2:5000", &podConn}} {
		if err := s.ns.Do(func() error {
			c, err := net.ListenUDP(s.network, net.UDPAddrFromAddrPort(ap(s.addr)))
			*s.conn = c
			return err
		}); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { (*s.conn).Close() })
	}

	stats := liveBPFStats(t)
	before := stats.read(t, prog, tc)

	// client->peer: ChannelData to the listener, the data at the pod.
	payload := func(dir string, i int) []byte {
		return []byte(fmt.Sprintf("%s %04d %s", dir, i, strings.Repeat("x", i%200)))
	}
	got := exchange(t, clientConn, podConn, ap(listenerAddr), 0, func(i int) []byte {
		return channelData(payload("c2p", i))
	}, func(i int, from netip.AddrPort, msg []byte) error {
		if from != ap("10.1.0.1:50000") {
			return fmt.Errorf("from %v, want the relay address", from)
		}
		if !bytes.Equal(msg, payload("c2p", i)) {
			return fmt.Errorf("data %q", msg)
		}
		return nil
	})
	if got != liveN {
		t.Errorf("client->peer: %d of %d arrived", got, liveN)
	}
	// peer->client: datagrams to the relay address, ChannelData at the client.
	got = exchange(t, podConn, clientConn, ap("10.1.0.1:50000"), 4, func(i int) []byte { return payload("p2c", i) },
		func(i int, from netip.AddrPort, msg []byte) error {
			if from != ap(listenerAddr) {
				return fmt.Errorf("from %v, want the listener", from)
			}
			d := payload("p2c", i)
			if len(msg) != 4+len(d) || binary.BigEndian.Uint16(msg) != liveChannel ||
				int(binary.BigEndian.Uint16(msg[2:])) != len(d) || !bytes.Equal(msg[4:], d) {
				return fmt.Errorf("ChannelData %x", msg)
			}
			return nil
		})
	if got != liveN {
		t.Errorf("peer->client: %d of %d arrived", got, liveN)
	}

	after := stats.read(t, prog, tc)
	totals, err := maps.Totals()
	if err != nil {
		t.Fatal(err)
	}
	if totals.ClientToPeerPackets != liveN || totals.PeerToClientPackets != liveN {
		t.Errorf("per-binding counters: %d c2p, %d p2c; want %d each", totals.ClientToPeerPackets, totals.PeerToClientPackets, liveN)
	}
	tcv, xdpv := diff(after.tc, before.tc), diff(after.xdp, before.xdp)
	if wire {
		// XDP relays it all; TC sees none of it.
		tcv, xdpv = xdpv, tcv
	}
	if tcv[bpf.RelayReasonREASON_RELAY_C2P_REDIRECT] != liveN || tcv[bpf.RelayReasonREASON_RELAY_P2C_REDIRECT] != liveN {
		t.Errorf("TC relayed %d c2p, %d p2c; want %d each (TC verdicts %v)", tcv[bpf.RelayReasonREASON_RELAY_C2P_REDIRECT],
			tcv[bpf.RelayReasonREASON_RELAY_P2C_REDIRECT], liveN, nonZero(tcv))
	}
	for _, r := range []bpf.RelayReason{bpf.RelayReasonREASON_RELAY_C2P_TX, bpf.RelayReasonREASON_RELAY_C2P_REDIRECT,
		bpf.RelayReasonREASON_RELAY_P2C_TX, bpf.RelayReasonREASON_RELAY_P2C_REDIRECT} {
		if xdpv[r] != 0 {
			t.Errorf("XDP counted %d %s: a packet is relayed by one engine", xdpv[r], reasonName(r))
		}
	}
	if wire {
		tcv, xdpv = xdpv, tcv
	}
	t.Logf("XDP verdicts %v; TC verdicts %v", nonZero(xdpv), nonZero(tcv))
	for name, ns := range map[string]*testenv.NSWorker{"client": client, "pod": pod} {
		if n := udpCsumErrors(t, ns); n != 0 {
			t.Errorf("%s: %d UDP checksum errors", name, n)
		}
	}
	return stats.report(t, before, after)
}

// attachXDPPass attaches a program that passes every frame to the device, in
// native mode, as a NIC that receives redirected frames; it stays until the
// namespace goes.
func attachXDPPass(t *testing.T, dev string) error {
	p, err := ebpf.NewProgram(&ebpf.ProgramSpec{Type: ebpf.XDP, License: "GPL",
		Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, 2 /* XDP_PASS */), asm.Return()}})
	if err != nil {
		return err
	}
	t.Cleanup(func() { p.Close() })
	ifc, err := net.InterfaceByName(dev)
	if err != nil {
		return err
	}
	l, err := link.AttachXDP(link.XDPOptions{Program: p, Interface: ifc.Index, Flags: link.XDPDriverMode})
	if err != nil {
		return err
	}
	t.Cleanup(func() { l.Close() })
	return nil
}

// waitXmit waits up to 5 s for the program's dev_caps to say that ifindex
// transmits XDP frames.
func waitXmit(t *testing.T, prog *loader.Program, ifindex int) {
	t.Helper()
	var v bpf.RelayDevCap
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		if err := prog.Maps().DevCaps.Lookup(uint32(ifindex), &v); err == nil && v.Flags&bpf.RelayDevFlagDEV_XDP_XMIT != 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("ifindex %d: dev_caps %+v after 5 s, want XDP_XMIT", ifindex, v)
		}
	}
}

// addNoDAD adds an IPv6 address usable at once.
func addNoDAD(l netlink.Link, cidr string) error {
	a, err := netlink.ParseAddr(cidr)
	if err != nil {
		return err
	}
	a.Flags = unix.IFA_F_NODAD
	return netlink.AddrAdd(l, a)
}

// exchange sends liveN messages from one socket to dst, reads what arrives at
// the other (checking each with check) and returns how many arrived intact.
func exchange(t *testing.T, from, to *net.UDPConn, dst netip.AddrPort, skip int, msg func(int) []byte,
	check func(int, netip.AddrPort, []byte) error) int {
	t.Helper()
	testenv.ReadBuffer(t, to, 4<<20)
	got := make(chan int)
	go func() {
		n, buf := 0, make([]byte, 2048)
		for {
			_ = to.SetReadDeadline(time.Now().Add(2 * time.Second))
			l, a, err := to.ReadFromUDPAddrPort(buf)
			if err != nil {
				got <- n
				return
			}
			var i int
			if _, err := fmt.Sscanf(string(buf[min(skip, l):l]), "%s %d", new(string), &i); err != nil {
				t.Errorf("unreadable message %x", buf[:l])
				continue
			}
			if err := check(i, a, buf[:l]); err != nil {
				t.Errorf("message %d: %v", i, err)
				continue
			}
			n++
		}
	}()
	for i := range liveN {
		if _, err := from.WriteToUDPAddrPort(msg(i), dst); err != nil {
			t.Errorf("send %d: %v", i, err)
		}
		if i%20 == 19 {
			time.Sleep(time.Millisecond) // a bounded, paced load
		}
	}
	return <-got
}

// udpCsumErrors reads Udp InCsumErrors of the namespace (/proc/net/snmp).
func udpCsumErrors(t *testing.T, ns *testenv.NSWorker) int {
	t.Helper()
	var n int
	err := ns.Do(func() error {
		b, err := os.ReadFile("/proc/net/snmp")
		if err != nil {
			return err
		}
		var head []string
		for _, line := range strings.Split(string(b), "\n") {
			f := strings.Fields(line)
			if len(f) == 0 || f[0] != "Udp:" {
				continue
			}
			if head == nil {
				head = f
				continue
			}
			for i := range head {
				if head[i] == "InCsumErrors" {
					n, err = strconv.Atoi(f[i])
					return err
				}
			}
		}
		return fmt.Errorf("no Udp InCsumErrors")
	})
	if err != nil {
		t.Fatal(err)
	}
	return n
}

type liveCounts struct {
	xdp, tc           []uint64
	xdpRuns, tcRuns   uint64
	xdpNanos, tcNanos time.Duration
}

func diff(a, b []uint64) map[bpf.RelayReason]uint64 {
	out := map[bpf.RelayReason]uint64{}
	for i := range a {
		out[bpf.RelayReason(i)] = a[i] - b[i]
	}
	return out
}

func nonZero(m map[bpf.RelayReason]uint64) map[string]uint64 {
	out := map[string]uint64{}
	for r, n := range m {
		if n != 0 {
			out[tcReasonName(r)] = n
		}
	}
	return out
}

// bpfStats turns kernel.bpf_stats_enabled on for the test (and back to what
// it was): the programs' run time and run count (live cost).
type bpfStats struct{}

func liveBPFStats(t *testing.T) bpfStats {
	const knob = "/proc/sys/kernel/bpf_stats_enabled"
	old, err := os.ReadFile(knob)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(knob, []byte("1"), 0); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.WriteFile(knob, old, 0) })
	return bpfStats{}
}

func (bpfStats) read(t *testing.T, prog *loader.Program, tc *loader.TC) liveCounts {
	t.Helper()
	var c liveCounts
	var err error
	m := channelmap.New(prog.Maps())
	if c.xdp, err = m.Verdicts(); err != nil {
		t.Fatal(err)
	}
	if c.tc, err = tc.Verdicts(); err != nil {
		t.Fatal(err)
	}
	xs, err := prog.XDP().Stats()
	if err != nil {
		t.Fatal(err)
	}
	ts, err := tc.Prog().Stats()
	if err != nil {
		t.Fatal(err)
	}
	c.xdpRuns, c.xdpNanos, c.tcRuns, c.tcNanos = xs.RunCount, xs.Runtime, ts.RunCount, ts.Runtime
	return c
}

// liveCost is each program's mean live cost per run, in ns.
type liveCost struct{ xdp, tc float64 }

// report logs each program's mean live cost over the run and their ratio.
func (bpfStats) report(t *testing.T, before, after liveCounts) liveCost {
	xr, tr := after.xdpRuns-before.xdpRuns, after.tcRuns-before.tcRuns
	if xr == 0 || tr == 0 {
		t.Errorf("BPF stats: %d XDP runs, %d TC runs", xr, tr)
		return liveCost{}
	}
	c := liveCost{xdp: float64(after.xdpNanos-before.xdpNanos) / float64(xr), tc: float64(after.tcNanos-before.tcNanos) / float64(tr)}
	t.Logf("live cost (kernel.bpf_stats_enabled): XDP %.0f ns/run over %d runs, TC %.0f ns/run over %d runs: TC/XDP %.2f",
		c.xdp, xr, c.tc, tr, c.tc/c.xdp)
	return c
}
