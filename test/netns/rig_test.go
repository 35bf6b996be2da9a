package netns_test

import (
	"encoding/binary"
	"fmt"
	"net"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"

	"github.com/l7mp/stunnerd-xdp/test/netns"
	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

func TestRouted(t *testing.T) {
	netns.RequirePrivileged(t, "ethtool")
	r := netns.NewRouted(t)

	reachable(t, r.Client, r.Server, r.ServerClientIf.Addr)
	reachable(t, r.Server, r.Peer, r.PeerIf.Addr)
	reachable(t, r.Peer, r.Server, r.ServerPeerIf.Addr)
	unreachable(t, r.Client, r.Peer, r.PeerIf.Addr)
	unreachable(t, r.Peer, r.Client, r.ClientIf.Addr)

	checkSetup(t, r)
	for _, iface := range []struct {
		ns   *netns.NS
		name string
	}{{r.Client, "cl0"}, {r.Peer, "peer0"}} {
		if out := iface.ns.IP(t, "link", "show", iface.name); !strings.Contains(out, "prog/xdp") {
			t.Errorf("no native XDP program on %s:\n%s", iface.name, out)
		}
	}

	// Per-device forwarding is enough for the kernel too: with routes, client and peer connect
	// through the server although net.ipv4.ip_forward is 0.
	r.Client.IP(t, "route", "add", "10.200.0.0/24", "via", r.ServerClientIf.Addr.String())
	r.Peer.IP(t, "route", "add", "10.100.0.0/24", "via", r.ServerPeerIf.Addr.String())
	reachable(t, r.Client, r.Peer, r.PeerIf.Addr)
}

func TestBridged(t *testing.T) {
	netns.RequirePrivileged(t, "ethtool")
	r := netns.New(t, netns.Bridged())

	if got := r.ServerIfaces(); len(got) != 1 || got[0] != "srv0" {
		t.Fatalf("ServerIfaces() = %v, want [srv0]", got)
	}
	reachable(t, r.Client, r.Server, r.ServerClientIf.Addr)
	reachable(t, r.Peer, r.Server, r.ServerPeerIf.Addr)
	reachable(t, r.Server, r.Peer, r.PeerIf.Addr)
	unreachable(t, r.Client, r.Peer, r.PeerIf.Addr)
	unreachable(t, r.Peer, r.Client, r.ClientIf.Addr)

	checkSetup(t, r)
	if out := r.Bridge.IP(t, "link", "show", "brs"); !strings.Contains(out, "prog/xdp") {
		t.Errorf("no native XDP program on brs:\n%s", out)
	}
}

// checkSetup checks the sysctls, offloads and routes common to both rigs.
func checkSetup(t *testing.T, r *netns.Rig) {
	t.Helper()
	want := map[string]string{"net.ipv4.ip_forward": "0", "net.ipv6.conf.all.disable_ipv6": "1"}
	for _, name := range r.ServerIfaces() {
		want["net.ipv4.conf."+name+".forwarding"] = "1"
	}
	for key, value := range want {
		if got := sysctl(t, r.Server, key); got != value {
			t.Errorf("server: %s = %s, want %s", key, got, value)
		}
	}
	if err := r.SendersOffloadChecksums(); err != nil {
		t.Error(err)
	}
	route := "default via " + r.PeerIf.Addr.String() + " dev " + r.ServerPeerIf.Name
	if out := r.Server.IP(t, "-4", "route", "show", "default"); !strings.HasPrefix(out, route) {
		t.Errorf("server's default route: %q, want %q", out, route)
	}
}

// TestRoutedRedirect shows that frames the server XDP_REDIRECTs from srv0 into srv1 arrive at peer0.
func TestRoutedRedirect(t *testing.T) {
	netns.RequirePrivileged(t)
	r := netns.NewRouted(t)

	srv1 := ifindex(t, r.Server, r.ServerPeerIf.Name)
	r.Server.AttachXDP(t, r.ServerClientIf.Name, loadXDP(t, asm.Instructions{
		asm.Mov.Imm(asm.R1, int32(srv1)),
		asm.Mov.Imm(asm.R2, 0),
		asm.FnRedirect.Call(),
		asm.Return(),
	}))

	// The frames keep srv0's MAC as destination, so peer0 counts and then drops them.
	const n = 20
	before := rxPackets(t, r.Peer, r.PeerIf.Name)
	sendUDP(t, r.Client, r.ServerClientIf.Addr.String()+":9", n)
	waitRx(t, r.Peer, r.PeerIf.Name, before+n)
}

// TestBridgedTX shows that frames the server XDP_TXes out of srv0 cross the bridge to the client.
func TestBridgedTX(t *testing.T) {
	netns.RequirePrivileged(t)
	r := netns.New(t, netns.Bridged())

	// Swap the Ethernet addresses and bounce the frame: the bridge forwards it back to the sender.
	prog := asm.Instructions{
		asm.LoadMem(asm.R2, asm.R1, 0, asm.Word), // xdp_md->data
		asm.LoadMem(asm.R3, asm.R1, 4, asm.Word), // xdp_md->data_end
		asm.Mov.Reg(asm.R4, asm.R2),
		asm.Add.Imm(asm.R4, 14),
		asm.JGT.Reg(asm.R4, asm.R3, "pass"),
	}
	for off := int16(0); off < 6; off += 2 {
		prog = append(prog,
			asm.LoadMem(asm.R4, asm.R2, off, asm.Half),
			asm.LoadMem(asm.R5, asm.R2, off+6, asm.Half),
			asm.StoreMem(asm.R2, off, asm.R5, asm.Half),
			asm.StoreMem(asm.R2, off+6, asm.R4, asm.Half),
		)
	}
	prog = append(prog,
		asm.Mov.Imm(asm.R0, 3), // XDP_TX
		asm.Return(),
		asm.Mov.Imm(asm.R0, 2).WithSymbol("pass"), // XDP_PASS
		asm.Return(),
	)
	r.Server.AttachXDP(t, r.ServerClientIf.Name, loadXDP(t, prog))

	const n = 20
	before := rxPackets(t, r.Client, r.ClientIf.Name)
	sendUDP(t, r.Client, r.ServerClientIf.Addr.String()+":9", n)
	waitRx(t, r.Client, r.ClientIf.Name, before+n)
}

// TestCleanup checks that a rig's namespaces and the process groups it started are gone once the
// test that made them ends.
func TestCleanup(t *testing.T) {
	netns.RequirePrivileged(t)
	var names []string
	var pids []int
	t.Run("rig", func(t *testing.T) {
		r := netns.New(t, netns.Bridged(), netns.WithTag("tagged"))
		for _, n := range []*netns.NS{r.Client, r.Server, r.Peer, r.Bridge, netns.NewNS(t, "bare")} {
			names = append(names, n.Name)
		}
		if !strings.HasPrefix(r.Server.Name, netns.NamePrefix+"tagged-") {
			t.Errorf("WithTag: server namespace %s", r.Server.Name)
		}
		// A shell with a child, to check that the whole group dies.
		p := r.Client.Start(t, "sh", "-c", "sleep 60 & echo $!; wait")
		if err := netns.Eventually(5*time.Second, 10*time.Millisecond, func() error {
			if !strings.Contains(p.Stdout(), "\n") {
				return fmt.Errorf("no child PID: %q %q", p.Stdout(), p.Stderr())
			}
			return nil
		}); err != nil {
			t.Fatal(err)
		}
		child, err := strconv.Atoi(strings.TrimSpace(p.Stdout()))
		if err != nil {
			t.Fatal(err)
		}
		pids = append(pids, p.PID(), child)
	})
	list, err := netns.Exec("ip", "netns", "list")
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range names {
		if strings.Contains(list, name) {
			t.Errorf("netns %s still exists:\n%s", name, list)
		}
	}
	for _, pid := range pids {
		// The signal may still be on its way to the child.
		if err := netns.Eventually(2*time.Second, 10*time.Millisecond, func() error {
			if alive(pid) {
				return fmt.Errorf("pid %d still running", pid)
			}
			return nil
		}); err != nil {
			t.Error(err)
		}
	}
}

// alive reports whether pid runs: a zombie (the orphaned child, until init reaps it) does not.
func alive(pid int) bool {
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	// pid (comm) state ...
	fields := strings.Fields(string(stat[strings.LastIndexByte(string(stat), ')')+1:]))
	return len(fields) > 0 && fields[0] != "Z"
}

// TestSnmp checks that Snmp reads the counters of the namespace, not of the test process, and
// that sockets opened in Do stay in their namespace.
func TestSnmp(t *testing.T) {
	netns.RequirePrivileged(t)
	r := netns.NewRouted(t)

	var conn net.PacketConn
	err := r.Peer.Do(func() error {
		var err error
		conn, err = net.ListenPacket("udp4", r.PeerIf.Addr.String()+":7000")
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()

	const n = 10
	before := r.Peer.Snmp(t)
	sendUDP(t, r.Server, r.PeerIf.Addr.String()+":7000", n)
	buf := make([]byte, 100)
	for i := 0; i < n; i++ {
		_ = conn.SetReadDeadline(time.Now().Add(testenv.Timeout(5 * time.Second)))
		if _, _, err := conn.ReadFrom(buf); err != nil {
			t.Fatalf("datagram %d: %v", i, err)
		}
	}
	after := r.Peer.Snmp(t)
	if got := after["Udp.InDatagrams"] - before["Udp.InDatagrams"]; got != n {
		t.Errorf("peer Udp.InDatagrams grew by %d, want %d", got, n)
	}
	if got := r.Server.Snmp(t)["Udp.OutDatagrams"]; got != n {
		t.Errorf("server Udp.OutDatagrams = %d, want %d", got, n)
	}
	// Same as what a process inside the namespace sees.
	for _, line := range strings.Split(r.Peer.Run(t, "cat", "/proc/net/snmp"), "\n") {
		if f := strings.Fields(line); len(f) > 1 && f[0] == "Udp:" && f[1] != "InDatagrams" {
			if f[1] != strconv.FormatInt(after["Udp.InDatagrams"], 10) {
				t.Errorf("cat /proc/net/snmp: %q, Snmp: Udp.InDatagrams=%d", line, after["Udp.InDatagrams"])
			}
		}
	}
}

func loadXDP(t *testing.T, insns asm.Instructions) *ebpf.Program {
	t.Helper()
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{Type: ebpf.XDP, License: "GPL", Instructions: insns})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { prog.Close() })
	return prog
}

// sendUDP sends n small datagrams to addr from inside ns.
func sendUDP(t *testing.T, ns *netns.NS, addr string, n int) {
	t.Helper()
	err := ns.Do(func() error {
		conn, err := net.Dial("udp4", addr)
		if err != nil {
			return err
		}
		defer conn.Close()
		for i := 0; i < n; i++ {
			if _, err := conn.Write([]byte("netns test datagram")); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatalf("netns %s: sending to %s: %v", ns.Name, addr, err)
	}
}

func rxPackets(t *testing.T, ns *netns.NS, iface string) int64 {
	t.Helper()
	out := ns.Run(t, "cat", "/sys/class/net/"+iface+"/statistics/rx_packets")
	n, err := strconv.ParseInt(strings.TrimSpace(out), 10, 64)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// waitRx waits up to 2s for the rx packet counter of iface to reach want.
func waitRx(t *testing.T, ns *netns.NS, iface string, want int64) {
	t.Helper()
	if err := netns.Eventually(2*time.Second, 50*time.Millisecond, func() error {
		if got := rxPackets(t, ns, iface); got < want {
			return fmt.Errorf("%s rx_packets = %d, want at least %d", iface, got, want)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
}

// reach sends a datagram from one namespace to addr:7001 in another and waits up to 1s for it.
func reach(from, to *netns.NS, addr netip.Addr) error {
	dst := netip.AddrPortFrom(addr, 7001).String()
	network := "udp6"
	if addr.Is4() {
		network = "udp4"
	}
	var conn net.PacketConn
	if err := to.Do(func() (err error) {
		conn, err = net.ListenPacket(network, dst)
		return err
	}); err != nil {
		return err
	}
	defer conn.Close()
	var c net.Conn
	if err := from.Do(func() (err error) {
		c, err = net.Dial(network, dst)
		return err
	}); err != nil {
		return err
	}
	defer c.Close()
	// A datagram every 100 ms until one arrives: a fresh rig's links come
	// up asynchronously (linkwatch batches carrier changes for up to a
	// second on a loaded machine), and a bridge port forwards only then.
	deadline := time.Now().Add(testenv.Timeout(2 * time.Second))
	for {
		if _, err := c.Write([]byte("reach")); err != nil && time.Now().After(deadline) {
			return err
		}
		_ = conn.SetReadDeadline(time.Now().Add(100 * time.Millisecond))
		_, _, err := conn.ReadFrom(make([]byte, 16))
		if err == nil || time.Now().After(deadline) {
			return err
		}
	}
}

func reachable(t *testing.T, from, to *netns.NS, addr netip.Addr) {
	t.Helper()
	if err := reach(from, to, addr); err != nil {
		t.Errorf("%s cannot reach %s in %s: %v", from.Name, addr, to.Name, err)
	}
}

func unreachable(t *testing.T, from, to *netns.NS, addr netip.Addr) {
	t.Helper()
	if err := reach(from, to, addr); err == nil {
		t.Errorf("%s reaches %s in %s", from.Name, addr, to.Name)
	}
}

// TestFibLookup runs bpf_fib_lookup as the server's XDP program would, for a packet that arrived on
// srv0 and goes to the peer: the rig's forwarding sysctls and neighbour entries must let it
// succeed (egress srv1 in the routed rig, back out of srv0 in the bridged one), and it must fail
// with FWD_DISABLED without them.
func TestFibLookup(t *testing.T) {
	netns.RequirePrivileged(t)
	const (
		retFwdDisabled = 5 // BPF_FIB_LKUP_RET_FWD_DISABLED
		retNoNeigh     = 7 // BPF_FIB_LKUP_RET_NO_NEIGH
	)
	for _, tc := range []struct {
		name string
		opts []netns.Option
	}{{"routed", nil}, {"bridged", []netns.Option{netns.Bridged()}}} {
		t.Run(tc.name, func(t *testing.T) {
			r := netns.New(t, tc.opts...)
			in := ifindex(t, r.Server, r.ServerClientIf.Name)
			out := ifindex(t, r.Server, r.ServerPeerIf.Name)
			if got, want := fibLookup(t, r, in, r.PeerIf.Addr), uint32(out)<<8; got != want {
				t.Errorf("fib lookup to peer = %#x, want %#x (egress %s)", got, want, r.ServerPeerIf.Name)
			}
			if got := fibLookup(t, r, in, netip.MustParseAddr("10.200.0.3")); got != retNoNeigh {
				t.Errorf("fib lookup to a host without neighbour entry = %d, want %d (NO_NEIGH)", got, retNoNeigh)
			}
			// An address the node has no route of its own for leaves by the default route.
			if got, want := fibLookup(t, r, in, netip.MustParseAddr("10.96.0.10")), uint32(out)<<8; got != want {
				t.Errorf("fib lookup beyond the node = %#x, want %#x (the default route, egress %s)", got, want, r.ServerPeerIf.Name)
			}
			r.Server.Run(t, "sysctl", "-q", "-w", "net.ipv4.conf."+r.ServerClientIf.Name+".forwarding=0")
			if got := fibLookup(t, r, in, r.PeerIf.Addr); got != retFwdDisabled {
				t.Errorf("fib lookup with forwarding off = %d, want %d (FWD_DISABLED)", got, retFwdDisabled)
			}
		})
	}
}

// fibLookup runs bpf_fib_lookup through BPF_PROG_RUN in the server namespace for a UDP packet from
// the client to dst that arrived on ifindex in. It returns the lookup's result code, or on success
// the egress ifindex shifted left by 8.
func fibLookup(t *testing.T, r *netns.Rig, in int, dst netip.Addr) uint32 {
	t.Helper()
	return runFibLookup(t, r, in, asm.Instructions{
		asm.StoreImm(asm.R10, fibParams+0, 2, asm.Byte),   // AF_INET
		asm.StoreImm(asm.R10, fibParams+1, 17, asm.Byte),  // IPPROTO_UDP
		asm.StoreImm(asm.R10, fibParams+6, 100, asm.Half), // tot_len
		asm.StoreImm(asm.R10, fibParams+16, int64(int32(nativeU32(r.ClientIf.Addr.As4()))), asm.Word),
		asm.StoreImm(asm.R10, fibParams+32, int64(int32(nativeU32(dst.As4()))), asm.Word),
	})
}

// fibParams is where struct bpf_fib_lookup sits on the stack: r10-64.
const fibParams = -64

// runFibLookup zeroes struct bpf_fib_lookup on the stack, sets its ingress
// ifindex, applies fields (family, l4_protocol, tot_len, addresses), calls
// bpf_fib_lookup and runs that program once in the server namespace, where the
// context's ingress ifindex is resolved. It returns the result code, or on
// success the egress ifindex shifted left by 8.
func runFibLookup(t *testing.T, r *netns.Rig, in int, fields asm.Instructions) uint32 {
	t.Helper()
	insns := asm.Instructions{asm.Mov.Reg(asm.R6, asm.R1)}
	for off := int16(fibParams); off < 0; off += 4 {
		insns = append(insns, asm.StoreImm(asm.R10, off, 0, asm.Word))
	}
	insns = append(insns, asm.StoreImm(asm.R10, fibParams+8, int64(in), asm.Word))
	insns = append(insns, fields...)
	insns = append(insns,
		asm.Mov.Reg(asm.R1, asm.R6),
		asm.Mov.Reg(asm.R2, asm.R10),
		asm.Add.Imm(asm.R2, fibParams),
		asm.Mov.Imm(asm.R3, 64),
		asm.Mov.Imm(asm.R4, 0),
		asm.FnFibLookup.Call(),
		asm.JNE.Imm(asm.R0, 0, "out"),
		asm.LoadMem(asm.R0, asm.R10, fibParams+8, asm.Word),
		asm.LSh.Imm(asm.R0, 8),
		asm.Return().WithSymbol("out"),
	)
	prog := loadXDP(t, insns)
	var ret uint32
	err := r.Server.Do(func() error {
		var err error
		ret, err = prog.Run(&ebpf.RunOptions{
			Data:    make([]byte, 64),
			Context: xdpMd{IngressIfindex: uint32(in)},
		})
		return err
	})
	if err != nil {
		t.Fatalf("BPF_PROG_RUN: %v", err)
	}
	return ret
}

// xdpMd is struct xdp_md, the context of BPF_PROG_RUN for XDP.
type xdpMd struct {
	Data, DataEnd, DataMeta, IngressIfindex, RxQueueIndex, EgressIfindex uint32
}

// nativeU32 reads 4 bytes in network order the way a little-endian load from the packet would.
func nativeU32(b [4]byte) uint32 { return binary.NativeEndian.Uint32(b[:]) }

func ifindex(t *testing.T, ns *netns.NS, name string) int {
	t.Helper()
	var index int
	err := ns.Do(func() error {
		ifi, err := net.InterfaceByName(name)
		if ifi != nil {
			index = ifi.Index
		}
		return err
	})
	if err != nil {
		t.Fatalf("netns %s: %v", ns.Name, err)
	}
	return index
}
