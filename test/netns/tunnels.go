package netns

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// The tunnel and VLAN node shapes (issue 34): devices whose modules (ipip, wireguard, ip_gre,
// 8021q) this machine's kernel may lack. BuildNode returns an error wrapping ErrNoKernelDevice
// where `ip link add` says the kernel has no such device type; NewNode skips the test for that
// reason alone, naming the kernel. The kernel matrix (make test-kernels) runs them on Debian's
// kernels, which have the modules.
const (
	// CalicoIPIP: a peer pod on the other node, reached over Calico's IPIP overlay (ipipMode
	// Always): tunl0, the ipip module's tunnel without a fixed remote end (NBMA), up with MTU
	// 1480 and the node's tunnel address 10.244.i.0/32 (the first of its block), and per remote
	// node a route "10.244.j.0/24 via <node j> dev tunl0 onlink" (BIRD's); Calico pods (cali
	// veths, MTU 1480). Felix's nat rules on both nodes: cali-nat-outgoing (natOutgoing, the
	// default pool's setting) and the rule that masquerades what leaves tunl0 from another local
	// address than tunl0's (felix/rules/static.go): the relay's packets (from the node IP) reach
	// the pod from 10.244.0.0, and the pod's replies come back through the tunnel.
	CalicoIPIP Shape = "calico-ipip"
	// WireGuard: Calico's WireGuard encryption (wireguardEnabled, no IPIP): "wireguard.cali"
	// (listen port 51820, fwmark 0x100000, MTU 1440, the node's address 10.244.i.0/32), one
	// peer per remote node (its node IP:51820, allowed IPs its pod block); its routes in table 1
	// ("10.244.j.0/24 dev wireguard.cali scope link") behind the rule "not fwmark
	// 0x100000/0x100000 lookup 1" (priority 99), so that everything but WireGuard's own UDP
	// takes the tunnel to a remote pod; the BGP route via the node over eth0 stays in main.
	// Felix's masquerade of what leaves wireguard.cali from another local address, as
	// CalicoIPIP's; Calico pods (MTU 1440).
	WireGuard Shape = "wireguard"
	// GRE: a point-to-point GRE tunnel "gre1" per remote node (local node IP, remote the other
	// node's, MTU 1476), the remote pod subnet routed through it ("10.244.j.0/24 dev gre1"), as
	// kube-router's per-node overlay tunnels (there ipip) and hand-built overlays do; no
	// masquerade, bridge pods (cni0, MTU 1476). The pod's replies to the node IP leave node 2
	// through its NIC, not through the tunnel.
	GRE Shape = "gre"
	// VLANNIC: the node's NIC is the VLAN subinterface eth0.100 of eth0 (a trunk port of the
	// LAN's switch, whose VLAN 100 is the LAN): eth0.100 carries NodeIP and the default route,
	// eth0 no address. The peer is a hostNetwork peer on the other node (RemoteHost's), so that
	// both directions enter and leave through the VLAN device, which has no native XDP.
	VLANNIC Shape = "vlan-nic"
)

// TunnelShapes lists the tunnel and VLAN node shapes.
func TunnelShapes() []Shape { return []Shape{CalicoIPIP, WireGuard, GRE, VLANNIC} }

// requireShapeTools skips the test (fails it under CI=true) unless the tools the shape's rig
// needs beyond RequirePrivileged's are there: WireGuard's wg (Debian's wireguard-tools).
func requireShapeTools(t testing.TB, shape Shape) {
	t.Helper()
	if shape == WireGuard {
		testenv.Require(t, "wg")
	}
}

// ErrNoKernelDevice is wrapped by BuildNode's error when the running kernel has no module for a
// device type the shape needs (`ip link add` answers "Unknown device type").
var ErrNoKernelDevice = errors.New("the running kernel has no such device type")

// Addresses of the tunnel shapes.
const (
	calicoIPIPMTU = 1480       // Calico's IPIP MTU on a 1500-byte NIC: 20 bytes of encapsulation less
	calicoWGMTU   = 1440       // Calico's WireGuard MTU for IPv4 on a 1500-byte NIC: 60 bytes less
	greMTU        = 1476       // a GRE device's MTU on a 1500-byte NIC: 24 bytes less
	calicoWGMark  = "0x100000" // Felix's wireguardFirewallMark
	calicoWGTable = "1"        // Felix's wireguardRoutingRulePriority 99 looks up table 1
	wgPort        = "51820"
	vlanID        = "100"
)

// tunnelShape builds the part of a tunnel or VLAN shape that follows the LAN, the client and
// node 1 (BuildNode's common part).
func (b *nodeBuilder) tunnelShape(shape Shape) {
	r := b.r
	switch shape {
	case CalicoIPIP, WireGuard:
		mtu := calicoIPIPMTU
		if shape == WireGuard {
			mtu = calicoWGMTU
		}
		b.secondNode()
		r.Pod = b.ns("pod")
		r.Peer, r.PeerIP = r.Pod, pod2IP
		b.pod(r.Node2, r.Pod, pod2IP, CalicoPod, mtu)
		if shape == CalicoIPIP {
			b.calicoIPIP(r.Node, 0, node2IP.String())
			b.calicoIPIP(r.Node2, 1, node1IP.String())
			r.EgressIf = "tunl0"
		} else {
			b.calicoWireGuard()
			r.EgressIf = "wireguard.cali"
		}
		b.calicoNAT(r.Node, r.EgressIf)
		b.calicoNAT(r.Node2, r.EgressIf)
	case GRE:
		b.secondNode()
		r.Pod = b.ns("pod")
		r.Peer, r.PeerIP = r.Pod, pod2IP
		b.pod(r.Node2, r.Pod, pod2IP, BridgePod, greMTU)
		b.gre(r.Node, node1IP.String(), node2IP.String(), 1)
		b.gre(r.Node2, node2IP.String(), node1IP.String(), 0)
		r.EgressIf = "gre1"
	case VLANNIC:
		b.secondNode()
		b.vlanNIC()
		r.Peer, r.PeerIP, r.PeerCIDR = r.Node2, node2IP, node2IP.String()+"/32"
	}
}

// linkAdd runs `ip -n n link add args...`, turning the kernel's "Unknown device type" (no module
// for kind) into ErrNoKernelDevice. exists tolerates "File exists": a device the module's loading
// made in every namespace (tunl0).
func (b *nodeBuilder) linkAdd(n *NS, kind string, exists bool, args ...string) {
	if b.err != nil {
		return
	}
	out, err := Exec("ip", append([]string{"-n", n.Name, "link", "add"}, args...)...)
	switch {
	case err == nil:
	case strings.Contains(out, "Unknown device type"):
		release, _ := os.ReadFile("/proc/sys/kernel/osrelease")
		b.err = fmt.Errorf("%w: kernel %s has no %s devices (no module): %v", ErrNoKernelDevice, strings.TrimSpace(string(release)), kind, err)
	case exists && strings.Contains(out, "File exists"):
	default:
		b.err = err
	}
}

// calicoIPIP sets up tunl0 on node i as Felix and BIRD do: the fallback ipip device (made in
// every namespace when the module loads: Felix creates it if it is missing), up, MTU 1480, the
// node's tunnel address 10.244.i.0/32, and the route to node j's block via node j onlink.
func (b *nodeBuilder) calicoIPIP(n *NS, i int, other string) {
	j := 1 - i
	b.linkAdd(n, "ipip", true, "name", "tunl0", "type", "ipip")
	b.ip(n, "link", "set", "tunl0", "mtu", fmt.Sprint(calicoIPIPMTU), "up")
	b.ip(n, "addr", "add", fmt.Sprintf("10.244.%d.0/32", i), "dev", "tunl0")
	b.ip(n, "route", "add", fmt.Sprintf("10.244.%d.0/24", j), "via", other, "dev", "tunl0", "onlink")
}

// calicoWireGuard sets up wireguard.cali on both nodes as Felix does, each the other's peer.
func (b *nodeBuilder) calicoWireGuard() {
	if b.err != nil {
		return
	}
	dir, err := os.MkdirTemp("", "stunnerd-xdp-wg-")
	if err != nil {
		b.err = err
		return
	}
	*b.closers = append(*b.closers, func() error { return os.RemoveAll(dir) })
	nodes := []*NS{b.r.Node, b.r.Node2}
	ips := []string{node1IP.String(), node2IP.String()}
	var pub [2]string
	for i := range nodes {
		key := filepath.Join(dir, fmt.Sprintf("node%d.key", i+1))
		out, err := Exec("sh", "-c", "umask 077; wg genkey | tee "+key+" | wg pubkey")
		if err != nil {
			b.err = err
			return
		}
		pub[i] = strings.TrimSpace(out)
	}
	for i, n := range nodes {
		j := 1 - i
		b.linkAdd(n, "wireguard", false, "name", "wireguard.cali", "type", "wireguard")
		b.in(n, "wg", "set", "wireguard.cali", "private-key", filepath.Join(dir, fmt.Sprintf("node%d.key", i+1)),
			"listen-port", wgPort, "fwmark", calicoWGMark,
			"peer", pub[j], "endpoint", ips[j]+":"+wgPort, "allowed-ips", fmt.Sprintf("10.244.%d.0/24", j))
		b.ip(n, "link", "set", "wireguard.cali", "mtu", fmt.Sprint(calicoWGMTU), "up")
		b.ip(n, "addr", "add", fmt.Sprintf("10.244.%d.0/32", i), "dev", "wireguard.cali")
		block := fmt.Sprintf("10.244.%d.0/24", j)
		b.ip(n, "route", "add", block, "via", ips[j], "dev", "eth0")
		b.ip(n, "route", "add", block, "dev", "wireguard.cali", "scope", "link", "table", calicoWGTable)
		b.ip(n, "rule", "add", "not", "fwmark", calicoWGMark+"/"+calicoWGMark, "lookup", calicoWGTable, "priority", "99")
	}
}

// calicoNAT installs Felix's nat POSTROUTING rules for a node whose tunnel device is tunnel:
// cali-nat-outgoing (natOutgoing: pods' traffic leaving the pool is masqueraded; Felix matches
// ipsets of the pools, here the one pool's CIDR) and the masquerade of what leaves the tunnel
// from a local address that is not the tunnel's own.
func (b *nodeBuilder) calicoNAT(n *NS, tunnel string) {
	ipt := func(args ...string) { b.in(n, "iptables", append([]string{"-t", "nat"}, args...)...) }
	ipt("-N", "cali-POSTROUTING")
	ipt("-N", "cali-nat-outgoing")
	ipt("-I", "POSTROUTING", "1", "-m", "comment", "--comment", "cali:O3lYWMrLQYEMJtB5", "-j", "cali-POSTROUTING")
	ipt("-A", "cali-POSTROUTING", "-j", "cali-nat-outgoing")
	ipt("-A", "cali-POSTROUTING", "-o", tunnel, "-m", "addrtype", "!", "--src-type", "LOCAL", "--limit-iface-out",
		"-m", "addrtype", "--src-type", "LOCAL", "-j", "MASQUERADE", "--random-fully")
	ipt("-A", "cali-nat-outgoing", "-s", ClusterCIDR, "!", "-d", ClusterCIDR, "-j", "MASQUERADE", "--random-fully")
}

// gre sets up the point-to-point GRE tunnel gre1 from local to remote on a node and routes node
// j's pod subnet through it.
func (b *nodeBuilder) gre(n *NS, local, remote string, j int) {
	b.linkAdd(n, "gre", false, "name", "gre1", "type", "gre", "local", local, "remote", remote, "ttl", "64")
	b.ip(n, "link", "set", "gre1", "mtu", fmt.Sprint(greMTU), "up")
	b.ip(n, "route", "add", fmt.Sprintf("10.244.%d.0/24", j), "dev", "gre1")
}

// vlanNIC moves node 1's address and default route from eth0 to its VLAN subinterface eth0.100,
// and makes node 1's port on the LAN's switch a trunk whose VLAN 100 is the LAN (the port's
// VLAN device n1.100 in the bridge instead of the port). The port keeps its XDP_PASS program:
// it is the wire's far end.
func (b *nodeBuilder) vlanNIC() {
	r := b.r
	nic := "eth0." + vlanID
	b.linkAdd(r.Node, "vlan", false, "link", "eth0", "name", nic, "type", "vlan", "id", vlanID)
	b.ip(r.Node, "route", "del", "default")
	b.ip(r.Node, "addr", "del", node1IP.String()+"/24", "dev", "eth0")
	b.ip(r.Node, "link", "set", nic, "up")
	b.ip(r.Node, "addr", "add", node1IP.String()+"/24", "dev", nic)
	b.ip(r.Node, "route", "add", "default", "via", lanRouter.String(), "dev", nic)
	b.ip(r.LAN, "link", "set", "n1", "nomaster")
	b.linkAdd(r.LAN, "vlan", false, "link", "n1", "name", "n1."+vlanID, "type", "vlan", "id", vlanID)
	b.ip(r.LAN, "link", "set", "n1."+vlanID, "master", "lan0", "up")
	r.NIC, r.EgressIf = nic, nic
}

// DropCounters returns, per namespace of the rig, the kernel's counters of datagrams it dropped
// or could not deliver (UDP receive-buffer and checksum errors, IP discards and unroutable
// packets) and the interfaces' drop and error counts that are not zero: where a lost datagram
// went, for a failed row's log.
func (r *NodeRig) DropCounters() string {
	var b strings.Builder
	seen := map[*NS]bool{}
	for _, n := range []*NS{r.Client, r.Node, r.Node2, r.Pod, r.Peer} {
		if n == nil || seen[n] {
			continue
		}
		seen[n] = true
		out, err := n.Exec("nstat", "-asz")
		if err != nil {
			fmt.Fprintf(&b, "%s: nstat: %v\n", n.Name, err)
			continue
		}
		var lines []string
		for _, l := range strings.Split(out, "\n") {
			f := strings.Fields(l)
			if len(f) >= 2 && f[1] != "0" && strings.Contains(f[0], "Err") || len(f) >= 2 && f[1] != "0" &&
				(strings.Contains(f[0], "Discards") || strings.Contains(f[0], "NoRoutes") || strings.Contains(f[0], "NoPorts")) {
				lines = append(lines, f[0]+"="+f[1])
			}
		}
		fmt.Fprintf(&b, "%s: %s %s\n", n.Name, strings.Join(lines, " "), linkDrops(n))
	}
	return b.String()
}

// linkDrops returns the drop and error counts of n's interfaces that are not zero.
func linkDrops(n *NS) string {
	out, err := Exec("ip", "-n", n.Name, "-j", "-s", "-s", "link", "show")
	if err != nil {
		return err.Error()
	}
	var links []struct {
		Ifname  string
		Stats64 map[string]map[string]any
	}
	if err := json.Unmarshal([]byte(out), &links); err != nil {
		return err.Error()
	}
	var drops []string
	for _, l := range links {
		for _, dir := range []string{"rx", "tx"} {
			for k, v := range l.Stats64[dir] {
				if f, ok := v.(float64); ok && f != 0 && k != "bytes" && k != "packets" && k != "multicast" && k != "carrier_changes" {
					drops = append(drops, fmt.Sprintf("%s:%s_%s=%.0f", l.Ifname, dir, k, f))
				}
			}
		}
	}
	slices.Sort(drops)
	return strings.Join(drops, " ")
}
