package netns_test

import (
	"net/netip"
	"strings"
	"testing"

	"github.com/cilium/ebpf/asm"

	"github.com/l7mp/stunnerd-xdp/test/netns"
)

// TestIPv6 checks the rigs built WithIPv6: the client and the server talk IPv6 between cl0 and
// srv0 with no DAD, no link-local addresses and permanent neighbours, the peer side stays IPv4
// only and unreachable from the client, forwarding is per device only, and bpf_fib_lookup for a
// peer->client packet (arriving on the server's peer-facing interface) finds the client.
func TestIPv6(t *testing.T) {
	netns.RequirePrivileged(t, "ethtool")
	for _, tc := range []struct {
		name string
		opts []netns.Option
	}{{"routed", nil}, {"bridged", []netns.Option{netns.Bridged()}}} {
		t.Run(tc.name, func(t *testing.T) {
			r := netns.New(t, append(tc.opts, netns.WithIPv6())...)
			if r.ClientIf.Addr6 != netip.MustParseAddr("fd00:100::2") || r.ServerClientIf.Addr6 != netip.MustParseAddr("fd00:100::1") {
				t.Fatalf("client %v, server %v: want fd00:100::2 and fd00:100::1", r.ClientIf.Addr6, r.ServerClientIf.Addr6)
			}
			if r.PeerIf.Addr6.IsValid() || (r.ServerPeerIf.Name != r.ServerClientIf.Name && r.ServerPeerIf.Addr6.IsValid()) {
				t.Errorf("peer side has IPv6: peer %v, server %v", r.PeerIf.Addr6, r.ServerPeerIf.Addr6)
			}

			reachable(t, r.Client, r.Server, r.ServerClientIf.Addr6)
			reachable(t, r.Server, r.Client, r.ClientIf.Addr6)
			// IPv4 as before.
			reachable(t, r.Client, r.Server, r.ServerClientIf.Addr)
			reachable(t, r.Server, r.Peer, r.PeerIf.Addr)
			unreachable(t, r.Client, r.Peer, r.PeerIf.Addr)
			unreachable(t, r.Peer, r.Client, r.ClientIf.Addr)
			unreachable(t, r.Peer, r.Client, r.ClientIf.Addr6)
			checkSetup(t, r)
			checkIPv6Setup(t, r)

			// Addresses are usable at once (nodad) and there are no link-local ones.
			for _, iface := range []struct {
				ns   *netns.NS
				name string
			}{{r.Client, r.ClientIf.Name}, {r.Server, r.ServerClientIf.Name}} {
				out := iface.ns.IP(t, "-6", "addr", "show", "dev", iface.name)
				if strings.Contains(out, "tentative") || strings.Contains(out, "fe80:") || !strings.Contains(out, "fd00:100::") {
					t.Errorf("%s: want only fd00:100::/64, not tentative:\n%s", iface.name, out)
				}
			}
			// Permanent neighbours both ways.
			for _, n := range []struct {
				ns   *netns.NS
				dev  string
				addr netip.Addr
			}{{r.Client, r.ClientIf.Name, r.ServerClientIf.Addr6}, {r.Server, r.ServerClientIf.Name, r.ClientIf.Addr6}} {
				if out := n.ns.IP(t, "-6", "neigh", "show", n.addr.String(), "dev", n.dev); !strings.Contains(out, "PERMANENT") {
					t.Errorf("%s: neighbour %s not permanent: %q", n.ns.Name, n.addr, out)
				}
			}

			// bpf_fib_lookup AF_INET6 as the XDP program does it for a peer->client packet.
			in := ifindex(t, r.Server, r.ServerPeerIf.Name)
			out := ifindex(t, r.Server, r.ServerClientIf.Name)
			if got, want := fibLookup6(t, r, in, r.ClientIf.Addr6), uint32(out)<<8; got != want {
				t.Errorf("IPv6 fib lookup to the client = %#x, want %#x (egress %s)", got, want, r.ServerClientIf.Name)
			}
			if got := fibLookup6(t, r, in, netip.MustParseAddr("fd00:100::3")); got != retNoNeigh {
				t.Errorf("IPv6 fib lookup to a host without neighbour entry = %d, want %d (NO_NEIGH)", got, retNoNeigh)
			}
			if got := fibLookup6(t, r, in, netip.MustParseAddr("fd00:300::1")); got != retNotFwded {
				t.Errorf("IPv6 fib lookup without a route = %d, want %d (NOT_FWDED)", got, retNotFwded)
			}
			// The IPv4 lookup for client->peer is unchanged.
			if got, want := fibLookup(t, r, out, r.PeerIf.Addr), uint32(in)<<8; got != want {
				t.Errorf("IPv4 fib lookup to the peer = %#x, want %#x", got, want)
			}
			// The ingress device's IPv6 forwarding is what counts.
			r.Server.Run(t, "sysctl", "-q", "-w", "net.ipv6.conf."+r.ServerPeerIf.Name+".forwarding=0")
			if got := fibLookup6(t, r, in, r.ClientIf.Addr6); got != retFwdDisabled {
				t.Errorf("IPv6 fib lookup with forwarding off on %s = %d, want %d (FWD_DISABLED)", r.ServerPeerIf.Name, got, retFwdDisabled)
			}
		})
	}
}

// TestIPv6Off checks that a rig built without WithIPv6 has no IPv6 anywhere.
func TestIPv6Off(t *testing.T) {
	netns.RequirePrivileged(t)
	r := netns.NewRouted(t)
	if r.ClientIf.Addr6.IsValid() || r.ServerClientIf.Addr6.IsValid() {
		t.Errorf("IPv6 addresses without WithIPv6: %v %v", r.ClientIf.Addr6, r.ServerClientIf.Addr6)
	}
	for _, n := range []struct {
		ns  *netns.NS
		dev string
	}{{r.Client, r.ClientIf.Name}, {r.Server, r.ServerClientIf.Name}, {r.Server, r.ServerPeerIf.Name}, {r.Peer, r.PeerIf.Name}} {
		if got := sysctl(t, n.ns, "net.ipv6.conf."+n.dev+".disable_ipv6"); got != "1" {
			t.Errorf("%s: %s disable_ipv6 = %s, want 1", n.ns.Name, n.dev, got)
		}
	}
}

const (
	retNotFwded    = 4 // BPF_FIB_LKUP_RET_NOT_FWDED
	retFwdDisabled = 5 // BPF_FIB_LKUP_RET_FWD_DISABLED
	retNoNeigh     = 7 // BPF_FIB_LKUP_RET_NO_NEIGH
)

// checkIPv6Setup checks the sysctls of a rig built WithIPv6.
func checkIPv6Setup(t *testing.T, r *netns.Rig) {
	t.Helper()
	type setting struct {
		ns         *netns.NS
		key, value string
	}
	want := []setting{
		{r.Server, "net.ipv6.conf.all.forwarding", "0"},
		{r.Server, "net.ipv6.conf.all.disable_ipv6", "1"},
		{r.Server, "net.ipv6.conf.lo.disable_ipv6", "1"},
		{r.Server, "net.ipv6.conf." + r.ServerClientIf.Name + ".disable_ipv6", "0"},
		{r.Client, "net.ipv6.conf.all.disable_ipv6", "1"},
		{r.Client, "net.ipv6.conf.lo.disable_ipv6", "1"},
		{r.Client, "net.ipv6.conf." + r.ClientIf.Name + ".disable_ipv6", "0"},
		{r.Peer, "net.ipv6.conf." + r.PeerIf.Name + ".disable_ipv6", "1"},
	}
	for _, name := range r.ServerIfaces() {
		want = append(want, setting{r.Server, "net.ipv6.conf." + name + ".forwarding", "1"})
		if name != r.ServerClientIf.Name {
			want = append(want, setting{r.Server, "net.ipv6.conf." + name + ".disable_ipv6", "1"})
		}
	}
	for _, w := range want {
		if got := sysctl(t, w.ns, w.key); got != w.value {
			t.Errorf("%s: %s = %s, want %s", w.ns.Name, w.key, got, w.value)
		}
	}
}

func sysctl(t *testing.T, ns *netns.NS, key string) string {
	t.Helper()
	return strings.TrimSpace(ns.Run(t, "sysctl", "-n", key))
}

// fibLookup6 runs bpf_fib_lookup (AF_INET6) through BPF_PROG_RUN in the server namespace for a
// UDP packet from the server's client-facing IPv6 address to dst that arrived on ifindex in, as
// the XDP program looks up a peer->client packet for an IPv6 client. It returns the lookup's
// result code, or on success the egress ifindex shifted left by 8.
func fibLookup6(t *testing.T, r *netns.Rig, in int, dst netip.Addr) uint32 {
	t.Helper()
	fields := asm.Instructions{
		asm.StoreImm(asm.R10, fibParams+0, 10, asm.Byte),  // AF_INET6
		asm.StoreImm(asm.R10, fibParams+1, 17, asm.Byte),  // IPPROTO_UDP
		asm.StoreImm(asm.R10, fibParams+6, 152, asm.Half), // tot_len: 40 + 8 + 4 + 100
	}
	// ipv6_src at +16, ipv6_dst at +32.
	src, dstb := r.ServerClientIf.Addr6.As16(), dst.As16()
	for i := 0; i < 4; i++ {
		fields = append(fields,
			asm.StoreImm(asm.R10, fibParams+16+int16(4*i), int64(int32(nativeU32([4]byte(src[4*i:4*i+4])))), asm.Word),
			asm.StoreImm(asm.R10, fibParams+32+int16(4*i), int64(int32(nativeU32([4]byte(dstb[4*i:4*i+4])))), asm.Word),
		)
	}
	return runFibLookup(t, r, in, fields)
}
