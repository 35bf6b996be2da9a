// Package model is the executable specification of the XDP fast path: a small,
// pure-Go description of what the program in bpf/relay.c must do with one frame,
// written from RFC 8656 (ChannelData over UDP), RFC 768/1071 (checksums) and the
// behaviour the README documents, not from the C. The tests in bpf/ run golden,
// hostile and fuzzed frames through both the program (BPF_PROG_RUN) and this
// model and fail on any difference in verdict, reason, output bytes or learned
// state.
//
// What the model says, in order:
//
//  1. Only untagged, option-less, unfragmented IPv4/UDP whose IP total length fits
//     the frame, and untagged IPv6/UDP without extension headers whose payload
//     length fits the frame, and whose UDP length agrees with it, is looked at;
//     bytes after the IP packet are an Ethernet trailer. Everything else passes
//     untouched.
//  2. UDP to a listener port, or to a port that a destination the listeners
//     accept carries in place of its listener's port (a DNAT translated it: a
//     NodePort 31478 in front of listener port 3478; the program keeps such
//     ports in wire_ports), must be ChannelData (first two bits 01) with its
//     length inside the payload and at most 3 bytes of padding after it, sent to
//     a destination (address:port on the wire) that a listener accepts -- what
//     the kernel would deliver to that listener's socket: never transit traffic,
//     never another listener's address -- by a bound (client address:port,
//     listener, channel). It must be what the kernel would take (IPv4 header
//     checksum right; IPv6 with a UDP checksum) and have a TTL (hop limit) of 2
//     or more. Such a packet shows the address and port the client sends to,
//     which become the source of replies: nothing else teaches them. A port
//     that is both a relay port and a translated one is taken as a relay port.
//  3. UDP to a relay port, or to the port a bound relay has on the wire when
//     the node source-NATs it (Binding.Wire: a masquerade's port may lie
//     outside the relay range; the program keeps such ports in
//     nat_relay_ports), must come from exactly the bound peer address:port to
//     the bound relay address:port as the peer sees it (Wire when set), the
//     reply source (address and port) must be known, and the packet must be
//     what the kernel would take, with a TTL of 2 or more. Ports are told
//     apart in this order: a listener's, a relay port, a translated listener
//     port (point 2), a translated relay port.
//  4. The rewritten packet (client->peer: the data alone, relay (as the peer
//     sees it) -> peer;
//     peer->client: ChannelData header + data, listener -> client) leaves through
//     the next hop the kernel's FIB gives for it, looked up as if forwarded from the
//     ingress interface; when the FIB cannot give one the original packet passes.
//  5. What the relay sends carries the input's TTL less one (RFC 8656 §14), TOS,
//     ID and DF, and a UDP checksum that is absent when the input's was, is
//     computed afresh when the input's was only the pseudo-header sum
//     (CHECKSUM_PARTIAL, from a veth or container sender with tx offload), and
//     otherwise carries the input's checksum error over, so that a datagram
//     damaged before the relay still fails at the receiver.
//  6. Clients may be IPv6; relays and peers are IPv4. An IPv6 client's ChannelData
//     leaves as IPv4 (TOS = traffic class, ID 0, DF, TTL = hop limit - 1) and the
//     replies to it as IPv6 (traffic class = TOS, flow label 0, hop limit = TTL
//     - 1), found by an IPv6 FIB lookup. IPv6 requires a UDP checksum: a peer
//     datagram without one for an IPv6 client passes (pion/turn sums it), and an
//     IPv6 client datagram without one passes (Linux drops it, RFC 8200 §8.1).
//  7. Under a rate limit (Env.RateLimit), a packet that would be relayed is
//     charged to its allocation (its relayed transport address: all its
//     channels, both directions together), as a GCRA: the allocation owes the
//     instant by which what it relayed is paid for at the limit's
//     rates (one packet: 1 s / packets per second; one byte of application
//     data: 1 s / bytes per second), and a packet goes while that instant is
//     at most RateBurst ahead of now. A packet over the limit is charged
//     nothing and dropped, or passed untouched when the limit says so. Packets
//     that pass for any other reason are not charged: pion/turn's limiter
//     counts those.
//  8. A relayed frame leaves only where it will be transmitted. From an
//     interface where the program runs natively (or of which nothing is
//     known), XDP_REDIRECT hands the frame to the egress driver's
//     ndo_xdp_xmit, and a device without one (a bridge, VLAN, macvlan or
//     tunnel device) or refusing it (a veth whose peer runs no XDP) drops it
//     after the program returned; XDP_TX out of a veth is that same transmit
//     into its peer. So such a packet is relayed only when the egress says it
//     transmits XDP frames (Interface.Caps: XDPXmit for a redirect, XDPTX for
//     XDP_TX), and otherwise passes untouched to the stack, which forwards it.
//     From an interface where the program runs generically, both go out
//     through the skb path, which every device takes. The decision is the next
//     hop's: it is made again whenever the FIB generation moves.
//  9. A packet longer than its ingress interface's MTU did not come off that
//     wire as one frame (generic XDP sees a UDP GSO super-packet as one
//     datagram): it passes untouched, for the stack to segment. Only packets
//     (from the IP header on) longer than MTUCheckAbove are measured, against
//     Interface.Caps.MTU; with no Caps every such packet passes.
//  10. The TC engine (ProcessTC) relays the same bindings by the same rules on the
//     skb path, with what the skb path changes: every egress the FIB gives is
//     reachable (the devmap is not consulted); an skb holding several datagrams
//     (GSO) passes, and so does one whose VLAN tag the device took off (the
//     frame was tagged: rule 1); the checksum follows the skb's ip_summed, not the field: a
//     CHECKSUM_PARTIAL skb's field gets the output's pseudo-header sum (its
//     egress sums the rest from the UDP header, which stays where csum_start
//     points; one whose csum_start points elsewhere passes), every other skb's
//     a full checksum that carries the input's error over (rule 5 without its
//     PARTIAL guess). Verdicts are TC actions: relayed packets are redirected,
//     everything else goes on untouched (TCX_NEXT), and what a dropping rate
//     limit refuses is shot. A redirect into an egress whose transmit needs a
//     route on the skb (Caps.NeedsRoute: an ip_tunnel device without a fixed
//     remote, such as tunl0, drops an skb without one) is made with
//     bpf_redirect_neigh, which routes it out of that device and attaches
//     the route: the same frame and reason, counted as well under
//     TC_REASON_REDIRECT_NEIGH (Result.RedirectNeigh). On a device without a
//     link-layer header (SKB.L3: tunl0, WireGuard, GRE; decapsulated media
//     enter there) the skb starts at the IP header: the family is its version
//     nibble, a relayed packet leaves as the same Ethernet frame as from any
//     other ingress, and one whose family would change (IPv4 <-> IPv6)
//     passes (TC_REASON_L3_FAMILY). A relayed skb leaves with the priority the
//     stack gives a datagram of its TOS (TOSPriority, as ip_forward and a
//     socket's IP_TOS set it; IPv6 0), which egress qdiscs sort by, and mark
//     0, a socket's (pion/turn's sockets set none); a passed one keeps both.
//  11. An IPv4 packet that would be relayed from a device where the stack
//     filters by reverse path (Caps.RPFilter: net.ipv4.conf.{all,<dev>}.rp_filter
//     as userspace derives it) is first checked as fib_validate_source checks a
//     locally delivered one: the route back to its source from its
//     destination, looked up as input from the loopback device. Strict: that
//     route must leave through the ingress; loose: a unicast route back must
//     exist. A source that is local, broadcast, unreachable or without a
//     route fails both. What fails passes (REASON_RP_FILTER: the stack drops
//     it) before it teaches a reply source (point 2); when the lookup cannot
//     be made as the stack makes it (bpf_fib_lookup refuses an input from lo
//     whose forwarding is off: Env.LoopbackForwarding) the packet passes
//     too (REASON_RP_UNCHECKED), teaching nothing. IPv6 has no rp_filter
//     setting (netfilter's rpfilter match is a rule, not the stack's): IPv6
//     packets are not checked.
//  12. The listener's shield (Env.Shield): a datagram to a listener port that
//     is not bound (rule 2 would pass it as STUN, malformed or oversize
//     ChannelData, or for no channel) and that the kernel would deliver to a
//     listener socket (its destination in Env.Destinations; not from or to an
//     IPv4-mapped IPv6 address) is dropped when pion/turn would discard it
//     unanswered (internal/server HandleRequest, in its order): one that
//     pion/turn takes as ChannelData (proto.IsChannelData: first two bits 01,
//     the length within the payload) from a client with no allocation on
//     that listener socket (Env.Allocations, Env.NodeAllocations; tested only
//     with Shield.Allocations) is REASON_NO_ALLOCATION; anything else whose
//     STUN header does not decode (stun.Message.Decode: 20 bytes or more, the
//     magic cookie, the length within the payload; attributes are not
//     walked) is REASON_NOT_TURN; a STUN message of a class and method
//     pion/turn has no handler for (it serves Binding, Allocate, Refresh,
//     CreatePermission and ChannelBind requests and Send indications; the
//     method read without the type's top two bits, as stun reads it) is
//     REASON_STUN_UNHANDLED. Everything else passes as before, for pion/turn
//     to answer or discard. The shield runs once per packet: the TC engine
//     (rule 10) runs it only on an ingress whose Caps say the XDP program is
//     not attached there (with no Caps, it assumes XDP ran).
//  13. Admission (Shield.Admission, with the shield on): a STUN request that
//     rule 12 passes, from a client with no allocation on that listener
//     socket (an unauthenticated one: its Allocate, a Binding), is charged
//     to its source address as a GCRA: the address owes the instant by which
//     its requests are paid for at Cost each (1 s / requests per second), and
//     a request goes while that instant is at most Burst ahead of now; over
//     it, it is dropped (REASON_ADMISSION) and charged nothing. An address
//     that owes nothing starts afresh. Requests of clients with an
//     allocation, and indications, are not charged.
package model

import (
	"encoding/binary"
	"fmt"
	"net/netip"
	"time"

	"golang.org/x/sys/unix"

	"github.com/l7mp/stunnerd-xdp/bpf"
	"github.com/l7mp/stunnerd-xdp/internal/channelmap"
)

// Verdict is an XDP action, numbered as the kernel numbers them so that it
// compares directly with what BPF_PROG_RUN returns.
type Verdict uint32

// The verdicts the program gives. It drops (XDP_DROP) only what is over a
// rate limit that says so, and what the listener shield drops (rule 12).
const (
	Drop     Verdict = 1 // XDP_DROP: over the rate limit, or the shield's
	Pass     Verdict = 2 // XDP_PASS: the kernel and pion/turn get the frame
	TX       Verdict = 3 // XDP_TX: out of the ingress interface
	Redirect Verdict = 4 // XDP_REDIRECT: out of another attached interface
)

func (v Verdict) String() string {
	switch v {
	case Drop:
		return "DROP"
	case Pass:
		return "PASS"
	case TX:
		return "TX"
	case Redirect:
		return "REDIRECT"
	}
	return fmt.Sprintf("XDP action %d", uint32(v))
}

// Limits of the fast path that are policy, not protocol.
const (
	// MaxDataLen is the largest application data relayed in the kernel
	// (CHANNEL_DATA_MAX_LEN); larger messages pass as oversize.
	MaxDataLen = 0x1fff
	// MaxPadding is the most padding accepted after ChannelData over UDP: what
	// rounds a message up to a multiple of 4 (RFC 8656 §12.5). More trailing
	// bytes are not a ChannelData message we understand.
	MaxPadding = 3
	// MinTTL is the smallest TTL (hop limit) relayed in the kernel: what it
	// sends has one less, and what would leave with 0 is pion/turn's.
	MinTTL = 2
	// MTUCheckAbove is the IP packet length above which the ingress
	// interface's MTU is checked (MTU_CHECK_ABOVE): shorter packets fit every
	// default MTU and pay no lookup.
	MTUCheckAbove = 1500
)

// DevCaps is what the program knows of a device (its dev_caps entry).
type DevCaps struct {
	// Native and Generic: the program is attached there in that mode (at most
	// one); neither, as a device the program is not attached to.
	Native, Generic bool
	// XDPXmit: a native XDP_REDIRECT to it is transmitted
	// (NETDEV_XDP_ACT_NDO_XMIT).
	XDPXmit bool
	// XDPTX: a native XDP_TX out of it is transmitted.
	XDPTX bool
	// MTU is the device's MTU as the program was told it.
	MTU int
	// NeedsRoute: its transmit takes the outer destination from the route
	// attached to the skb (an ip_tunnel device without a fixed remote, such
	// as Calico's tunl0): the TC engine redirects into it with
	// bpf_redirect_neigh, which attaches one (rule 10).
	NeedsRoute bool
	// RPFilter is how the stack filters IPv4 arriving here by reverse path
	// (rule 11).
	RPFilter RPFilter
}

// RPFilter is a device's reverse-path filtering as the program is told it:
// the larger of net.ipv4.conf.all.rp_filter and the device's own, strict
// also when loose on a device without an IPv4 address (where
// __fib_validate_source rejects what does not come back through it).
type RPFilter uint8

// The modes, numbered as the sysctl numbers them.
const (
	RPOff    RPFilter = 0
	RPStrict RPFilter = 1
	RPLoose  RPFilter = 2
)

// Interface is one network interface as the FIB and the program see it.
type Interface struct {
	Name  string
	Index int
	MAC   [6]byte
	// Addr is the interface's address and its connected subnet. The address is
	// local, the subnet's last address is its broadcast; anything else in the
	// subnet is a unicast next hop on this interface.
	Addr netip.Prefix
	// Addr6 is the interface's IPv6 address and connected prefix (invalid:
	// none). The address is local; anything else in the prefix is a unicast
	// next hop on this interface.
	Addr6 netip.Prefix
	// MTU is the interface's MTU, for IPv4 and IPv6 alike.
	MTU int
	// Forwarding is net.ipv4.conf.<iface>.forwarding: bpf_fib_lookup forwards
	// only what arrived on an interface with forwarding on, for the family of
	// the lookup.
	Forwarding bool
	// Forwarding6 is net.ipv6.conf.<iface>.forwarding (false also when the
	// interface has no IPv6, e.g. an MTU below 1280).
	Forwarding6 bool
	// Attached means in the program's redirect devmap.
	Attached bool
	// Neighbours are the resolved (valid) neighbour entries of the interface,
	// IPv4 and IPv6.
	Neighbours map[netip.Addr][6]byte
	// Down: the interface is administratively down. The kernel drops its
	// routes (connected ones and those through it) and its neighbours.
	Down bool
	// Caps is the program's dev_caps entry for the interface; nil: none (the
	// program assumes a native ingress, an egress that transmits no XDP
	// frame, and an MTU that no packet longer than MTUCheckAbove fits).
	Caps *DevCaps
}

// Route is an IPv4 route through a gateway: Dst via Via, whose connected
// interface is the egress.
type Route struct {
	Dst netip.Prefix
	Via netip.Addr
}

// Env is everything outside the packet that decides its fate: the program's
// load-time configuration and the host's interfaces and routes.
type Env struct {
	ListenerPorts              []uint16
	MinRelayPort, MaxRelayPort uint16 // inclusive
	Interfaces                 []Interface
	// Unreachable are routes of type unreachable (or blackhole, prohibit), IPv4
	// or IPv6: the FIB refuses to forward to them.
	Unreachable []netip.Prefix
	// Routes are IPv4 gateway routes; the longest prefix wins against them and
	// the connected routes.
	Routes []Route
	// Destinations are the destinations the listeners accept: the address and
	// port on the wire -> the listener socket the kernel delivers it to.
	Destinations map[netip.AddrPort]netip.AddrPort
	// RateLimit is every allocation's (the rate_limits map); zero: none.
	RateLimit channelmap.RateLimit
	// LoopbackForwarding is net.ipv4.conf.lo.forwarding: bpf_fib_lookup
	// makes the reverse-path lookup (an input from lo, rule 11) only with it
	// on (on a node with ip_forward=1 it is).
	LoopbackForwarding bool
	// Shield is the listener shield's switches (the shields map); the zero
	// value is off.
	Shield Shield
	// Allocations are the daemon's UDP allocations (alloc_flows),
	// NodeAllocations the node's other daemons' (node_flows): the shield
	// takes ChannelData from their clients to pion/turn.
	Allocations, NodeAllocations map[Allocation]bool
}

// Shield is what of the listener shield is on (rule 12).
type Shield struct {
	// Junk drops what pion/turn discards unanswered; Allocations also
	// ChannelData from clients without an allocation (only with Junk).
	Junk, Allocations bool
	// Admission is the unauthenticated requests' rate per source address
	// (rule 13; only with Junk).
	Admission Admission
}

// Admission is a rate of requests per source address: each costs Cost (ns;
// 0: no limit), and an address may run Burst (ns) ahead.
type Admission struct{ Cost, Burst uint64 }

// Allocation is a UDP allocation's 5-tuple: its client and the listener
// socket (the address it is bound to, as Env.Destinations names it).
type Allocation struct{ Listener, Client netip.AddrPort }

// RateBurst is how far ahead of its rates a binding may run.
const RateBurst = uint64(50 * time.Millisecond)

// RateState is what an allocation owes its rate limit: the monotonic instants (ns,
// the program's bpf_ktime_get_ns) by which its packets and its bytes are paid
// for. Zero: nothing.
type RateState struct{ PacketTAT, ByteTAT uint64 }

// Learned is a side effect of a client packet: the address and port it was
// sent to become the source of the binding's replies. The unspecified address
// means "not known": replies wait in userspace.
type Learned struct {
	Binding channelmap.Key
	Addr    netip.Addr
	Port    uint16
}

// Result is what the fast path does with one frame.
type Result struct {
	Verdict Verdict
	Reason  bpf.RelayReason
	// Frame is the frame that leaves: the input itself on Pass.
	Frame []byte
	// Learned is set when the frame changed a binding's listener address. It can
	// happen on Pass too: the packet was bound, only its next hop was missing.
	Learned *Learned
	// Counted is the binding whose per-binding counters count the frame (set
	// on TX and Redirect), with the application-data bytes it carried.
	Counted *channelmap.Key
	DataLen int
	// RedirectNeigh: the TC engine relayed it with bpf_redirect_neigh (an
	// egress whose Caps say NeedsRoute), counted as
	// TC_REASON_REDIRECT_NEIGH beside Reason.
	RedirectNeigh bool
}

// Model holds the bindings and the learned listener addresses.
type Model struct {
	env Env
	// client is indexed by what a client packet carries; peer by what a peer
	// packet carries. Both point at the same bindings.
	client map[channelmap.Key]*channelmap.Binding
	peer   map[peerKey]*channelmap.Binding
	order  []*channelmap.Binding
	rate   map[netip.AddrPort]RateState // by relayed transport address
	// admit is what each source address owes its admission (rule 13): the
	// instant by which its requests are paid for.
	admit map[netip.Addr]uint64
	// Now is the program's clock (CLOCK_MONOTONIC in ns) when it charges a
	// packet to a rate limit.
	Now func() uint64
	// skb is set while ProcessTC runs: the TC engine's skb.
	skb *SKB
}

// MonotonicNow is CLOCK_MONOTONIC in ns: bpf_ktime_get_ns's clock.
func MonotonicNow() uint64 {
	var ts unix.Timespec
	_ = unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts)
	return uint64(ts.Nano())
}

// RateState returns what the allocation relayed at relay owes its rate limit.
func (m *Model) RateState(relay netip.AddrPort) RateState { return m.rate[unmapPort(relay)] }

// SetRateState sets what the allocation relayed at relay owes, as a test sets
// the program's bucket.
func (m *Model) SetRateState(relay netip.AddrPort, s RateState) { m.rate[unmapPort(relay)] = s }

// AdmitState is what the source address owes its admission (rule 13): 0,
// nothing yet.
func (m *Model) AdmitState(a netip.Addr) uint64 { return m.admit[a] }

// SetAdmitState sets what the source address owes, as a test sets the
// program's entry.
func (m *Model) SetAdmitState(a netip.Addr, tat uint64) { m.admit[a] = tat }

// Charge is what userspace does with a datagram of dataLen bytes of
// application data that pion/turn would relay for the allocation relayed at
// relay (bpf/charge.c): it charges the allocation's bucket, the one its
// bindings' packets are charged to, or tells that it is over the limit (and
// charges nothing). Over the limit userspace drops it, whatever the limit's
// Pass says: pion/turn is the last to decide.
func (m *Model) Charge(relay netip.AddrPort, dataLen int) (over bool) {
	return m.overLimit(unmapPort(relay), dataLen)
}

// overLimit charges a packet with dataLen bytes of application data to the
// allocation relayed at k, or tells that it is over the limit (and charges
// nothing).
func (m *Model) overLimit(k netip.AddrPort, dataLen int) bool {
	rl := m.env.RateLimit
	if rl.Off() {
		return false
	}
	now := m.Now()
	st := m.rate[k]
	pkt, bytes := max(st.PacketTAT, now), max(st.ByteTAT, now)
	var pktCost, byteCost uint64
	if rl.PacketsPerSecond > 0 {
		pktCost = max(uint64(time.Second)/rl.PacketsPerSecond, 1)
		if pkt-now > RateBurst {
			return true
		}
	}
	if rl.BytesPerSecond > 0 {
		byteCost = uint64(dataLen) * uint64(time.Second) / rl.BytesPerSecond
		if bytes-now > RateBurst {
			return true
		}
	}
	m.rate[k] = RateState{PacketTAT: pkt + pktCost, ByteTAT: bytes + byteCost}
	return false
}

type peerKey struct{ peer, relay netip.AddrPort }

// New returns a model of the program loaded with env's configuration and the
// given bindings, whose ReplySource and ReplyPort are what the program has
// learned so far (invalid: nothing; port 0: the listener's). Bindings must be consistent, as pion/turn's are: one
// binding per (client, listener, channel) and one per (peer, relay); relays and
// peers IPv4, clients IPv4 or IPv6 with a reply source (when known) of the
// client's family.
func New(env Env, bindings []channelmap.Binding) (*Model, error) {
	m := &Model{env: env, client: map[channelmap.Key]*channelmap.Binding{}, peer: map[peerKey]*channelmap.Binding{},
		rate: map[netip.AddrPort]RateState{}, admit: map[netip.Addr]uint64{}, Now: MonotonicNow}
	for _, b := range bindings {
		b.Client = unmapPort(b.Client)
		b.Listener = unmapPort(b.Listener)
		b.Peer = unmapPort(b.Peer)
		b.Relay = unmapPort(b.Relay)
		b.Wire = unmapPort(b.Wire)
		if !b.Peer.Addr().Is4() || !b.Relay.Addr().Is4() || !b.OnWire().Addr().Is4() {
			return nil, fmt.Errorf("binding %v: relays and peers are IPv4 only", b)
		}
		b.ReplySource = b.ReplySource.Unmap()
		if from := b.ReplyFrom(); !from.IsValid() {
			b.ReplySource, b.ReplyPort = netip.IPv4Unspecified(), 0
		} else if b.ReplySource.Is6() != b.Client.Addr().Is6() {
			return nil, fmt.Errorf("binding %v: reply source %v is not of the client's family", b, b.ReplySource)
		} else {
			b.ReplyPort = from.Port()
		}
		// The relay as the peer sees it (translated when netfilter
		// source-NATs the flow): where the peer's datagrams go.
		pk := peerKey{b.Peer, b.OnWire()}
		if _, dup := m.client[b.Key()]; dup {
			return nil, fmt.Errorf("binding %v: client key bound twice", b)
		}
		if _, dup := m.peer[pk]; dup {
			return nil, fmt.Errorf("binding %v: peer and relay bound twice", b)
		}
		bp := &b
		m.client[b.Key()] = bp
		m.peer[pk] = bp
		m.order = append(m.order, bp)
	}
	return m, nil
}

// SetEnv replaces the host's tables (interfaces, neighbours, routes) as the
// kernel changed them. The program sees the change once the FIB generation
// moved (loader.WatchFIB): until then its cached next hops are the old ones.
func (m *Model) SetEnv(env Env) { m.env = env }

// Bindings returns the bindings in the order given to New, with their current
// reply sources (unspecified: not known).
func (m *Model) Bindings() []channelmap.Binding {
	out := make([]channelmap.Binding, len(m.order))
	for i, b := range m.order {
		out[i] = *b
	}
	return out
}

// Process is the fast path for one frame arriving on the interface with the
// given ifindex. It updates the learned listener addresses.
func (m *Model) Process(ingress int, frame []byte) Result {
	pass := func(r bpf.RelayReason) Result { return Result{Verdict: Pass, Reason: r, Frame: frame} }

	const ethLen, ipLen, ip6Len, udpLen = 14, 20, 40, 8
	if len(frame) < ethLen {
		return pass(bpf.RelayReasonREASON_NOT_IP)
	}
	var in datagram
	switch be16(frame[12:]) {
	case 0x0800:
		ip := frame[ethLen:]
		if len(ip) < ipLen || ip[0]>>4 != 4 || ip[0]&0x0f < 5 {
			return pass(bpf.RelayReasonREASON_MALFORMED_IP)
		}
		if ip[0]&0x0f > 5 {
			return pass(bpf.RelayReasonREASON_IP_OPTIONS)
		}
		if ip[9] != 17 {
			return pass(bpf.RelayReasonREASON_NOT_UDP)
		}
		if be16(ip[6:])&0x3fff != 0 { // MF or an offset: reassembly is the kernel's job
			return pass(bpf.RelayReasonREASON_IP_FRAGMENT)
		}
		totLen := int(be16(ip[2:]))
		if totLen < ipLen+udpLen || totLen > len(ip) {
			return pass(bpf.RelayReasonREASON_MALFORMED_IP)
		}
		ip = ip[:totLen] // what follows is an Ethernet trailer, not ours
		udp := ip[ipLen:]
		if int(be16(udp[4:])) != len(udp) {
			return pass(bpf.RelayReasonREASON_MALFORMED_UDP)
		}
		in = datagram{
			src: netip.AddrPortFrom(addr4(ip[12:]), be16(udp[0:])),
			dst: netip.AddrPortFrom(addr4(ip[16:]), be16(udp[2:])),
			ip:  ip, udp: udp, tos: ip[1], ttl: ip[8],
		}
	case 0x86DD:
		ip := frame[ethLen:]
		if len(ip) < ip6Len || ip[0]>>4 != 6 {
			return pass(bpf.RelayReasonREASON_MALFORMED_IP)
		}
		if ip[6] != 17 {
			if ipv6Extension(ip[6]) {
				return pass(bpf.RelayReasonREASON_IPV6EXTENSION) // not walked: pion/turn's
			}
			return pass(bpf.RelayReasonREASON_NOT_UDP)
		}
		plen := int(be16(ip[4:]))
		if plen < udpLen || ip6Len+plen > len(ip) {
			return pass(bpf.RelayReasonREASON_MALFORMED_IP)
		}
		ip = ip[:ip6Len+plen] // what follows is an Ethernet trailer
		udp := ip[ip6Len:]
		if int(be16(udp[4:])) != len(udp) {
			return pass(bpf.RelayReasonREASON_MALFORMED_UDP)
		}
		// Addresses as on the wire: an IPv4-mapped one stays 16 bytes, so an
		// IPv6 packet from ::ffff:a.b.c.d is not the IPv4 client a.b.c.d's
		// (such a source is not on the wire, RFC 4291 §2.5.5.2; Linux drops
		// it before pion/turn could see it), and no IPv4 binding learns from
		// it.
		in = datagram{
			src: netip.AddrPortFrom(netip.AddrFrom16([16]byte(ip[8:24])), be16(udp[0:])),
			dst: netip.AddrPortFrom(netip.AddrFrom16([16]byte(ip[24:40])), be16(udp[2:])),
			ip:  ip, udp: udp, v6: true, tos: uint8(be16(ip[0:]) >> 4), ttl: ip[7],
		}
	default:
		return pass(bpf.RelayReasonREASON_NOT_IP) // also VLAN tags
	}

	switch {
	case m.isListenerPort(in.dst.Port()):
		return m.fromClient(ingress, frame, in)
	case in.dst.Port() >= m.env.MinRelayPort && in.dst.Port() <= m.env.MaxRelayPort && m.env.MinRelayPort != 0:
		return m.fromPeer(ingress, frame, in)
	case m.isWirePort(in.dst.Port()):
		return m.fromClient(ingress, frame, in)
	case m.isNATRelayPort(in.dst.Port()):
		return m.fromPeer(ingress, frame, in)
	}
	return pass(bpf.RelayReasonREASON_NOT_OURS)
}

// ipv6Extension tells the IPv6 extension header types (IANA's list: hop-by-hop,
// routing, fragment, ESP, AH, destination options, mobility, HIP, shim6 and the
// two experimental ones) from upper-layer protocols.
func ipv6Extension(nh uint8) bool {
	switch nh {
	case 0, 43, 44, 50, 51, 60, 135, 139, 140, 253, 254:
		return true
	}
	return false
}

// datagram is a parsed input: its addresses, IP packet and UDP datagram, its
// family, its TOS (IPv4) or traffic class (IPv6) and its TTL or hop limit.
type datagram struct {
	src, dst netip.AddrPort
	ip, udp  []byte
	v6       bool
	tos, ttl uint8
}

// kernelTakes tells why the kernel would not take the datagram from the wire
// (0: it would): an IPv4 header whose checksum does not verify, an IPv6 UDP
// datagram without a checksum (RFC 8200 §8.1).
func (in datagram) kernelTakes() bpf.RelayReason {
	if !in.v6 && fold(sum(0, in.ip[:20])) != 0xffff {
		return bpf.RelayReasonREASON_BAD_IP_CHECKSUM
	}
	if in.v6 && be16(in.udp[6:]) == 0 {
		return bpf.RelayReasonREASON_NO_CHECKSUM
	}
	return 0
}

func (m *Model) isListenerPort(p uint16) bool {
	for _, l := range m.env.ListenerPorts {
		if l == p {
			return true
		}
	}
	return false
}

// isWirePort tells a port that some accepted destination carries in place of
// its listener's port (point 2).
func (m *Model) isWirePort(p uint16) bool {
	for d, l := range m.env.Destinations {
		if d.Port() == p && l.Port() != p {
			return true
		}
	}
	return false
}

// isNATRelayPort tells a port that some binding's translated relay has on
// the wire (point 3).
func (m *Model) isNATRelayPort(p uint16) bool {
	for _, b := range m.order {
		if b.Wire.IsValid() && b.Wire != b.Relay && b.Wire.Port() == p {
			return true
		}
	}
	return false
}

// fromClient handles UDP to a listener port (RFC 8656 §12.4, §12.5).
func (m *Model) fromClient(ingress int, frame []byte, in datagram) Result {
	pass := func(r bpf.RelayReason) Result { return Result{Verdict: Pass, Reason: r, Frame: frame} }
	if m.overIngressMTU(ingress, in) {
		return pass(bpf.RelayReasonREASON_INGRESS_OVER_MTU)
	}
	msg := in.udp[8:]
	if len(msg) < 4 {
		return m.shield(ingress, frame, in, bpf.RelayReasonREASON_MALFORMED_CHANNEL_DATA) // no room for a header
	}
	if msg[0]>>6 != 0b01 {
		return m.shield(ingress, frame, in, bpf.RelayReasonREASON_STUN) // 0b00 is STUN; 0b1x is nothing pion takes either
	}
	channel, n := be16(msg[0:]), int(be16(msg[2:]))
	if 4+n > len(msg) || len(msg)-4-n > MaxPadding {
		return m.shield(ingress, frame, in, bpf.RelayReasonREASON_MALFORMED_CHANNEL_DATA)
	}
	if n > MaxDataLen {
		return m.shield(ingress, frame, in, bpf.RelayReasonREASON_OVERSIZE)
	}
	// IPv4-mapped addresses are not on an IPv6 wire (RFC 4291 §2.5.5.2): the
	// kernel gives no socket a packet from one; and one sent to one is for no
	// IPv4 listener (the destination table's IPv4 keys are 4 bytes).
	if in.v6 && in.src.Addr().Is4In6() {
		return pass(bpf.RelayReasonREASON_NO_CHANNEL)
	}
	listener, ok := m.env.Destinations[in.dst]
	if !ok {
		return pass(bpf.RelayReasonREASON_NOT_LISTENER_ADDR)
	}
	key := channelmap.Key{Client: in.src, Listener: listener, Channel: channel}
	b, ok := m.client[key]
	if !ok {
		return m.shield(ingress, frame, in, bpf.RelayReasonREASON_NO_CHANNEL)
	}
	if r := in.kernelTakes(); r != 0 {
		return pass(r)
	}
	if in.ttl < MinTTL {
		return pass(bpf.RelayReasonREASON_TTL_EXPIRED)
	}

	if r := m.reversePath(ingress, in); r != 0 {
		return pass(r) // the stack drops it: it teaches nothing
	}
	res := Result{Verdict: Pass, Frame: frame}
	// Learned before the next hop is known: the packet is bound either way, and
	// a VIP (and NodePort) in front of us is what it was sent to.
	if d := in.dst; b.ReplySource != d.Addr() || b.ReplyPort != d.Port() {
		b.ReplySource, b.ReplyPort = d.Addr(), d.Port()
		res.Learned = &Learned{Binding: key, Addr: d.Addr(), Port: d.Port()}
	}
	data := msg[4 : 4+n]
	// From the relay as netfilter would have translated it (Binding.Wire).
	out := outPacket{src: b.OnWire(), dst: b.Peer, payload: data, dataLen: n}
	return m.send(ingress, in, out, res, key, b.Relay, bpf.RelayReasonREASON_RELAY_C2P_TX, bpf.RelayReasonREASON_RELAY_C2P_REDIRECT)
}

// shield is rule 12 for a datagram to a listener port that is not bound: r
// (Pass) unless pion/turn would discard it unanswered at a listener socket.
func (m *Model) shield(ingress int, frame []byte, in datagram, r bpf.RelayReason) Result {
	pass := Result{Verdict: Pass, Reason: r, Frame: frame}
	drop := func(r bpf.RelayReason) Result { return Result{Verdict: Drop, Reason: r, Frame: frame} }
	if !m.env.Shield.Junk || in.v6 && (in.src.Addr().Is4In6() || in.dst.Addr().Is4In6()) {
		return pass
	}
	if m.skb != nil {
		if i := m.iface(ingress); i == nil || i.Caps == nil || i.Caps.Native || i.Caps.Generic {
			return pass // XDP's shield passed it
		}
	}
	listener, ok := m.env.Destinations[in.dst]
	if !ok {
		return pass // the kernel's: forwarded, or another socket's
	}
	msg := in.udp[8:]
	a := Allocation{Listener: listener, Client: in.src}
	allocated := m.env.Allocations[a] || m.env.NodeAllocations[a]
	if len(msg) >= 4 && msg[0]>>6 == 0b01 && int(be16(msg[2:])) <= len(msg)-4 {
		if !m.env.Shield.Allocations || allocated {
			return pass
		}
		return drop(bpf.RelayReasonREASON_NO_ALLOCATION)
	}
	const stunHeader, magicCookie = 20, 0x2112A442
	if len(msg) < stunHeader || binary.BigEndian.Uint32(msg[4:]) != magicCookie || stunHeader+int(be16(msg[2:])) > len(msg) {
		return drop(bpf.RelayReasonREASON_NOT_TURN)
	}
	t := be16(msg)
	class := (t>>4)&1 | (t>>7)&2
	method := t&0xf | (t>>1)&0x70 | (t>>2)&0xf80
	switch {
	case class == 0 && (method == 0x001 || method == 0x003 || method == 0x004 || method == 0x008 || method == 0x009):
		// Binding, Allocate, Refresh, CreatePermission, ChannelBind requests
		if ad := m.env.Shield.Admission; ad.Cost != 0 && !allocated {
			now := m.Now()
			tat := max(m.admit[in.src.Addr()], now)
			if tat-now > ad.Burst {
				return drop(bpf.RelayReasonREASON_ADMISSION)
			}
			m.admit[in.src.Addr()] = tat + ad.Cost
		}
		return pass
	case class == 1 && method == 0x006:
		return pass // a Send indication
	}
	return drop(bpf.RelayReasonREASON_STUN_UNHANDLED)
}

// fromPeer handles UDP to a relay port: a peer's datagram becomes ChannelData.
func (m *Model) fromPeer(ingress int, frame []byte, in datagram) Result {
	pass := func(r bpf.RelayReason) Result { return Result{Verdict: Pass, Reason: r, Frame: frame} }
	if m.overIngressMTU(ingress, in) {
		return pass(bpf.RelayReasonREASON_INGRESS_OVER_MTU)
	}
	b, ok := m.peer[peerKey{in.src, in.dst}]
	if !ok {
		return pass(bpf.RelayReasonREASON_NO_PEER_BINDING)
	}
	if b.ReplySource.IsUnspecified() {
		return pass(bpf.RelayReasonREASON_CLIENT_ADDR_UNKNOWN)
	}
	if r := in.kernelTakes(); r != 0 {
		return pass(r)
	}
	if b.Client.Addr().Is6() && be16(in.udp[6:]) == 0 {
		// IPv6 requires a checksum; pion/turn sums it.
		return pass(bpf.RelayReasonREASON_NO_CHECKSUM)
	}
	data := in.udp[8:]
	if len(data) > MaxDataLen {
		return pass(bpf.RelayReasonREASON_OVERSIZE)
	}
	if in.ttl < MinTTL {
		return pass(bpf.RelayReasonREASON_TTL_EXPIRED)
	}
	if r := m.reversePath(ingress, in); r != 0 {
		return pass(r)
	}
	msg := make([]byte, 4+len(data))
	binary.BigEndian.PutUint16(msg[0:], b.Channel)
	binary.BigEndian.PutUint16(msg[2:], uint16(len(data)))
	copy(msg[4:], data)
	out := outPacket{src: netip.AddrPortFrom(b.ReplySource, b.ReplyPort), dst: b.Client, payload: msg, dataLen: len(data)}
	return m.send(ingress, in, out, Result{Verdict: Pass, Frame: frame}, b.Key(), b.Relay,
		bpf.RelayReasonREASON_RELAY_P2C_TX, bpf.RelayReasonREASON_RELAY_P2C_REDIRECT)
}

// overIngressMTU tells a packet longer than its ingress interface's MTU, as far
// as the program measures (point 9).
func (m *Model) overIngressMTU(ingress int, in datagram) bool {
	// The TC engine does not measure: on the skb path a datagram above its
	// ingress MTU is a GSO skb, passed before anything else (ProcessTC), and
	// the devices refuse longer frames before TC.
	if m.skb != nil || len(in.ip) <= MTUCheckAbove {
		return false
	}
	ifc := m.iface(ingress)
	return ifc == nil || ifc.Caps == nil || len(in.ip) > ifc.Caps.MTU
}

// xmitRefused tells whether a frame sent out of egress from ingress would be
// dropped after the program returned (point 8).
func (m *Model) xmitRefused(ingress int, egress *Interface) bool {
	in := m.iface(ingress)
	var inCaps *DevCaps
	if in != nil {
		inCaps = in.Caps
	}
	if inCaps != nil && inCaps.Generic {
		return false // the skb path
	}
	if egress.Index == ingress {
		return inCaps == nil || !inCaps.XDPTX
	}
	return egress.Caps == nil || !egress.Caps.XDPXmit
}

// outPacket is what the relay sends: addresses and the UDP payload, of which
// dataLen bytes are application data.
type outPacket struct {
	src, dst netip.AddrPort
	payload  []byte
	dataLen  int
}

// send finds the next hop of out and builds its frame, or passes the original.
// The output is IPv6 when its destination (the client) is, else IPv4.
func (m *Model) send(ingress int, in datagram, out outPacket, res Result, key channelmap.Key, relay netip.AddrPort, txReason, redirectReason bpf.RelayReason) Result {
	var (
		hop    *nextHop
		reason bpf.RelayReason
	)
	if out.dst.Addr().Is6() {
		// The whole IPv6 packet against the MTU.
		hop, reason = m.fib6(ingress, out.src.Addr(), out.dst.Addr(), 40+8+len(out.payload))
	} else {
		hop, reason = m.fib(ingress, out.dst.Addr(), 20+8+len(out.payload))
	}
	if hop == nil {
		res.Reason = reason
		return res
	}
	if m.skb != nil && m.skb.Checksum == ChecksumPartial && !m.skb.CsumAtUDP {
		res.Reason = bpf.RelayReason(bpf.RelayTcTcReasonTC_REASON_PARTIAL_ELSEWHERE)
		return res
	}
	if m.skb != nil && m.skb.L3 && in.v6 != out.dst.Addr().Is6() {
		res.Reason = bpf.RelayReason(bpf.RelayTcTcReasonTC_REASON_L3FAMILY)
		return res
	}
	if m.overLimit(relay, out.dataLen) {
		res.Reason = bpf.RelayReasonREASON_RATE_LIMITED
		if !m.env.RateLimit.Pass {
			res.Verdict = Drop
		}
		return res
	}
	res.Verdict, res.Reason = Redirect, redirectReason
	if hop.egress.Index == ingress {
		res.Verdict, res.Reason = TX, txReason
	}
	res.Frame = m.build(in, out, hop)
	res.RedirectNeigh = m.skb != nil && hop.egress.Caps != nil && hop.egress.Caps.NeedsRoute
	res.Counted = &key
	res.DataLen = out.dataLen
	return res
}

// nextHop is a successful FIB answer.
type nextHop struct {
	egress *Interface
	dmac   [6]byte
}

// fib answers as bpf_fib_lookup (AF_INET) does for a packet forwarded from the
// ingress interface, in its order (forwarding, route, MTU, neighbour), and then
// applies the program's own rule that a redirect needs an attached egress
// interface. It returns the PASS reason when there is no usable next hop.
func (m *Model) fib(ingress int, dst netip.Addr, totLen int) (*nextHop, bpf.RelayReason) {
	in := m.iface(ingress)
	if in == nil || !in.Forwarding {
		return nil, bpf.RelayReasonREASON_FIB_FWD_DISABLED
	}
	r := m.route4(dst)
	if r.local {
		// Local and broadcast routes: nothing to forward to.
		return nil, bpf.RelayReasonREASON_FIB_NOT_FORWARDED
	}
	return m.finish(ingress, dst, r.hop, totLen, r.egress, r.bits)
}

// route4 is the IPv4 route the FIB gives for dst: local (one of the
// interfaces' addresses or a subnet's broadcast), or through egress (nil: no
// route but perhaps an unreachable one, which finish and unreachable4 see)
// of bits bits to the next hop hop (dst itself on a connected route).
type route4 struct {
	local  bool
	egress *Interface
	bits   int
	hop    netip.Addr
}

func (m *Model) route4(dst netip.Addr) route4 {
	var egress *Interface
	for i := range m.env.Interfaces {
		ifc := &m.env.Interfaces[i]
		if !ifc.Addr.IsValid() || ifc.Down {
			continue
		}
		p := ifc.Addr.Masked()
		if dst == ifc.Addr.Addr() || dst == lastAddr(p) {
			return route4{local: true}
		}
		if p.Contains(dst) {
			egress = ifc
		}
	}
	bits := 0
	if egress != nil {
		bits = egress.Addr.Bits()
	}
	hop := dst
	for _, r := range m.env.Routes {
		if !r.Dst.Contains(dst) || (egress != nil && r.Dst.Bits() <= bits) {
			continue
		}
		// The gateway's connected interface (a dead route when none is up).
		var via *Interface
		for i := range m.env.Interfaces {
			ifc := &m.env.Interfaces[i]
			if ifc.Addr.IsValid() && !ifc.Down && ifc.Addr.Masked().Contains(r.Via) {
				via = ifc
			}
		}
		if via != nil {
			egress, bits, hop = via, r.Dst.Bits(), r.Via
		}
	}
	return route4{egress: egress, bits: bits, hop: hop}
}

// unreachable tells a route of type unreachable (or blackhole, prohibit)
// more specific than the route r found for dst, or no route at all.
func (m *Model) unreachable(dst netip.Addr, r route4) bool {
	for _, u := range m.env.Unreachable {
		if u.Contains(dst) && (r.egress == nil || u.Bits() > r.bits) {
			return true
		}
	}
	return r.egress == nil
}

// reversePath is the stack's reverse-path filter for a packet that would be
// relayed (rule 11): 0 when the stack would take it, else the reason to pass.
// Neighbours and MTUs do not matter: bpf_fib_lookup names the egress before
// it looks for a neighbour, and the lookup has no length.
func (m *Model) reversePath(ingress int, in datagram) bpf.RelayReason {
	ifc := m.iface(ingress)
	if in.v6 || ifc == nil || ifc.Caps == nil || ifc.Caps.RPFilter == RPOff {
		return 0
	}
	if !m.env.LoopbackForwarding {
		return bpf.RelayReasonREASON_RP_UNCHECKED
	}
	src := in.src.Addr()
	r := m.route4(src)
	if r.local || m.unreachable(src, r) {
		return bpf.RelayReasonREASON_RP_FILTER
	}
	if ifc.Caps.RPFilter == RPStrict && r.egress.Index != ingress {
		return bpf.RelayReasonREASON_RP_FILTER
	}
	return 0
}

// fib6 is fib for an IPv6 destination (AF_INET6): IPv6 forwarding on the
// ingress, local addresses, connected prefixes and unreachable routes. Before
// all of them, bpf_ipv6_fib_lookup never forwards to or from a multicast,
// link-local or loopback address (rt6_need_strict), whatever the forwarding
// setting.
func (m *Model) fib6(ingress int, src, dst netip.Addr, totLen int) (*nextHop, bpf.RelayReason) {
	if strict6(src) || strict6(dst) {
		return nil, bpf.RelayReasonREASON_FIB_NOT_FORWARDED
	}
	in := m.iface(ingress)
	if in == nil || !in.Forwarding6 {
		return nil, bpf.RelayReasonREASON_FIB_FWD_DISABLED
	}
	var egress *Interface
	bits := -1
	for i := range m.env.Interfaces {
		ifc := &m.env.Interfaces[i]
		if !ifc.Addr6.IsValid() || ifc.Down {
			continue
		}
		if dst == ifc.Addr6.Addr() {
			return nil, bpf.RelayReasonREASON_FIB_NOT_FORWARDED // local
		}
		if ifc.Addr6.Masked().Contains(dst) && ifc.Addr6.Bits() > bits {
			egress, bits = ifc, ifc.Addr6.Bits()
		}
	}
	return m.finish(ingress, dst, dst, totLen, egress, bits)
}

// strict6 is the kernel's rt6_need_strict: multicast (ff00::/8), link-local
// unicast (fe80::/10) or loopback (::1); an IPv4-mapped address is none of them.
func strict6(a netip.Addr) bool {
	if a.Is4In6() || a.Is4() {
		return false
	}
	b := a.As16()
	return b[0] == 0xff || (b[0] == 0xfe && b[1]&0xc0 == 0x80) || a == netip.IPv6Loopback()
}

// finish is the common tail of a lookup for dst that found a route of bits
// bits through egress (nil: no route) to the next hop hop (dst itself on a
// connected route, else the gateway).
func (m *Model) finish(ingress int, dst, hop netip.Addr, totLen int, egress *Interface, bits int) (*nextHop, bpf.RelayReason) {
	for _, u := range m.env.Unreachable {
		if u.Contains(dst) && (egress == nil || u.Bits() > bits) {
			return nil, bpf.RelayReasonREASON_FIB_NOT_FORWARDED
		}
	}
	if egress == nil {
		return nil, bpf.RelayReasonREASON_FIB_NOT_FORWARDED // no route
	}
	if totLen > egress.MTU {
		return nil, bpf.RelayReasonREASON_FIB_FRAG_NEEDED
	}
	mac, ok := egress.Neighbours[hop]
	if !ok {
		return nil, bpf.RelayReasonREASON_FIB_NO_NEIGH
	}
	if egress.Index != ingress && !egress.Attached && m.skb == nil { // TC reaches any egress
		return nil, bpf.RelayReasonREASON_EGRESS_NOT_ATTACHED
	}
	if m.skb == nil && m.xmitRefused(ingress, egress) { // the skb path transmits anywhere
		return nil, bpf.RelayReasonREASON_EGRESS_NO_XDP_XMIT
	}
	return &nextHop{egress: egress, dmac: mac}, 0
}

func (m *Model) iface(index int) *Interface {
	for i := range m.env.Interfaces {
		if m.env.Interfaces[i].Index == index {
			return &m.env.Interfaces[i]
		}
	}
	return nil
}

// build serializes the relayed frame.
func (m *Model) build(in datagram, out outPacket, hop *nextHop) []byte {
	if out.dst.Addr().Is6() {
		return m.build6(in, out, hop)
	}
	udpLen := 8 + len(out.payload)
	totLen := 20 + udpLen
	f := make([]byte, 14+totLen)
	copy(f[0:6], hop.dmac[:])
	copy(f[6:12], hop.egress.MAC[:])
	binary.BigEndian.PutUint16(f[12:], 0x0800)

	ip := f[14:]
	ip[0] = 0x45
	ip[1] = in.tos // TOS: the client's or peer's DSCP/ECN travel on
	binary.BigEndian.PutUint16(ip[2:], uint16(totLen))
	if in.v6 {
		// ID 0 and DF, as a Linux UDP socket with path MTU discovery sends.
		binary.BigEndian.PutUint16(ip[6:], 0x4000)
	} else {
		copy(ip[4:8], in.ip[4:8]) // ID, flags (DF) and a zero fragment offset
	}
	ip[8] = in.ttl - 1
	ip[9] = 17
	src4, dst4 := out.src.Addr().As4(), out.dst.Addr().As4()
	copy(ip[12:16], src4[:])
	copy(ip[16:20], dst4[:])
	binary.BigEndian.PutUint16(ip[10:], ^fold(sum(0, ip[:20])))

	udp := ip[20:]
	binary.BigEndian.PutUint16(udp[0:], out.src.Port())
	binary.BigEndian.PutUint16(udp[2:], out.dst.Port())
	binary.BigEndian.PutUint16(udp[4:], uint16(udpLen))
	copy(udp[8:], out.payload)
	binary.BigEndian.PutUint16(udp[6:], m.udpChecksum(in, pseudo(ip[12:16], ip[16:20], len(udp)), udp))
	return f
}

// build6 serializes a relayed IPv6 frame (to an IPv6 client).
func (m *Model) build6(in datagram, out outPacket, hop *nextHop) []byte {
	udpLen := 8 + len(out.payload)
	f := make([]byte, 14+40+udpLen)
	copy(f[0:6], hop.dmac[:])
	copy(f[6:12], hop.egress.MAC[:])
	binary.BigEndian.PutUint16(f[12:], 0x86DD)

	ip := f[14:]
	// Version 6, the traffic class from the TOS, flow label 0.
	binary.BigEndian.PutUint32(ip[0:], 6<<28|uint32(in.tos)<<20)
	binary.BigEndian.PutUint16(ip[4:], uint16(udpLen))
	ip[6] = 17
	ip[7] = in.ttl - 1 // the hop limit
	src, dst := out.src.Addr().As16(), out.dst.Addr().As16()
	copy(ip[8:24], src[:])
	copy(ip[24:40], dst[:])

	udp := ip[40:]
	binary.BigEndian.PutUint16(udp[0:], out.src.Port())
	binary.BigEndian.PutUint16(udp[2:], out.dst.Port())
	binary.BigEndian.PutUint16(udp[4:], uint16(udpLen))
	copy(udp[8:], out.payload)
	binary.BigEndian.PutUint16(udp[6:], m.udpChecksum(in, pseudo(ip[8:24], ip[24:40], len(udp)), udp))
	return f
}

// udpChecksum is the checksum of the relayed datagram udp, whose pseudo header
// sums to outPseudo. An absent input checksum stays absent (legal on IPv4, RFC
// 768; an IPv6 output never gets here without one). An input checksum equal to
// the folded pseudo-header sum is a CHECKSUM_PARTIAL one (the sender left the
// rest to its NIC, which a veth does not have): the output gets a full one.
// Otherwise the output's checksum is off by exactly what the input's was: with
// E the ones' complement sum of the input datagram, pseudo header and checksum
// field included (0xffff when it verifies), the output's checksum c makes its
// sum E too. The TC engine knows the skb's ip_summed instead of guessing it:
// a CHECKSUM_PARTIAL skb leaves with the output's pseudo-header sum (its egress
// finishes it), any other with the carried-over checksum.
func (m *Model) udpChecksum(in datagram, outPseudo uint32, udp []byte) uint16 {
	field := be16(in.udp[6:])
	if m.skb != nil && m.skb.Checksum == ChecksumPartial {
		return fold(outPseudo)
	}
	if field == 0 {
		return 0
	}
	var inPseudo uint32
	if in.v6 {
		inPseudo = pseudo(in.ip[8:24], in.ip[24:40], len(in.udp))
	} else {
		inPseudo = pseudo(in.ip[12:16], in.ip[16:20], len(in.udp))
	}
	outSum := fold(sum(outPseudo, udp)) // its checksum field is still zero
	var c uint16
	if field == fold(inPseudo) && m.skb == nil {
		c = ^outSum
	} else {
		inSum := fold(sum(inPseudo, in.udp))
		c = fold(uint32(inSum) + uint32(^outSum))
	}
	if c == 0 {
		c = 0xffff // RFC 768: a computed zero is sent as all ones
	}
	return c
}

// pseudo is the unfolded sum of a UDP pseudo header: the source and
// destination addresses (4 or 16 bytes), the protocol and the UDP length (RFC
// 768, RFC 8200 §8.1: the same sum for both families).
func pseudo(src, dst []byte, udpLen int) uint32 {
	return sum(sum(0, src), dst) + 17 + uint32(udpLen)
}

// sum adds b to s as big-endian 16-bit words (RFC 1071), an odd last byte
// padded with zero.
func sum(s uint32, b []byte) uint32 {
	for i := 0; i+1 < len(b); i += 2 {
		s += uint32(be16(b[i:]))
	}
	if len(b)%2 == 1 {
		s += uint32(b[len(b)-1]) << 8
	}
	return s
}

// fold adds the carries back in (ones' complement addition).
func fold(s uint32) uint16 {
	for s > 0xffff {
		s = s&0xffff + s>>16
	}
	return uint16(s)
}

func be16(b []byte) uint16 { return binary.BigEndian.Uint16(b) }

func addr4(b []byte) netip.Addr { return netip.AddrFrom4([4]byte(b[:4])) }

func unmapPort(a netip.AddrPort) netip.AddrPort {
	return netip.AddrPortFrom(a.Addr().Unmap(), a.Port())
}

func lastAddr(p netip.Prefix) netip.Addr {
	a := p.Addr().As4()
	host := uint32(1)<<(32-p.Bits()) - 1
	v := binary.BigEndian.Uint32(a[:]) | host
	binary.BigEndian.PutUint32(a[:], v)
	return netip.AddrFrom4(a)
}
