package netns

import (
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/l7mp/stunnerd-xdp/internal/config"
)

// Shape names one way a Kubernetes node reaches a TURN peer (issue 23's table): where the peer
// is, and what lies between the node's NIC and it.
type Shape string

// The node shapes BuildNode builds. The daemon always runs in the node's namespace with the
// node's IP as listener and relay address; the shapes differ in where the peer is.
const (
	// PodVeth: a peer pod on this node behind a plain veth whose host side carries an address
	// (10.244.0.1/24, the pod's gateway), as the ptp CNI plugin and kube-router set it up.
	PodVeth Shape = "pod-veth"
	// CalicoPod: a peer pod on this node as Calico wires it: host side "cali…" without an
	// address, MAC ee:ee:ee:ee:ee:ee, proxy ARP with proxy_delay 0, a /32 route to the pod
	// through it and a permanent neighbour entry for the pod (Felix's static ARP); inside the
	// pod a /32 address and a default route via 169.254.1.1 dev eth0 onlink.
	CalicoPod Shape = "calico-pod"
	// BridgePod: a peer pod on this node behind the bridge "cni0" (10.244.0.1/24), the pod's
	// host-side veth a bridge port in hairpin mode, as flannel's and kindnet's bridge plugin make it.
	BridgePod Shape = "bridge-pod"
	// VXLANMasq: a peer pod on the other node, reached over flannel's VXLAN overlay
	// ("flannel.1", VNI 1, UDP 8472, MTU 1450, no learning; per remote node a route via its
	// VTEP address onlink, a permanent neighbour entry and a permanent FDB entry to its node IP),
	// with the masquerade rules flanneld --ip-masq installs (FLANNEL-POSTRTG) and its
	// FLANNEL-FWD accept rules, on both nodes. The rule "! -s 10.244.0.0/16 -d 10.244.0.0/16
	// MASQUERADE" rewrites what the relay (the node IP) sends to the pod to the source
	// 10.244.0.0, flannel.1's address.
	VXLANMasq Shape = "vxlan-masq"
	// VXLAN: VXLANMasq without the masquerade rules (flanneld --ip-masq=false): the pod's
	// replies to the node IP leave node2 through its NIC, not through the overlay.
	VXLAN Shape = "vxlan"
	// NativeRouting: a peer pod on the other node, whose pod CIDR this node routes via the
	// other node's IP over the same NIC (flannel host-gw, Calico BGP without encapsulation,
	// kube-router).
	NativeRouting Shape = "native-routing"
	// RemoteHost: a hostNetwork peer on the other node: the peer listens on node2's IP.
	RemoteHost Shape = "remote-hostnet"
	// NodePort: RemoteHost's peer, and a client that reaches the listener through a NodePort:
	// kube-proxy's nat chains DNAT nodeIP:31478 to nodeIP:3478 (the endpoint of a hostNetwork
	// STUNner pod) for packets to a local address.
	NodePort Shape = "nodeport"
	// MacvlanNIC: a second NIC "eth1" whose address is on a macvlan device on it, "mv0"
	// 10.10.0.1/24, with the peer host at 10.10.0.2 at the far end of eth1. A macvlan device has
	// no native XDP: a daemon told to attach to eth0 and mv0 in auto mode attaches eth0 native and
	// mv0 generic, the mixed attachment of issue 23. (A VLAN device would be the same; this
	// machine's kernel has no 8021q.)
	MacvlanNIC Shape = "macvlan-nic"
	// EKSPod: CalicoPod's pod, its host-side veth named as EKS's VPC CNI names it, "eni" and a
	// hash of the pod's name ("eni1a2b3c4d"); the VPC CNI wires it the same way (no address on
	// the host side, a /32 route to the pod through it, the pod's default route via 169.254.1.1).
	EKSPod Shape = "eks-pod"
	// AKSPod: the same, named as AKS's Azure CNI names it, "azv" and a hash ("azv1234abcd").
	AKSPod Shape = "aks-pod"
)

// Shapes lists every node shape, in the order of issue 23's table.
func Shapes() []Shape {
	return []Shape{PodVeth, CalicoPod, BridgePod, VXLANMasq, VXLAN, NativeRouting, RemoteHost, NodePort, MacvlanNIC}
}

// NamedPodShapes are the shapes that differ from CalicoPod in the name of the pod's host-side
// veth alone (the other CNIs' names): BuildNode builds them, Shapes does not list them.
func NamedPodShapes() []Shape { return []Shape{EKSPod, AKSPod} }

// hostVethNames are the pod's host-side veths the NamedPodShapes have.
var hostVethNames = map[Shape]string{EKSPod: "eni1a2b3c4d", AKSPod: "azv1234abcd"}

// Addresses of the node rigs.
const (
	// NodePortNumber is where the NodePort shape's client sends, on the node IP.
	NodePortNumber = 31478
	// ClusterCIDR is the pod network of the rigs: node 1's pods are in 10.244.0.0/24, node 2's
	// in 10.244.1.0/24.
	ClusterCIDR = "10.244.0.0/16"
)

var (
	lanRouter = netip.MustParseAddr("192.168.77.1") // the client: the LAN's router, the nodes' default gateway
	node1IP   = netip.MustParseAddr("192.168.77.10")
	node2IP   = netip.MustParseAddr("192.168.77.11")
	pod1IP    = netip.MustParseAddr("10.244.0.5")
	pod2IP    = netip.MustParseAddr("10.244.1.5")
	macNode   = netip.MustParseAddr("10.10.0.1")
	macHost   = netip.MustParseAddr("10.10.0.2")
	nic2IP    = netip.MustParseAddr("10.30.0.1") // the node's second NIC (WithSecondNIC)
	wire2IP   = netip.MustParseAddr("10.30.0.2") // its wire's far end
)

// NodeRig is a node built as Kubernetes nodes are, in namespaces, for one Shape:
//
//	Client eth0 192.168.77.1/24 --+
//	Node   eth0 192.168.77.10/24 --+ lan0 (LAN) -- Node2 eth0 192.168.77.11/24 (two-node shapes)
//
// and the peer behind the node as the shape says. In every shape:
//   - The daemon's namespace is Node, standing for the node's host namespace. Its NIC is eth0,
//     which carries NodeIP: the address a STUNner Gateway of a hostNetwork Dataplane listens on
//     and relays from.
//   - Node and Node2 forward (net.ipv4.ip_forward=1) and have a default route via the client,
//     which stands for the LAN's router and the internet beyond it; the client does not forward.
//     Pods and the client have no route to each other: only a relay connects them.
//   - Addresses are resolved by ARP, as on a node; only what the CNI plugin itself makes
//     permanent is (Calico's pod neighbour, flannel's VTEP neighbour and FDB entries).
//   - Both nodes run kube-proxy's nat chains (iptables mode, no Service but the NodePort
//     shape's), so their conntrack tracks every flow, as a node's does.
//   - No XDP program runs inside any pod, nor on any client or pod interface. The far ends of
//     the nodes' NICs (their ports on the LAN's bridge) and of the second NIC's wire carry an
//     XDP_PASS program: they stand for the wire and the switch a physical NIC transmits into,
//     which take redirected frames.
//   - Every veth keeps its default offloads: senders hand over CHECKSUM_PARTIAL frames.
//   - IPv6 is disabled everywhere, as in Rig; rp_filter stays 0 (the namespace default; Calico
//     and Cilium accept it, flannel does not set it) unless a test hardens the node.
type NodeRig struct {
	Shape Shape

	LAN    *NS // the LAN's switch: the bridge lan0, one port per machine
	Client *NS // the client's machine, the LAN's router
	Node   *NS // this node's host namespace, where the daemon runs
	Node2  *NS // the other node in the two-node shapes (overlay, native routing, hostNetwork, NodePort), else nil
	Pod    *NS // the peer pod's namespace in the pod shapes, else nil
	Peer   *NS // where the peer listens: Pod, Node2, or the macvlan NIC's host
	Wire2  *NS // the far end of the node's second NIC's wire (WithSecondNIC), else nil

	NIC        string     // "eth0": this node's NIC, which carries NodeIP
	NodeIP     netip.Addr // 192.168.77.10: the listener, relay, metrics and health address
	ClientIP   netip.Addr // 192.168.77.1
	PeerIP     netip.Addr // where the peer listens
	PeerCIDR   string     // the peers a STUNner cluster routes to in this shape
	ListenPort uint16     // where the client sends on NodeIP: 3478, or NodePortNumber
	EgressIf   string     // the node's device towards the peer: the pod's host-side veth, cni0, flannel.1, eth0 or mv0
	NIC2       string     // "eth1" with WithSecondNIC: the node's second NIC, 10.30.0.1/24; else empty
	Wire2IP    netip.Addr // 10.30.0.2 with WithSecondNIC: Wire2's end of the second NIC's wire

	closers []func() error
}

// NewNode builds a node rig of the shape for the test, which removes it when it ends.
func NewNode(t testing.TB, shape Shape, opts ...Option) *NodeRig {
	t.Helper()
	requireShapeTools(t, shape)
	r, err := BuildNode(shape, opts...)
	if errors.Is(err, ErrNoKernelDevice) {
		t.Skipf("skipped, whatever CI says: %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	closeAtCleanup(t, r.Close)
	return r
}

// BuildNode builds a node rig of the shape and returns it or what failed; on failure it removes
// what it had built. It takes the Options WithTag and WithSecondNIC. The caller closes the rig (Close).
func BuildNode(shape Shape, opts ...Option) (r *NodeRig, err error) {
	if !slices.Contains(Shapes(), shape) && !slices.Contains(NamedPodShapes(), shape) && !slices.Contains(TunnelShapes(), shape) {
		return nil, fmt.Errorf("no node shape %q", shape)
	}
	var o options
	for _, opt := range opts {
		opt(&o)
	}
	if o.ipv6 || o.bridged {
		return nil, errors.New("node rigs take no WithIPv6 or Bridged option")
	}
	if o.secondNIC && shape == MacvlanNIC {
		return nil, errors.New("the macvlan-nic shape has a second NIC of its own: no WithSecondNIC")
	}
	r = &NodeRig{Shape: shape, NIC: "eth0", NodeIP: node1IP, ClientIP: lanRouter, ListenPort: 3478, PeerCIDR: ClusterCIDR}
	defer func() {
		if err != nil {
			err = errors.Join(fmt.Errorf("node shape %s: %w", shape, err), r.Close())
			r = nil
		}
	}()
	b := &nodeBuilder{builder: builder{closers: &r.closers, id: o.tag + uniqueTag()}, r: r}
	r.LAN, r.Client, r.Node = b.ns("lan"), b.ns("cl"), b.ns("node")
	b.disableIPv6(r.LAN) // else lan0 floods its MLD reports to every machine
	b.ip(r.LAN, "link", "add", "lan0", "type", "bridge")
	b.ip(r.LAN, "link", "set", "lan0", "up")
	b.machine(r.Client, lanRouter, "cl", false)
	b.machine(r.Node, node1IP, "n1", true)

	switch shape {
	case PodVeth, CalicoPod, BridgePod, EKSPod, AKSPod:
		r.Pod = b.ns("pod")
		r.Peer, r.PeerIP = r.Pod, pod1IP
		b.pod(r.Node, r.Pod, pod1IP, shape, 1500)
	case VXLANMasq, VXLAN:
		b.secondNode()
		r.Pod = b.ns("pod")
		r.Peer, r.PeerIP = r.Pod, pod2IP
		b.pod(r.Node2, r.Pod, pod2IP, BridgePod, flannelMTU)
		b.flannel(r.Node, node1IP, 0, node2IP, 1)
		b.flannel(r.Node2, node2IP, 1, node1IP, 0)
		b.flannelForward(r.Node)
		b.flannelForward(r.Node2)
		r.EgressIf = "flannel.1"
		if shape == VXLANMasq {
			b.flannelMasq(r.Node, "10.244.0.0/24")
			b.flannelMasq(r.Node2, "10.244.1.0/24")
		}
	case NativeRouting:
		b.secondNode()
		r.Pod = b.ns("pod")
		r.Peer, r.PeerIP = r.Pod, pod2IP
		b.pod(r.Node2, r.Pod, pod2IP, BridgePod, 1500)
		b.ip(r.Node, "route", "add", "10.244.1.0/24", "via", node2IP.String(), "dev", "eth0")
		b.ip(r.Node2, "route", "add", "10.244.0.0/24", "via", node1IP.String(), "dev", "eth0")
		r.EgressIf = "eth0"
	case RemoteHost, NodePort:
		b.secondNode()
		r.Peer, r.PeerIP, r.PeerCIDR, r.EgressIf = r.Node2, node2IP, node2IP.String()+"/32", "eth0"
		if shape == NodePort {
			b.nodePort(r.Node, node1IP, NodePortNumber, 3478)
			r.ListenPort = NodePortNumber
		}
	case MacvlanNIC:
		b.macvlanNIC()
	default:
		b.tunnelShape(shape)
	}
	if o.secondNIC {
		b.secondNIC()
	}
	for _, n := range []*NS{r.LAN, r.Client, r.Node, r.Node2, r.Pod, r.Peer, r.Wire2} {
		if n != nil && n.Name == "" && b.err == nil {
			b.err = errors.New("a namespace was not created")
		}
	}
	return r, b.err
}

// Close detaches the rig's XDP_PASS programs and deletes its namespaces. It returns every failure.
func (r *NodeRig) Close() error { return undo(&r.closers) }

// ListenAddr is where the client sends its TURN requests: NodeIP on ListenPort.
func (r *NodeRig) ListenAddr() netip.AddrPort { return netip.AddrPortFrom(r.NodeIP, r.ListenPort) }

// PodNamespaces returns the namespaces that stand for pods: none may run an XDP program.
func (r *NodeRig) PodNamespaces() []*NS {
	if r.Pod == nil {
		return nil
	}
	return []*NS{r.Pod}
}

// LooksLikeANode returns an error unless the rig still has what makes it a node: forwarding and
// a default route on the node, no XDP program in any pod, on the client or on node 2 (the macvlan
// NIC's host's eth0 is a wire's far end and may carry one), and tx checksum offload on at every sender
// (the client's and the peer's interfaces). A test that measures a shape checks it first, so that
// a fixture change that hides a real node's problem shows.
func (r *NodeRig) LooksLikeANode() error {
	var errs []error
	if out, err := r.Node.Exec("sysctl", "-n", "net.ipv4.ip_forward"); err != nil || strings.TrimSpace(out) != "1" {
		errs = append(errs, fmt.Errorf("node %s does not forward (net.ipv4.ip_forward %q, %v)", r.Node.Name, strings.TrimSpace(out), err))
	}
	if out, err := Exec("ip", "-n", r.Node.Name, "route", "show", "default"); err != nil || !strings.Contains(out, "default via") {
		errs = append(errs, fmt.Errorf("node %s has no default route (%q, %v)", r.Node.Name, out, err))
	}
	noXDP := append(r.PodNamespaces(), r.Client)
	if r.Node2 != nil {
		noXDP = append(noXDP, r.Node2)
	}
	for _, n := range noXDP {
		out, err := Exec("ip", "-n", n.Name, "-d", "link", "show")
		if err != nil {
			errs = append(errs, err)
		} else if strings.Contains(out, "prog/xdp") || strings.Contains(out, " xdp") {
			errs = append(errs, fmt.Errorf("netns %s runs an XDP program, no pod or end host does:\n%s", n.Name, out))
		}
	}
	for _, side := range []struct {
		ns  *NS
		dev string
	}{{r.Client, "eth0"}, {r.Peer, "eth0"}} {
		if out, err := side.ns.Exec("ethtool", "-k", side.dev); err != nil || !strings.Contains(out, "tx-checksumming: on") {
			errs = append(errs, fmt.Errorf("netns %s: %s sends with tx checksum offload off (%v)", side.ns.Name, side.dev, err))
		}
	}
	return errors.Join(errs...)
}

// flannelMTU is flannel's VXLAN MTU on a 1500-byte NIC (FLANNEL_MTU): 50 bytes of encapsulation less.
const flannelMTU = 1450

// nodeBuilder runs the steps of BuildNode, keeping the first error as builder does.
type nodeBuilder struct {
	builder
	r *NodeRig
}

// machine joins n to the LAN: its NIC eth0 with addr/24, a port named port on lan0. A node
// forwards, routes by default via the LAN's router, and its NIC's far end takes XDP frames.
func (b *nodeBuilder) machine(n *NS, addr netip.Addr, port string, node bool) {
	b.disableIPv6(n)
	forward := "net.ipv4.ip_forward=0"
	if node {
		forward = "net.ipv4.ip_forward=1"
	}
	b.in(n, "sysctl", "-q", "-w", forward)
	b.veth(n, Iface{Name: "eth0"}, b.r.LAN, Iface{Name: port})
	b.ip(b.r.LAN, "link", "set", port, "master", "lan0")
	b.ip(n, "addr", "add", addr.String()+"/24", "dev", "eth0")
	if node {
		b.ip(n, "route", "add", "default", "via", lanRouter.String(), "dev", "eth0")
		b.attachXDPPass(b.r.LAN, port)
		b.kubeProxy(n)
	}
}

// secondNode adds node 2 to the LAN.
func (b *nodeBuilder) secondNode() {
	b.r.Node2 = b.ns("node2")
	b.machine(b.r.Node2, node2IP, "n2", true)
}

// pod creates the pod namespace's eth0 at addr and wires it to node in the style of the shape
// (PodVeth, CalicoPod or BridgePod; the NamedPodShapes as CalicoPod), with the given MTU on both
// ends of its veth. The pod's gateway is the .1 of its /24 (Calico: 169.254.1.1).
func (b *nodeBuilder) pod(node, pod *NS, addr netip.Addr, style Shape, mtu int) {
	b.disableIPv6(pod)
	b.in(pod, "sysctl", "-q", "-w", "net.ipv4.ip_forward=0")
	a := addr.As4()
	gw := netip.AddrFrom4([4]byte{a[0], a[1], a[2], 1})
	host := "veth" + b.id[len(b.id)-6:]
	if style == CalicoPod {
		host = "cali" + b.id[len(b.id)-6:]
	}
	if name, ok := hostVethNames[style]; ok {
		host, style = name, CalicoPod
	}
	b.r.EgressIf = host
	b.veth(pod, Iface{Name: "eth0"}, node, Iface{Name: host})
	b.ip(pod, "link", "set", "eth0", "mtu", fmt.Sprint(mtu))
	b.ip(node, "link", "set", host, "mtu", fmt.Sprint(mtu))
	switch style {
	case PodVeth:
		b.ip(node, "addr", "add", gw.String()+"/24", "dev", host)
		b.ip(pod, "addr", "add", addr.String()+"/24", "dev", "eth0")
		b.ip(pod, "route", "add", "default", "via", gw.String(), "dev", "eth0")
	case CalicoPod:
		// Felix's workload interface: a fixed MAC, proxy ARP answering the pod's 169.254.1.1
		// at once, a /32 route and a static neighbour entry for the pod.
		b.ip(node, "link", "set", host, "address", "ee:ee:ee:ee:ee:ee")
		b.in(node, "sysctl", "-q", "-w", "net.ipv4.conf."+host+".proxy_arp=1", "net.ipv4.neigh."+host+".proxy_delay=0")
		b.ip(pod, "addr", "add", addr.String()+"/32", "dev", "eth0")
		b.ip(pod, "route", "add", "169.254.1.1", "dev", "eth0", "scope", "link")
		b.ip(pod, "route", "add", "default", "via", "169.254.1.1", "dev", "eth0", "onlink")
		b.ip(node, "route", "add", addr.String()+"/32", "dev", host, "scope", "link")
		if mac := b.macOf(pod, "eth0"); mac != "" {
			b.ip(node, "neigh", "replace", addr.String(), "lladdr", mac, "dev", host, "nud", "permanent")
		}
	case BridgePod:
		if _, err := Exec("ip", "-n", node.Name, "link", "show", "cni0"); err != nil {
			b.ip(node, "link", "add", "cni0", "mtu", fmt.Sprint(mtu), "type", "bridge")
			b.ip(node, "addr", "add", gw.String()+"/24", "dev", "cni0")
			b.ip(node, "link", "set", "cni0", "up")
		}
		b.ip(node, "link", "set", host, "master", "cni0")
		b.exec("bridge", "-n", node.Name, "link", "set", "dev", host, "hairpin", "on")
		b.ip(pod, "addr", "add", addr.String()+"/24", "dev", "eth0")
		b.ip(pod, "route", "add", "default", "via", gw.String(), "dev", "eth0")
		b.r.EgressIf = "cni0"
	}
}

// macOf returns the MAC address of dev in n.
func (b *nodeBuilder) macOf(n *NS, dev string) string {
	if b.err != nil {
		return ""
	}
	out, err := Exec("ip", "-n", n.Name, "-br", "link", "show", "dev", dev)
	if err != nil {
		b.err = err
		return ""
	}
	if f := strings.Fields(out); len(f) >= 3 {
		return f[2]
	}
	b.err = fmt.Errorf("netns %s: no MAC address for %s in %q", n.Name, dev, out)
	return ""
}

// vtepMAC is the MAC of node i's flannel.1; flanneld picks one at random and publishes it in the
// node's annotation (flannel.alpha.coreos.com/backend-data), from which the other nodes install it.
func vtepMAC(i int) string { return fmt.Sprintf("02:f1:a0:00:00:%02x", i+1) }

// flannel sets up flannel.1 on a node as flanneld's VXLAN backend does: node i's VTEP with the
// address 10.244.i.0/32 and a route, a permanent neighbour and a permanent FDB entry for the
// other node j's subnet.
func (b *nodeBuilder) flannel(n *NS, ip netip.Addr, i int, other netip.Addr, j int) {
	b.ip(n, "link", "add", "flannel.1", "address", vtepMAC(i), "mtu", fmt.Sprint(flannelMTU), "type", "vxlan",
		"id", "1", "local", ip.String(), "dev", "eth0", "dstport", "8472", "nolearning")
	b.ip(n, "addr", "add", fmt.Sprintf("10.244.%d.0/32", i), "dev", "flannel.1")
	b.ip(n, "link", "set", "flannel.1", "up")
	vtep := fmt.Sprintf("10.244.%d.0", j)
	b.ip(n, "neigh", "replace", vtep, "lladdr", vtepMAC(j), "dev", "flannel.1", "nud", "permanent")
	b.exec("bridge", "-n", n.Name, "fdb", "append", vtepMAC(j), "dev", "flannel.1", "dst", other.String(), "self", "permanent")
	b.ip(n, "route", "add", fmt.Sprintf("10.244.%d.0/24", j), "via", vtep, "dev", "flannel.1", "onlink")
}

// flannelMasq installs the rules flanneld --ip-masq installs on a node whose pod subnet is
// podCIDR (flannel's pkg/trafficmngr/iptables masqRules, iptables mode), in their order. 0x4000/0x4000 is kube-proxy's masquerade mark, which flannel leaves to kube-proxy.
func (b *nodeBuilder) flannelMasq(n *NS, podCIDR string) {
	const comment = "flanneld masq"
	b.in(n, "iptables", "-t", "nat", "-N", "FLANNEL-POSTRTG")
	b.in(n, "iptables", "-t", "nat", "-A", "POSTROUTING", "-m", "comment", "--comment", comment, "-j", "FLANNEL-POSTRTG")
	for _, rule := range [][]string{
		{"-m", "mark", "--mark", "0x4000/0x4000", "-j", "RETURN"},
		{"-s", podCIDR, "-d", ClusterCIDR, "-j", "RETURN"},
		{"-s", ClusterCIDR, "-d", podCIDR, "-j", "RETURN"},
		{"!", "-s", ClusterCIDR, "-d", podCIDR, "-j", "RETURN"},
		{"-s", ClusterCIDR, "!", "-d", "224.0.0.0/4", "-j", "MASQUERADE", "--random-fully"},
		{"!", "-s", ClusterCIDR, "-d", ClusterCIDR, "-j", "MASQUERADE", "--random-fully"},
	} {
		args := append([]string{"-t", "nat", "-A", "FLANNEL-POSTRTG", "-m", "comment", "--comment", comment}, rule...)
		b.in(n, "iptables", args...)
	}
}

// flannelForward installs the FORWARD accept rules flanneld installs whatever --ip-masq says
// (forwardRules).
func (b *nodeBuilder) flannelForward(n *NS) {
	b.in(n, "iptables", "-N", "FLANNEL-FWD")
	b.in(n, "iptables", "-A", "FORWARD", "-m", "comment", "--comment", "flanneld forward", "-j", "FLANNEL-FWD")
	for _, dir := range []string{"-s", "-d"} {
		b.in(n, "iptables", "-A", "FLANNEL-FWD", dir, ClusterCIDR, "-m", "comment", "--comment", "flanneld forward", "-j", "ACCEPT")
	}
}

// kubeProxy installs the nat chains kube-proxy (iptables mode) keeps on every node with no
// Service yet: PREROUTING and OUTPUT jump to KUBE-SERVICES, whose last rule sends packets to a
// local address to KUBE-NODEPORTS; KUBE-MARK-MASQ marks for masquerade, and KUBE-POSTROUTING
// (jumped to first in POSTROUTING: kube-proxy prepends its jumps) masquerades what is marked.
// Their nat table is what makes the node's conntrack track every flow, as on a real node.
func (b *nodeBuilder) kubeProxy(n *NS) {
	ipt := func(args ...string) { b.in(n, "iptables", append([]string{"-t", "nat"}, args...)...) }
	for _, chain := range []string{"KUBE-SERVICES", "KUBE-NODEPORTS", "KUBE-POSTROUTING", "KUBE-MARK-MASQ"} {
		ipt("-N", chain)
	}
	ipt("-I", "PREROUTING", "-m", "comment", "--comment", "kubernetes service portals", "-j", "KUBE-SERVICES")
	ipt("-I", "OUTPUT", "-m", "comment", "--comment", "kubernetes service portals", "-j", "KUBE-SERVICES")
	ipt("-I", "POSTROUTING", "-m", "comment", "--comment", "kubernetes postrouting rules", "-j", "KUBE-POSTROUTING")
	ipt("-A", "KUBE-MARK-MASQ", "-j", "MARK", "--or-mark", "0x4000")
	ipt("-A", "KUBE-POSTROUTING", "-m", "mark", "!", "--mark", "0x4000/0x4000", "-j", "RETURN")
	ipt("-A", "KUBE-POSTROUTING", "-j", "MARK", "--xor-mark", "0x4000")
	ipt("-A", "KUBE-POSTROUTING", "-m", "comment", "--comment", "kubernetes service traffic requiring SNAT", "-j", "MASQUERADE", "--random-fully")
	ipt("-A", "KUBE-SERVICES", "-m", "comment", "--comment", "kubernetes service nodeports", "-m", "addrtype", "--dst-type", "LOCAL", "-j", "KUBE-NODEPORTS")
}

// nodePort adds kube-proxy's NodePort of a UDP Service whose endpoint is the hostNetwork pod on
// this node: KUBE-NODEPORTS sends port to the Service's chains, which mark it for masquerade
// (externalTrafficPolicy Cluster) and DNAT it to ip:target. The mark acts in POSTROUTING, which
// packets delivered locally never pass.
func (b *nodeBuilder) nodePort(n *NS, ip netip.Addr, port, target int) {
	ipt := func(args ...string) { b.in(n, "iptables", append([]string{"-t", "nat"}, args...)...) }
	for _, chain := range []string{"KUBE-EXT-STUNNER", "KUBE-SVC-STUNNER", "KUBE-SEP-STUNNER"} {
		ipt("-N", chain)
	}
	ipt("-A", "KUBE-NODEPORTS", "-p", "udp", "--dport", fmt.Sprint(port), "-j", "KUBE-EXT-STUNNER")
	ipt("-A", "KUBE-EXT-STUNNER", "-j", "KUBE-MARK-MASQ")
	ipt("-A", "KUBE-EXT-STUNNER", "-j", "KUBE-SVC-STUNNER")
	ipt("-A", "KUBE-SVC-STUNNER", "-j", "KUBE-SEP-STUNNER")
	ipt("-A", "KUBE-SEP-STUNNER", "-p", "udp", "-j", "DNAT", "--to-destination", fmt.Sprintf("%v:%d", ip, target))
}

// macvlanNIC gives the node a second NIC eth1 whose address is on a macvlan device on it
// (mv0, 10.10.0.1/24, bridge mode), as a host that shares a NIC with macvlan pods keeps its own
// address on a macvlan shim; the peer host (eth0 10.10.0.2/24, default route via the node) is at
// the far end of eth1's wire, which takes XDP frames; the macvlan device cannot.
func (b *nodeBuilder) macvlanNIC() {
	r := b.r
	host := b.ns("machost")
	r.Peer, r.PeerIP, r.PeerCIDR, r.EgressIf = host, macHost, "10.10.0.0/24", "mv0"
	b.disableIPv6(host)
	b.in(host, "sysctl", "-q", "-w", "net.ipv4.ip_forward=0")
	b.veth(r.Node, Iface{Name: "eth1"}, host, Iface{Name: "eth0"})
	b.ip(r.Node, "link", "add", "link", "eth1", "name", "mv0", "type", "macvlan", "mode", "bridge")
	b.ip(r.Node, "addr", "add", macNode.String()+"/24", "dev", "mv0")
	b.ip(r.Node, "link", "set", "mv0", "up")
	b.ip(host, "addr", "add", macHost.String()+"/24", "dev", "eth0")
	b.ip(host, "route", "add", "default", "via", macNode.String(), "dev", "eth0")
	b.attachXDPPass(host, "eth0")
}

// secondNIC gives the node eth1 on a wire of its own, whose far end is Wire2's eth0 (WithSecondNIC).
func (b *nodeBuilder) secondNIC() {
	r := b.r
	r.Wire2, r.NIC2, r.Wire2IP = b.ns("wire2"), "eth1", wire2IP
	b.disableIPv6(r.Wire2)
	b.in(r.Wire2, "sysctl", "-q", "-w", "net.ipv4.ip_forward=0")
	b.veth(r.Node, Iface{Name: "eth1"}, r.Wire2, Iface{Name: "eth0"})
	b.ip(r.Node, "addr", "add", nic2IP.String()+"/24", "dev", "eth1")
	b.ip(r.Wire2, "addr", "add", wire2IP.String()+"/24", "dev", "eth0")
	b.attachXDPPass(r.Wire2, "eth0")
}

// DaemonOptions say how StartDaemon runs the daemon on a node rig.
type DaemonOptions struct {
	Binary      string // the stunnerd-xdp binary (Binary(Daemon))
	SteeringDir string // a bpffs directory of the test's own: `ip netns exec` hides the host's /sys/fs/bpf
	Off         bool   // --xdp-mode=off; else no mode flag: the daemon's default
	// OffloadInterfaces are the config's offload_interfaces; empty, as a STUNner user leaves
	// them (STUNner reads that as "all"; the daemon attaches to the interfaces carrying the
	// listener and relay addresses).
	OffloadInterfaces []string
	User, Password    string // the static TURN credentials
	// Gateway, when set, is a second Gateway's daemon beside the first on the node: the
	// config's name, and its listener, metrics and health ports instead of the rig's
	// (ListenPort, 8080, 8086).
	Gateway *Gateway
	// Args are more flags.
	Args []string
}

// Gateway names one of several Gateways served on a node, each by its own daemon.
type Gateway struct {
	Name                                string
	ListenPort, MetricsPort, HealthPort uint16
}

// MetricsURL is where the daemon StartDaemon runs serves /metrics.
func (r *NodeRig) MetricsURL() string { return "http://" + r.NodeIP.String() + ":8080/metrics" }

// MetricsURL is where the Gateway's daemon serves /metrics on the rig's node.
func (g *Gateway) MetricsURL(r *NodeRig) string {
	return fmt.Sprintf("http://%s:%d/metrics", r.NodeIP, g.MetricsPort)
}

// StartDaemon runs the stunnerd-xdp binary in the node's namespace as a STUNner Dataplane runs
// it on a hostNetwork node: a STUNner config whose one TURN-UDP listener is on the node IP, port
// 3478, routing to a STATIC cluster of PeerCIDR, with metrics on NodeIP:8080 and health on
// NodeIP:8086 (a Gateway's own name and ports instead, when o.Gateway is set), and no flag but
// the mode, the steering directory and o.Args. It waits at most 10 s for
// /ready and stops the daemon when the test ends.
func (r *NodeRig) StartDaemon(t testing.TB, o DaemonOptions) *Proc {
	t.Helper()
	node := r.NodeIP.String()
	offload := ""
	if len(o.OffloadInterfaces) > 0 {
		offload = fmt.Sprintf("  offload_interfaces: [%s]\n", strings.Join(o.OffloadInterfaces, ", "))
	}
	g := Gateway{Name: string(r.Shape), ListenPort: 3478, MetricsPort: 8080, HealthPort: 8086}
	if o.Gateway != nil {
		g = *o.Gateway
	}
	conf := fmt.Sprintf(`version: v1
admin:
  name: %[1]s
  loglevel: all:INFO
  metrics_endpoint: "http://%[2]s:%[8]d/metrics"
  healthcheck_endpoint: "http://%[2]s:%[9]d"
%[3]sauth:
  type: static
  realm: %[4]s
  credentials: {username: %[5]s, password: %[6]s}
listeners:
  - {name: udp, protocol: TURN-UDP, address: %[2]s, port: %[10]d, routes: [peers]}
clusters:
  - {name: peers, type: STATIC, endpoints: [%[7]s]}
`, g.Name, node, offload, config.DefaultRealm, o.User, o.Password, r.PeerCIDR, g.MetricsPort, g.HealthPort, g.ListenPort)
	path := filepath.Join(t.TempDir(), "stunnerd.conf")
	if err := os.WriteFile(path, []byte(conf), 0o644); err != nil {
		t.Fatal(err)
	}
	args := []string{"--steering-dir=" + o.SteeringDir, "-c", path}
	if o.Off {
		args = append(args, "--xdp-mode=off")
	}
	args = append(args, o.Args...)
	p := r.Node.Start(t, o.Binary, args...)
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("daemon log:\n%s", p.Stderr())
		}
	})
	if err := Eventually(10*time.Second, 50*time.Millisecond, func() error {
		if p.Exited() {
			return Abort(fmt.Errorf("the daemon exited: %w\n%s", p.Wait(time.Second), p.Stderr()))
		}
		return r.Node.GetOK(fmt.Sprintf("http://%s:%d/ready", node, g.HealthPort))
	}); err != nil {
		t.Fatalf("node %s: the daemon did not come up: %v", r.Shape, err)
	}
	return p
}

// Settled reports, from one scrape of the daemon's metrics, whether its one channel binding has
// settled on a path: bound, and unless off, in the kernel's maps or kept in userspace for a
// reason other than pending (the NAT gate waits for conntrack's evidence).
func (m Metrics) Settled(off bool) bool {
	if ch, _ := m.Sum("stunnerd_xdp_channels_active"); ch != 1 {
		return false
	}
	if off {
		return true
	}
	offloaded, _ := m.Sum("stunnerd_xdp_bindings_offloaded")
	userspace, _ := m.Sum("stunnerd_xdp_bindings_userspace")
	pending, _ := m.Sum("stunnerd_xdp_bindings_userspace", "reason", "pending")
	return offloaded+userspace-pending == 1
}
