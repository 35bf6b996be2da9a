// Package natcheck tells whether the kernel translates (NATs) the UDP flow
// between a relay socket and a peer. XDP runs before netfilter: a frame the
// relay program rewrites and redirects never meets the DNAT that kube-proxy
// applies to a Service ClusterIP in OUTPUT, nor a SNAT or masquerade rule.
// pion/turn's socket does meet them, so a binding whose flow the kernel NATs
// has to stay on the userspace path, with one exception: a flow whose only
// translation is a source NAT of the relay address (flannel's masquerade of
// what the node sends into the pod network) is Translated, and the kernel
// path may relay it as netfilter would have rewritten it, from the address
// and port the entry maps the relay to (its reply tuple's destination).
//
// The evidence is the namespace's conntrack table, read through ctnetlink:
// NAT status bits, or a reply tuple that does not mirror the original, mean
// the kernel rewrites the flow; no conntrack in use means nothing is NATed.
// What this cannot see, and what the kernel path skips for a flow it
// offloads: docs/internals.md.
package natcheck

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"strings"
	"sync"

	"github.com/mdlayher/netlink"
	"github.com/ti-mo/conntrack"
	"golang.org/x/sys/unix"
)

// Verdict is what the kernel does with a relay<->peer flow.
type Verdict int

const (
	// Unknown: no evidence yet (no conntrack entry for the flow): keep the
	// binding in userspace, where pion's packets create the entry, and ask
	// again later.
	Unknown Verdict = iota
	// Direct: the kernel does not translate the flow: the XDP path may relay it.
	Direct
	// NATed: the kernel translates the flow: relay it in userspace.
	NATed
	// Translated: the flow was made by the relay (pion sent first) and the
	// kernel's only change is the relay's source address and port (SNAT,
	// MASQUERADE) to Result.Wire; the peer is not translated. The kernel path
	// may relay it from Wire, for as long as the entry stands (conntrack
	// keeps the mapping only while the entry lives: a new entry may map the
	// relay elsewhere).
	Translated
)

func (v Verdict) String() string {
	switch v {
	case Direct:
		return "direct"
	case NATed:
		return "nat"
	case Translated:
		return "snat"
	default:
		return "unknown"
	}
}

// Result is a verdict and the evidence for it, for the logs.
type Result struct {
	Verdict Verdict
	Why     string
	// Wire is the relay's address and port as the peer sees them: the
	// relay's own for Direct, the translated source for Translated; zero
	// otherwise.
	Wire netip.AddrPort
}

// ErrClosed is returned by Check after Close.
var ErrClosed = errors.New("natcheck: checker closed")

// CountSysctl exists in a network namespace while the conntrack module is loaded.
const CountSysctl = "/proc/sys/net/netfilter/nf_conntrack_count"

// Checker looks flows up in the conntrack table of the network namespace it
// was created in. It is safe for concurrent use.
type Checker struct {
	sysctl string

	mu     sync.Mutex
	conn   *conntrack.Conn // nil while conntrack is not loaded
	closed bool
}

// New returns a checker for the calling thread's network namespace. It opens
// no netlink socket while conntrack is not loaded: a ctnetlink request would
// make the kernel load nf_conntrack just to answer it.
func New() (*Checker, error) {
	c := &Checker{sysctl: CountSysctl}
	if _, err := c.dial(); err != nil {
		return nil, err
	}
	return c, nil
}

// dial opens the ctnetlink socket once conntrack is loaded; it returns nil
// (and no error) while it is not.
func (c *Checker) dial() (*conntrack.Conn, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil, ErrClosed
	}
	if c.conn != nil {
		return c.conn, nil
	}
	if _, err := os.Stat(c.sysctl); err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil, nil
		}
		return nil, fmt.Errorf("natcheck: %w", err)
	}
	conn, err := conntrack.Dial(&netlink.Config{})
	if err != nil {
		return nil, fmt.Errorf("natcheck: conntrack netlink: %w", err)
	}
	c.conn = conn
	return conn, nil
}

// Close closes the netlink socket; Check fails with ErrClosed after it.
func (c *Checker) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.closed = true
	if c.conn == nil {
		return nil
	}
	err := c.conn.Close()
	c.conn = nil
	return err
}

// Check returns what the kernel does with the UDP flow between relay and
// peer. An error leaves the verdict Unknown.
func (c *Checker) Check(relay, peer netip.AddrPort) (Result, error) {
	relay = netip.AddrPortFrom(relay.Addr().Unmap(), relay.Port())
	peer = netip.AddrPortFrom(peer.Addr().Unmap(), peer.Port())
	conn, err := c.dial()
	if err != nil {
		return Result{}, err
	}
	if conn == nil {
		return Result{Direct, "conntrack is not loaded: nothing can NAT the flow", relay}, nil
	}
	// The kernel looks a tuple up in both directions, so relay->peer also
	// finds a flow the peer started when nothing translated it.
	for _, t := range [][2]netip.AddrPort{{relay, peer}, {peer, relay}} {
		f, err := conn.Get(flow(t[0], t[1]))
		if errors.Is(err, unix.ENOENT) {
			continue
		}
		if err != nil {
			return Result{}, fmt.Errorf("natcheck: conntrack get %v->%v: %w", t[0], t[1], err)
		}
		return ClassifyRelay(f, relay, peer), nil
	}
	// Conntrack is loaded but may not be hooked into this namespace (it is
	// only once a rule needs it). The binding's own TURN traffic passed the
	// stack moments ago, so an empty table means nothing is tracked here.
	st, err := conn.StatsGlobal()
	if err != nil {
		return Result{}, fmt.Errorf("natcheck: conntrack stats: %w", err)
	}
	if st.Entries == 0 {
		return Result{Direct, "conntrack tracks nothing in this network namespace: nothing can NAT the flow", relay}, nil
	}
	return Result{Verdict: Unknown, Why: "no conntrack entry for the flow yet"}, nil
}

func flow(src, dst netip.AddrPort) conntrack.Flow {
	return conntrack.NewFlow(unix.IPPROTO_UDP, 0, src.Addr(), dst.Addr(), src.Port(), dst.Port(), 0, 0)
}

// Classify sorts a conntrack entry: translated (NAT status bits, or a reply
// tuple that is not the original one reversed, as IPVS leaves it) or not.
func Classify(f conntrack.Flow) Result {
	o, r := f.TupleOrig, f.TupleReply
	desc := fmt.Sprintf("%v:%d->%v:%d replies %v:%d->%v:%d",
		o.IP.SourceAddress, o.Proto.SourcePort, o.IP.DestinationAddress, o.Proto.DestinationPort,
		r.IP.SourceAddress, r.Proto.SourcePort, r.IP.DestinationAddress, r.Proto.DestinationPort)
	switch {
	case f.Status.DstNAT() && f.Status.SrcNAT():
		return Result{Verdict: NATed, Why: "SNAT and DNAT: " + desc}
	case f.Status.DstNAT():
		return Result{Verdict: NATed, Why: "DNAT: " + desc}
	case f.Status.SrcNAT():
		return Result{Verdict: NATed, Why: "SNAT: " + desc}
	case r.IP.SourceAddress != o.IP.DestinationAddress || r.IP.DestinationAddress != o.IP.SourceAddress ||
		r.Proto.SourcePort != o.Proto.DestinationPort || r.Proto.DestinationPort != o.Proto.SourcePort:
		return Result{Verdict: NATed, Why: "reply tuple does not mirror the original: " + desc}
	}
	return Result{Direct, "not translated: " + desc, endpoint(o.IP.SourceAddress, o.Proto.SourcePort)}
}

// ClassifyRelay sorts the entry of the flow between relay and peer as
// Classify does, and tells a source NAT of the relay alone (Translated) from
// other translations. Translated needs all of:
//   - the entry's original direction is relay -> peer: pion sent first, and
//     the NAT binding was made for its packets in POSTROUTING (a SNAT of a
//     flow the peer started would rewrite the peer, not the relay);
//   - IPS_SRC_NAT without IPS_DST_NAT, and the reply comes from the peer
//     itself (address and port: nothing rewrites where pion sends);
//   - the reply goes to an IPv4 address and port other than the relay's:
//     that is where netfilter rewrote pion's source to, and where the peer's
//     replies arrive.
//
// Direct's Wire is the relay; a Direct entry found the other way round (the
// peer sent first) is Direct too.
func ClassifyRelay(f conntrack.Flow, relay, peer netip.AddrPort) Result {
	res := Classify(f)
	o, r := f.TupleOrig, f.TupleReply
	origSrc, origDst := endpoint(o.IP.SourceAddress, o.Proto.SourcePort), endpoint(o.IP.DestinationAddress, o.Proto.DestinationPort)
	replySrc, replyDst := endpoint(r.IP.SourceAddress, r.Proto.SourcePort), endpoint(r.IP.DestinationAddress, r.Proto.DestinationPort)
	switch res.Verdict {
	case Direct:
		res.Wire = relay
		return res
	case NATed:
	default:
		return res
	}
	if origSrc != relay || origDst != peer || f.Status.DstNAT() || !f.Status.SrcNAT() ||
		replySrc != peer || replyDst == relay || !replyDst.Addr().Is4() || replyDst.Port() == 0 {
		return res
	}
	return Result{Translated, "source NAT of the relay to " + replyDst.String() + ": " + strings.TrimPrefix(res.Why, "SNAT: "), replyDst}
}

func endpoint(a netip.Addr, port uint16) netip.AddrPort {
	return netip.AddrPortFrom(a.Unmap(), port)
}

// ClientVerdict is what conntrack says of a client's flow to the node.
type ClientVerdict int

const (
	// ClientNone: no entry (yet): the client's next packet meets the
	// rules afresh.
	ClientNone ClientVerdict = iota
	// ClientHere: the entry leads to the listener.
	ClientHere
	// ClientElsewhere: the entry leads elsewhere (DNATed to another node).
	ClientElsewhere
)

// CheckClient looks up the entry of the client's flow to wire (where its
// packets arrive: the listener, a VIP, a NodePort) and tells whether it
// leads to the listener socket: replies from listener (for a wildcard
// listener, from one of the namespace's addresses on its port) to the client.
// Without conntrack in use every flow leads where it is sent: ClientHere.
func (c *Checker) CheckClient(client, wire, listener netip.AddrPort) (ClientVerdict, error) {
	client = netip.AddrPortFrom(client.Addr().Unmap(), client.Port())
	wire = netip.AddrPortFrom(wire.Addr().Unmap(), wire.Port())
	conn, err := c.dial()
	if err != nil {
		return ClientNone, err
	}
	if conn == nil {
		return ClientHere, nil
	}
	f, err := conn.Get(flow(client, wire))
	if errors.Is(err, unix.ENOENT) {
		return ClientNone, nil
	}
	if err != nil {
		return ClientNone, fmt.Errorf("natcheck: conntrack get %v->%v: %w", client, wire, err)
	}
	rep := f.TupleReply
	if endpoint(f.TupleOrig.IP.SourceAddress, f.TupleOrig.Proto.SourcePort) != client {
		rep = f.TupleOrig // made in the other direction
	}
	from := endpoint(rep.IP.SourceAddress, rep.Proto.SourcePort)
	to := endpoint(rep.IP.DestinationAddress, rep.Proto.DestinationPort)
	here := to == client && from.Port() == listener.Port() &&
		(from.Addr() == listener.Addr().Unmap() || listener.Addr().IsUnspecified() && IsLocal(from.Addr()))
	if here {
		return ClientHere, nil
	}
	return ClientElsewhere, nil
}

// IsLocal tells whether a is an address of one of the calling thread's
// namespace's interfaces.
func IsLocal(a netip.Addr) bool {
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return false
	}
	for _, ia := range addrs {
		if n, ok := ia.(*net.IPNet); ok {
			if ip, ok := netip.AddrFromSlice(n.IP); ok && ip.Unmap() == a.Unmap() {
				return true
			}
		}
	}
	return false
}
