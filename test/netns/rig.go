package netns

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"
)

// Iface is one interface of a rig, named inside its namespace.
type Iface struct {
	Name  string
	Addr  netip.Addr // IPv4, on a /24
	Addr6 netip.Addr // IPv6, on a /64: set on the client side of a rig built WithIPv6, else invalid
	MAC   net.HardwareAddr
}

// Rig is a client, a relay server and a peer in three namespaces. The client has no route to the
// peer subnet, nor the peer to the client subnet: only a relay on the server connects them.
//
// Common to both rigs:
//   - IPv6 is disabled everywhere (no router solicitations, DAD or MLD noise in counters), except
//     on the client side of a rig built WithIPv6 (see there).
//   - IPv4 forwarding is off globally (net.ipv4.ip_forward=0, also if the host forwards) and on
//     for each server interface (net.ipv4.conf.IF.forwarding=1): bpf_fib_lookup returns
//     BPF_FIB_LKUP_RET_FWD_DISABLED without it. Per-device forwarding also lets the kernel
//     forward what arrives on that device, but neither side has a route to the other's subnet.
//   - Permanent neighbour entries both ways between the server and client and the server and
//     peer, so the first packets of a test never wait for ARP (and never take a slow path for it).
//   - Every veth keeps its default offloads, as containers and kind nodes do: tx checksum offload
//     is on, so what a socket sends leaves as a CHECKSUM_PARTIAL frame whose UDP checksum field
//     holds only the pseudo-header sum (captures show "bad udp cksum"). A relay on the server
//     sees such frames from the client and the peer and must complete their checksums.
//   - The server has a default route, as a node has: via the peer (10.200.0.2), so that traffic
//     to an address the node knows nothing about (a ClusterIP nobody translated, say) leaves
//     towards the peer side, through an interface the relay's program is attached to. The peer
//     does not forward: such packets end there (Ip.InAddrErrors). The client and the peer still
//     have no route to each other.
//   - A native XDP_PASS program on every veth end that receives frames the server XDP_TXes or
//     redirects: veth delivers XDP frames only to a peer that runs XDP itself, and silently loses
//     them otherwise.
type Rig struct {
	Client, Server, Peer *NS
	Bridge               *NS // Bridged only: holds the bridge "br0"

	ClientIf       Iface // "cl0" 10.100.0.2 (WithIPv6: also fd00:100::2) in Client
	ServerClientIf Iface // "srv0" 10.100.0.1 (WithIPv6: also fd00:100::1) in Server, facing the client
	ServerPeerIf   Iface // "srv1" 10.200.0.1 in Server, facing the peer; "srv0" when Bridged
	PeerIf         Iface // "peer0" 10.200.0.2 in Peer

	closers []func() error // undo what Build did, in reverse
}

// Names and addresses shared by both rigs.
var (
	clientAddr       = netip.MustParseAddr("10.100.0.2")
	serverClientAddr = netip.MustParseAddr("10.100.0.1")
	serverPeerAddr   = netip.MustParseAddr("10.200.0.1")
	peerAddr         = netip.MustParseAddr("10.200.0.2")

	clientAddr6       = netip.MustParseAddr("fd00:100::2")
	serverClientAddr6 = netip.MustParseAddr("fd00:100::1")
)

// Option changes how New and Build build a rig.
type Option func(*options)

type options struct {
	ipv6, bridged bool
	secondNIC     bool
	tag           string
}

// Bridged builds a rig in which the server reaches client and peer through one interface, so
// that the server's XDP program forwards with XDP_TX:
//
//	Client cl0 10.100.0.2/24 --brc--+
//	Peer peer0 10.200.0.2/24 --brp--+ br0 (Bridge) --brs-- srv0 10.100.0.1/24 + 10.200.0.1/24 Server
//
// XDP_PASS runs on brs, where frames XDP_TXed out of srv0 arrive; the bridge then forwards them to
// cl0 or peer0 as ordinary skbs. The bridge has static FDB entries for the three hosts, so it never
// floods their unicast frames to the wrong port. IPv6 frames cross the bridge at layer 2; the
// bridge namespace itself keeps IPv6 disabled.
func Bridged() Option {
	return func(o *options) { o.bridged = true }
}

// WithTag puts tag before the random tag in the namespace names (sxdp-TAG-1a2b3c-cl), for rigs
// that someone looks at, such as the demo's.
func WithTag(tag string) Option {
	return func(o *options) { o.tag = tag + "-" }
}

// WithIPv6 gives the client side of the rig IPv6 as well (dual stack), for relaying IPv6 clients
// to IPv4 peers: the client's cl0 gets fd00:100::2/64, the server's srv0 fd00:100::1/64. The peer
// side stays IPv4-only. In detail:
//   - IPv6 is enabled (disable_ipv6=0) on cl0 and srv0 only; lo, srv1, peer0 and the bridge keep
//     it disabled, and net.ipv6.conf.all.disable_ipv6 stays 1.
//   - No DAD (the addresses are added with nodad and accept_dad=0), so they are usable at once;
//     no link-local addresses (addr_gen_mode=1), no router solicitations, no RA processing.
//     MLD cannot be turned off: each side sends a few MLDv2 reports (from ::) in the first
//     seconds after its address appears (about 2 per interface, more on srv0, which joins the
//     all-routers groups). They carry a hop-by-hop header (router alert), so an XDP program on
//     srv0 counts the client's as IPv6 extension headers, not as ICMPv6.
//   - Permanent IPv6 neighbour entries both ways between cl0 and srv0: no neighbour discovery.
//   - net.ipv6.conf.IF.forwarding=1 on every server interface (srv0 and srv1; srv0 alone when
//     bridged): bpf_fib_lookup with AF_INET6 returns BPF_FIB_LKUP_RET_FWD_DISABLED unless the
//     *ingress* device forwards IPv6, and a peer->client packet arrives on srv1. The per-device
//     knob is enough for bpf_fib_lookup even on srv1, where IPv6 itself stays disabled;
//     net.ipv6.conf.all.forwarding stays 0, so the kernel itself forwards no IPv6.
func WithIPv6() Option {
	return func(o *options) { o.ipv6 = true }
}

// WithSecondNIC gives a node rig's node a second NIC on another wire (node rigs only; not with
// MacvlanNIC, whose eth1 it would be): eth1 10.30.0.1/24, a veth whose far end, eth0
// 10.30.0.2/24 of the namespace Wire2, stands for that wire's switch and whatever sends on it,
// and carries an XDP_PASS program as a wire's far end does. The node's routes stay as the shape
// has them: nothing but 10.30.0.0/24 leaves through eth1, so the route back to the client (and
// to anything else) does not point through it, as with a storage or management NIC.
func WithSecondNIC() Option {
	return func(o *options) { o.secondNIC = true }
}

// New builds a rig for the test, which removes it when it ends: without options the routed rig,
// cl --veth-- srv --veth-- peer:
//
//	Client cl0 10.100.0.2/24 <-> srv0 10.100.0.1/24 Server srv1 10.200.0.1/24 <-> peer0 10.200.0.2/24 Peer
//
// XDP_PASS runs on cl0 and peer0, so the server may XDP_REDIRECT between srv0 and srv1.
func New(t testing.TB, opts ...Option) *Rig {
	t.Helper()
	r, err := Build(opts...)
	if err != nil {
		t.Fatal(err)
	}
	closeAtCleanup(t, r.Close)
	return r
}

// NewRouted is New without options.
func NewRouted(t testing.TB) *Rig {
	t.Helper()
	return New(t)
}

// Build builds a rig, routed unless Bridged() is given, and returns it or what failed; on failure
// it removes what it had built. The caller closes the rig (Close); outside tests (the demo) this
// is the whole fixture.
func Build(opts ...Option) (r *Rig, err error) {
	var o options
	for _, opt := range opts {
		opt(&o)
	}
	r = &Rig{}
	defer func() {
		if err != nil {
			err = errors.Join(err, r.Close())
			r = nil
		}
	}()
	b := &builder{rig: r, closers: &r.closers, id: o.tag + uniqueTag()}
	r.Client, r.Server, r.Peer = b.ns("cl"), b.ns("srv"), b.ns("peer")
	r.ClientIf = Iface{Name: "cl0", Addr: clientAddr, MAC: macFor(clientAddr)}
	r.ServerClientIf = Iface{Name: "srv0", Addr: serverClientAddr, MAC: macFor(serverClientAddr)}
	r.PeerIf = Iface{Name: "peer0", Addr: peerAddr, MAC: macFor(peerAddr)}
	if o.ipv6 {
		r.ClientIf.Addr6 = clientAddr6
		r.ServerClientIf.Addr6 = serverClientAddr6
	}
	for _, n := range []*NS{r.Client, r.Server, r.Peer} {
		b.disableIPv6(n)
		// New namespaces inherit IPv4 settings from the host's, which may forward.
		b.in(n, "sysctl", "-q", "-w", "net.ipv4.ip_forward=0")
	}
	if o.bridged {
		b.bridge()
	} else {
		r.ServerPeerIf = Iface{Name: "srv1", Addr: serverPeerAddr, MAC: macFor(serverPeerAddr)}
		b.veth(r.Client, r.ClientIf, r.Server, r.ServerClientIf)
		b.veth(r.Peer, r.PeerIf, r.Server, r.ServerPeerIf)
	}
	b.configure()
	if o.bridged {
		b.attachXDPPass(r.Bridge, "brs")
	} else {
		b.attachXDPPass(r.Client, r.ClientIf.Name)
		b.attachXDPPass(r.Peer, r.PeerIf.Name)
	}
	return r, b.err
}

// Close detaches the rig's XDP_PASS programs and deletes its namespaces (and with them every
// interface). It returns every failure.
func (r *Rig) Close() error { return undo(&r.closers) }

// undo runs the closers in reverse, forgets them, and returns every failure.
func undo(closers *[]func() error) error {
	var errs []error
	for i := len(*closers) - 1; i >= 0; i-- {
		errs = append(errs, (*closers)[i]())
	}
	*closers = nil
	return errors.Join(errs...)
}

// ServerIfaces returns the names of the server's interfaces: where a relay attaches its program.
func (r *Rig) ServerIfaces() []string {
	if r.ServerClientIf.Name == r.ServerPeerIf.Name {
		return []string{r.ServerClientIf.Name}
	}
	return []string{r.ServerClientIf.Name, r.ServerPeerIf.Name}
}

// builder runs the steps of Build (and BuildNode), keeping the first error: after it, every step
// does nothing.
type builder struct {
	rig     *Rig            // Build's rig; nil for BuildNode
	closers *[]func() error // where ns and attachXDPPass record how to undo what they made
	id      string          // random tag in the namespace names
	err     error
}

func (b *builder) exec(name string, args ...string) {
	if b.err == nil {
		_, b.err = Exec(name, args...)
	}
}

// ip runs `ip -n NS args...`.
func (b *builder) ip(n *NS, args ...string) { b.exec("ip", append([]string{"-n", n.Name}, args...)...) }

// in runs a command inside n.
func (b *builder) in(n *NS, name string, args ...string) {
	b.exec("ip", append([]string{"netns", "exec", n.Name, name}, args...)...)
}

// ns creates the rig's namespace for role; Close deletes it.
func (b *builder) ns(role string) *NS {
	if b.err != nil {
		return &NS{}
	}
	n, err := CreateNS(b.id + "-" + role)
	if err != nil {
		b.err = err
		return &NS{}
	}
	*b.closers = append(*b.closers, n.Delete)
	return n
}

// bridge creates the bridge namespace and the three veths into it (see Bridged).
func (b *builder) bridge() {
	r := b.rig
	r.ServerPeerIf = Iface{Name: "srv0", Addr: serverPeerAddr, MAC: r.ServerClientIf.MAC}
	r.Bridge = b.ns("br")
	b.disableIPv6(r.Bridge)
	b.ip(r.Bridge, "link", "add", "br0", "type", "bridge")
	b.ip(r.Bridge, "link", "set", "br0", "up")
	for _, port := range []struct {
		ns    *NS
		iface Iface
		name  string
	}{
		{r.Client, r.ClientIf, "brc"},
		{r.Peer, r.PeerIf, "brp"},
		{r.Server, r.ServerClientIf, "brs"},
	} {
		b.veth(port.ns, port.iface, r.Bridge, Iface{Name: port.name})
		b.ip(r.Bridge, "link", "set", port.name, "master", "br0")
		b.exec("bridge", "-n", r.Bridge.Name, "fdb", "replace", port.iface.MAC.String(), "dev", port.name, "master", "static")
	}
}

// configure sets addresses, forwarding, neighbours and the server's default route once the veths exist.
func (b *builder) configure() {
	r := b.rig
	b.ip(r.Client, "addr", "add", r.ClientIf.Addr.String()+"/24", "dev", r.ClientIf.Name)
	b.ip(r.Peer, "addr", "add", r.PeerIf.Addr.String()+"/24", "dev", r.PeerIf.Name)
	b.ip(r.Server, "addr", "add", r.ServerClientIf.Addr.String()+"/24", "dev", r.ServerClientIf.Name)
	b.ip(r.Server, "addr", "add", r.ServerPeerIf.Addr.String()+"/24", "dev", r.ServerPeerIf.Name)

	sysctls := []string{"-q", "-w"}
	for _, name := range r.ServerIfaces() {
		sysctls = append(sysctls, fmt.Sprintf("net.ipv4.conf.%s.forwarding=1", name))
	}
	b.in(r.Server, "sysctl", sysctls...)

	b.neigh(r.Server, r.ServerClientIf.Name, r.ClientIf)
	b.neigh(r.Server, r.ServerPeerIf.Name, r.PeerIf)
	b.neigh(r.Client, r.ClientIf.Name, r.ServerClientIf)
	b.neigh(r.Peer, r.PeerIf.Name, r.ServerPeerIf)

	b.ip(r.Server, "route", "add", "default", "via", r.PeerIf.Addr.String(), "dev", r.ServerPeerIf.Name)

	if r.ClientIf.Addr6.IsValid() {
		b.configureIPv6()
	}
}

// configureIPv6 turns IPv6 on between cl0 and srv0 (see WithIPv6).
func (b *builder) configureIPv6() {
	r := b.rig
	server := enableIPv6Args(r.ServerClientIf.Name)
	for _, name := range r.ServerIfaces() {
		server = append(server, fmt.Sprintf("net.ipv6.conf.%s.forwarding=1", name))
	}
	b.in(r.Client, "sysctl", enableIPv6Args(r.ClientIf.Name)...)
	b.in(r.Server, "sysctl", server...)

	b.ip(r.Client, "addr", "add", r.ClientIf.Addr6.String()+"/64", "dev", r.ClientIf.Name, "nodad")
	b.ip(r.Server, "addr", "add", r.ServerClientIf.Addr6.String()+"/64", "dev", r.ServerClientIf.Name, "nodad")
	b.ip(r.Server, "-6", "neigh", "replace", r.ClientIf.Addr6.String(), "lladdr", r.ClientIf.MAC.String(), "dev", r.ServerClientIf.Name, "nud", "permanent")
	b.ip(r.Client, "-6", "neigh", "replace", r.ServerClientIf.Addr6.String(), "lladdr", r.ServerClientIf.MAC.String(), "dev", r.ClientIf.Name, "nud", "permanent")
}

// enableIPv6Args are the sysctl arguments that enable IPv6 on one interface without DAD, link-local
// addresses or router discovery. The order matters: disable_ipv6=0 comes last, when the interface
// no longer generates a link-local address nor solicits routers.
func enableIPv6Args(dev string) []string {
	args := []string{"-q", "-w"}
	for _, kv := range []string{"addr_gen_mode=1", "accept_ra=0", "router_solicitations=0", "accept_dad=0", "disable_ipv6=0"} {
		args = append(args, "net.ipv6.conf."+dev+"."+kv)
	}
	return args
}

// veth creates a veth pair a (in nsA) <-> b (in nsB) and sets both ends up. Interfaces without a
// MAC get a random one.
func (b *builder) veth(nsA *NS, a Iface, nsB *NS, bIf Iface) {
	args := []string{"link", "add", "name", a.Name, "netns", nsA.Name}
	if a.MAC != nil {
		args = append(args, "address", a.MAC.String())
	}
	args = append(args, "type", "veth", "peer", "name", bIf.Name, "netns", nsB.Name)
	if bIf.MAC != nil {
		args = append(args, "address", bIf.MAC.String())
	}
	b.exec("ip", args...)
	b.ip(nsA, "link", "set", a.Name, "up")
	b.ip(nsB, "link", "set", bIf.Name, "up")
}

// neigh installs a permanent neighbour entry for to on dev in n.
func (b *builder) neigh(n *NS, dev string, to Iface) {
	b.ip(n, "neigh", "replace", to.Addr.String(), "lladdr", to.MAC.String(), "dev", dev, "nud", "permanent")
}

func (b *builder) disableIPv6(n *NS) {
	// "default" covers interfaces created later, "all" those that exist (lo).
	b.in(n, "sysctl", "-q", "-w", "net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1")
}

// attachXDPPass attaches an XDP_PASS program to iface in n until the rig closes.
func (b *builder) attachXDPPass(n *NS, iface string) {
	if b.err != nil {
		return
	}
	var closer func() error
	closer, b.err = n.attachXDPPass(iface)
	if b.err == nil {
		*b.closers = append(*b.closers, closer)
	}
}

// SendersOffloadChecksums returns an error unless the client's and the peer's interfaces have tx
// checksum offload on, the veth default that the rigs keep: they hand the relay CHECKSUM_PARTIAL
// frames.
func (r *Rig) SendersOffloadChecksums() error {
	for _, side := range []struct {
		ns  *NS
		dev string
	}{{r.Client, r.ClientIf.Name}, {r.Peer, r.PeerIf.Name}} {
		if out, err := side.ns.Exec("ethtool", "-k", side.dev); err != nil || !strings.Contains(out, "tx-checksumming: on") {
			return fmt.Errorf("netns %s: %s sends with tx checksum offload off (%w)", side.ns.Name, side.dev, err)
		}
	}
	return nil
}

// macFor derives a locally administered MAC from an IPv4 address: 10.100.0.2 -> 02:00:0a:64:00:02.
func macFor(addr netip.Addr) net.HardwareAddr {
	a := addr.As4()
	return net.HardwareAddr{0x02, 0x00, a[0], a[1], a[2], a[3]}
}

// attachXDPPass attaches a program that returns XDP_PASS to iface in native (driver) mode. On a
// veth this makes the interface accept frames that its peer XDP_TXes or that are XDP_REDIRECTed
// into its peer.
func (n *NS) attachXDPPass(iface string) (func() error, error) {
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Name:    "xdp_pass",
		Type:    ebpf.XDP,
		License: "MIT",
		// Built with asm rather than clang so that the fixtures need no BPF toolchain.
		Instructions: asm.Instructions{
			asm.Mov.Imm(asm.R0, 2), // XDP_PASS
			asm.Return(),
		},
	})
	if err != nil {
		return nil, fmt.Errorf("loading XDP_PASS program: %w", err)
	}
	detach, err := n.attachXDP(iface, prog)
	if err != nil {
		return nil, errors.Join(err, prog.Close())
	}
	return func() error { return errors.Join(detach(), prog.Close()) }, nil
}

// AttachXDP attaches prog to iface in native (driver) mode and detaches it when the test ends.
func (n *NS) AttachXDP(t testing.TB, iface string, prog *ebpf.Program) {
	t.Helper()
	detach, err := n.attachXDP(iface, prog)
	if err != nil {
		t.Fatal(err)
	}
	closeAtCleanup(t, detach)
}

func (n *NS) attachXDP(iface string, prog *ebpf.Program) (func() error, error) {
	var l link.Link
	err := n.Do(func() error {
		ifi, err := net.InterfaceByName(iface)
		if err != nil {
			return err
		}
		l, err = link.AttachXDP(link.XDPOptions{Program: prog, Interface: ifi.Index, Flags: link.XDPDriverMode})
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("netns %s: attaching XDP to %s: %w", n.Name, iface, err)
	}
	return func() error {
		if err := l.Close(); err != nil {
			return fmt.Errorf("netns %s: detaching XDP from %s: %w", n.Name, iface, err)
		}
		return nil
	}, nil
}
