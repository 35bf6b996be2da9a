// Package channelmap is the typed Go view of the XDP program's binding maps and
// the only code that writes them. Every write goes to the kernel first; the Go
// side records a binding only after its map update succeeded, and a failed
// update of one direction is rolled back in the other.
package channelmap

import (
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/l7mp/stunnerd-xdp/bpf"
	"github.com/l7mp/stunnerd-xdp/internal/byteorder"
)

// Binding is one TURN channel binding as the fast path sees it: ChannelData from
// Client to an address the Listener accepts (see SetDestinations) with Channel
// goes Relay -> Peer, and Peer's datagrams to Relay go to Client with Channel,
// from the address the client's packets arrived at.
type Binding struct {
	Client netip.AddrPort
	// Listener is the listener socket's local address as pion/turn reports
	// it: specific (10.0.0.1:3478) or a wildcard (0.0.0.0:3478, [::]:3478).
	Listener netip.AddrPort
	Channel  uint16
	Peer     netip.AddrPort
	// Relay is pion/turn's relay socket: the allocation (its rate limit and
	// accounting go by it).
	Relay netip.AddrPort
	// Wire is the relay's address and port as the peer sees them, when the
	// node's netfilter source-NATs the relay<->peer flow (a masquerade, see
	// natcheck.Translated): client->peer packets leave from Wire, and the
	// peer's packets to Wire are the binding's. Zero (or Relay): not
	// translated.
	Wire netip.AddrPort
	// ReplySource is the source of packets to the client: the address the
	// client's packets arrived at on the wire (a VIP in front of the node, the
	// local address a wildcard listener was reached at). The program learns it
	// from the client's accepted ChannelData; until then replies go through
	// userspace. Only Dump fills it in: Upsert never seeds or overwrites it,
	// because a DNAT that userspace cannot see may stand in between.
	ReplySource netip.Addr
	// ReplyPort is ReplySource's port, learned with it: the port the
	// client's packets arrived at on the wire, the listener's own or the one
	// a DNAT translated to it (a NodePort). Dump and Live fill it in; 0 with
	// a valid ReplySource stands for the listener's port (see ReplyFrom).
	ReplyPort uint16
}

// ReplyFrom is the source of packets to the client, address and port (see
// ReplySource, ReplyPort); invalid while the program has not learned it.
func (b Binding) ReplyFrom() netip.AddrPort {
	if !b.ReplySource.IsValid() || b.ReplySource.IsUnspecified() {
		return netip.AddrPort{}
	}
	port := b.ReplyPort
	if port == 0 {
		port = b.Listener.Port()
	}
	return netip.AddrPortFrom(b.ReplySource, port)
}

// Key identifies a binding: one client's channel on one listener.
type Key struct {
	Client   netip.AddrPort
	Listener netip.AddrPort
	Channel  uint16
}

// Key returns the binding's identity.
func (b Binding) Key() Key {
	return Key{Client: b.Client, Listener: b.Listener, Channel: b.Channel}
}

// OnWire is the relay's address and port on the wire: Wire when set, else Relay.
func (b Binding) OnWire() netip.AddrPort {
	if b.Wire.IsValid() {
		return b.Wire
	}
	return b.Relay
}

func (b Binding) String() string {
	relay := b.Relay.String()
	if b.Wire.IsValid() && b.Wire != b.Relay {
		relay += " (on the wire " + b.Wire.String() + ")"
	}
	return fmt.Sprintf("%s ch=%#x listener=%s <-> relay=%s peer=%s", b.Client, b.Channel, b.Listener, relay, b.Peer)
}

// Stats are the packets and application-data bytes the XDP program relayed.
type Stats struct {
	ClientToPeerPackets, ClientToPeerBytes uint64
	PeerToClientPackets, PeerToClientBytes uint64
}

func (s *Stats) add(o Stats) {
	s.ClientToPeerPackets += o.ClientToPeerPackets
	s.ClientToPeerBytes += o.ClientToPeerBytes
	s.PeerToClientPackets += o.PeerToClientPackets
	s.PeerToClientBytes += o.PeerToClientBytes
}

// since is what a slot counted from base (its value at an earlier read) to s.
func (s Stats) since(base Stats) Stats {
	sub := func(a, b uint64) uint64 {
		if a < b {
			return 0 // the slot only grows while its binding lives
		}
		return a - b
	}
	return Stats{sub(s.ClientToPeerPackets, base.ClientToPeerPackets), sub(s.ClientToPeerBytes, base.ClientToPeerBytes),
		sub(s.PeerToClientPackets, base.PeerToClientPackets), sub(s.PeerToClientBytes, base.PeerToClientBytes)}
}

// ErrFull is returned when every binding slot is in use (see --max-bindings),
// or the destination table is full.
var ErrFull = errors.New("binding maps are full")

// idQuarantine is how long a freed binding id rests before reuse: a packet the
// program is relaying while its binding is deleted still counts into the slot
// it looked up, and must not count into a new owner's. XDP runs to completion
// in microseconds; this is generous.
const idQuarantine = 100 * time.Millisecond

// bindingMap is what Maps uses of the two binding maps: *ebpf.Map, or a test's
// wrapper that makes a write fail.
type bindingMap interface {
	Put(key, value any) error
	Delete(key any) error
	Lookup(key, valueOut any) error
	Iterate() *ebpf.MapIterator
}

// Maps writes bindings into the program's maps.
type Maps struct {
	c2p, p2c       bindingMap
	verdicts, dsts *ebpf.Map
	// fibGen is the program's FIB generation; its owner's (SetFibGen)
	// once the program is loaded, so that all its writers share one lock.
	fibGen *bpf.FibGen
	// wirePorts is the program's bitmap of the destination ports a DNAT
	// translates to a listener's (see SetDestinations); wireBits what it
	// holds.
	wirePorts *ebpf.Map
	wireBits  [wirePortWords]uint64
	// states are the per-binding slots: learned reply source, cached next
	// hops and the binding's counters.
	states *ebpf.Map
	// rateLimits holds the one rate limit of every allocation; allocRates
	// the allocations' buckets, by alloc id.
	rateLimits, allocRates *ebpf.Map
	// charge is the charge program over them (charge.go).
	charge atomic.Pointer[ebpf.Program]

	mu       sync.Mutex
	bindings map[Key]entry
	freed    []freedID // FIFO: the oldest freed id is reused first
	nextID   uint32
	maxID    uint32
	retired  Stats // counters of bindings already removed, so totals only grow
	// account names what a binding's traffic counts under (see SetAccount);
	// byAccount holds the counters of removed bindings by account.
	account   func(Binding) string
	byAccount map[string]Stats
	gen       uint64 // numbers the entries, so a reader outside mu tells a replaced one
	// slotGen numbers the installs into state slots: the program's flow
	// caches hold a binding for as long as its slot keeps the generation
	// (never 0: a slot taken back has 0).
	slotGen uint32
	// invalidPending: a bump of the FIB generation failed; every later
	// write tries it again first, since cached flows and next hops may
	// stand for what the maps no longer say.
	invalidPending bool
	// The program's flow caches stand aside while more bindings are
	// installed than flowsAsideAbove (see gateFlows); flowsAside is what
	// the program was last told (through fibGen).
	flowSlots  int // entries of one CPU's region of a flow cache
	flowsAside bool
	// Listener ids: the program keys bindings by the listener's id, which the
	// destination table maps each accepted address:port to.
	listenerIDs  map[netip.AddrPort]uint32
	listenerAddr map[uint32]netip.AddrPort
	dstTable     map[bpf.RelayDstKey]bpf.RelayDstVal // what the kernel's destination map holds
	shields      *ebpf.Map
	// Allocation ids, by relayed transport address: every binding of one
	// allocation charges the same rate-limit bucket. Counted references.
	allocs    map[netip.AddrPort]*allocRef
	allocFree []uint32
	nextAlloc uint32
	now       func() time.Time
	// natPorts is the program's nat_relay_ports bitmap, natRefs how many
	// installed bindings have a translated relay (Binding.Wire) on each port.
	natPorts *ebpf.Map
	natRefs  map[uint16]int
}

// allocRef is an allocation's id and how many installed bindings hold it.
type allocRef struct {
	id   uint32
	refs int
	held bool // one of refs is its relay socket's (HoldAlloc)
}

type entry struct {
	binding Binding
	id      uint32
	// base is the slot's counters when they were last folded into the totals
	// (an account change): what the binding counts now is the slot less base.
	// The program owns the slot; userspace only reads it while it is live.
	base    Stats
	allocID uint32
	gen     uint64
	slotGen uint32 // the slot's generation (see Maps.slotGen)
	account string
	// seen is the slot's packets (both ways) at the last GateFlows.
	seen uint64
}

type freedID struct {
	id uint32
	at time.Time
	// account is the slot's last owner's: packets in flight at its removal
	// still count into the slot, and are its.
	account string
}

// New wraps the loaded maps.
func New(m *bpf.RelayMaps) *Maps {
	return &Maps{
		c2p:          m.C2pBindings,
		p2c:          m.P2cBindings,
		verdicts:     m.Verdicts,
		dsts:         m.ListenerDsts,
		wirePorts:    m.WirePorts,
		states:       m.BindingStates,
		fibGen:       bpf.NewFibGen(m.FibGen),
		flowSlots:    flowRegion(m.C2pFlows),
		rateLimits:   m.RateLimits,
		allocRates:   m.AllocRates,
		allocs:       make(map[netip.AddrPort]*allocRef),
		bindings:     make(map[Key]entry),
		maxID:        m.BindingStates.MaxEntries(),
		listenerIDs:  make(map[netip.AddrPort]uint32),
		listenerAddr: make(map[uint32]netip.AddrPort),
		dstTable:     make(map[bpf.RelayDstKey]bpf.RelayDstVal),
		shields:      m.Shields,
		now:          time.Now,
		natPorts:     m.NatRelayPorts,
		natRefs:      make(map[uint16]int),
	}
}

// flowRegion is the entries of one CPU's region of flows, a flow cache: the
// loader gives every possible CPU a region of the same size.
func flowRegion(flows *ebpf.Map) int {
	cpus, err := ebpf.PossibleCPU()
	if flows == nil || err != nil || cpus < 1 {
		return 0
	}
	return int(flows.MaxEntries()) / cpus
}

// The flow caches are direct-mapped and a CPU's region sees every flow that
// arrives on it (a veth delivers on the sender's CPU, so a pod's flows reach
// every CPU's region; RSS on a multi-queue NIC would spread them, so there the
// mark is conservative). With n bindings sending in turn through a region of
// s entries, a flow finds its own entry only while no other flow shares it,
// about e^(-n/s) of them; every other packet reads an entry of another flow
// and refills it, which costs more than the hash lookups alone. Measured with
// the sessions stage of make bench and 4,096 entries (program ns per packet
// with the caches / without): 0.81x at 2,000 bindings, 1.07x at 3,000, 1.25x
// at 10,000. So the caches stand aside while more bindings than
// flowsAsideAbove eighths of a region send, and are used again below
// flowsUseBelow eighths (apart, so that a count around one mark does not flip
// them every time). Bindings that do not send cost the caches nothing: a
// binding lives on for minutes after its client left (pion/turn's channel
// lifetime), and one flow among thousands of idle bindings is one flow.
const (
	flowsAsideAbove = 5 // eighths of a region: 2,560 of 4,096
	flowsUseBelow   = 4
)

// GateFlows sets the program's flow caches aside, or uses them again, for
// the number of bindings that relayed a packet in the kernel since the last
// call (their slots' counters moved). Called periodically (mirror.Mirror's
// reconcile loop, every mirror.FlowGateInterval). While fewer bindings are
// installed than the mark, no counter needs reading (a binding first read
// after that counts as sending once).
func (m *Maps) GateFlows() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.flowSlots == 0 {
		return nil
	}
	n := len(m.bindings)
	if !m.flowsAside && n*8 <= flowsAsideAbove*m.flowSlots || m.flowsAside && n*8 < flowsUseBelow*m.flowSlots {
		return m.setFlowsAside(false)
	}
	// The slots are read outside the lock (an Upsert meanwhile does not
	// wait for thousands of reads); a binding replaced or removed meanwhile
	// is not counted, one installed meanwhile counts at the next call.
	m.mu.Unlock()
	snap, slots, errs := m.snapshotSlots()
	m.mu.Lock()
	if err := errors.Join(errs...); err != nil {
		return err // undecided: a count that misses bindings is no count
	}
	active := 0
	for i, e := range snap {
		s := slots[i].Stats
		if p := s.C2pPackets + s.P2cPackets; p != e.seen {
			active++
			k := e.binding.Key()
			if cur, ok := m.bindings[k]; ok && cur.gen == e.gen {
				cur.seen = p
				m.bindings[k] = cur
			}
		}
	}
	aside := m.flowsAside
	switch {
	case !aside && active*8 > flowsAsideAbove*m.flowSlots:
		aside = true
	case aside && active*8 < flowsUseBelow*m.flowSlots:
		aside = false
	}
	return m.setFlowsAside(aside)
}

// setFlowsAside tells the program (called with mu held).
func (m *Maps) setFlowsAside(aside bool) error {
	if aside == m.flowsAside {
		return nil
	}
	if err := m.fibGen.SetFlowsAside(aside); err != nil {
		return err
	}
	m.flowsAside = aside
	return nil
}

// FlowsAside tells whether the program's flow caches are set aside for the
// number of bindings installed (see gateFlows).
func (m *Maps) FlowsAside() bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.flowsAside
}

// wirePortWords is the size of the wire_ports bitmap: a bit per port.
const wirePortWords = 65536 / 64

// learned is the reply source a binding's state slot holds (invalid, 0:
// nothing learned yet).
func learned(st *bpf.RelayBindingState) (netip.Addr, uint16) {
	if st.ListenerAddr.B == [16]uint8{} {
		return netip.Addr{}, 0
	}
	return fromAddr16(st.ListenerAddr.B), byteorder.Htons(st.ListenerPort)
}

// natPortRef counts (delta +1) or stops counting (-1) b's translated relay
// port, and sets or clears its bit in the program's nat_relay_ports on the
// first reference and after the last: the program takes UDP to a port outside
// the relay range as a peer's only while its bit is set. Untranslated
// bindings have nothing to count. Called with mu held.
func (m *Maps) natPortRef(b Binding, delta int) error {
	if !b.Wire.IsValid() || b.Wire == b.Relay {
		return nil
	}
	p := b.Wire.Port()
	before := m.natRefs[p]
	after := max(before+delta, 0)
	if after == 0 {
		delete(m.natRefs, p)
	} else {
		m.natRefs[p] = after
	}
	if (before == 0) == (after == 0) || m.natPorts == nil {
		return nil
	}
	word := uint32(p / 64)
	var bits uint64
	if err := m.natPorts.Lookup(word, &bits); err != nil {
		m.natRefs[p] = before
		return fmt.Errorf("nat relay port %d: %w", p, err)
	}
	if after > 0 {
		bits |= 1 << (p % 64)
	} else {
		bits &^= 1 << (p % 64)
	}
	if err := m.natPorts.Put(word, bits); err != nil {
		m.natRefs[p] = before
		return fmt.Errorf("nat relay port %d: %w", p, err)
	}
	return nil
}

// addr16 is the maps' address form: IPv4 as ::ffff:a.b.c.d, IPv6 as is, and
// all zero for an invalid or unspecified address ("unknown").
func addr16(a netip.Addr) [16]uint8 {
	if !a.IsValid() || a.IsUnspecified() {
		return [16]uint8{}
	}
	return a.As16()
}

func fromAddr16(b [16]uint8) netip.Addr {
	return netip.AddrFrom16(b).Unmap()
}

func unmap(a netip.AddrPort) netip.AddrPort {
	return netip.AddrPortFrom(a.Addr().Unmap(), a.Port())
}

// listenerID returns the id of a listener socket address, assigning one on
// first use. Ids are never reused: there are as many as listeners ever seen.
// Called with mu held.
func (m *Maps) listenerID(l netip.AddrPort) uint32 {
	l = unmap(l)
	if id, ok := m.listenerIDs[l]; ok {
		return id
	}
	id := uint32(len(m.listenerIDs) + 1)
	m.listenerIDs[l] = id
	m.listenerAddr[id] = l
	return id
}

func (m *Maps) c2pKey(k Key) bpf.RelayC2pKey {
	var key bpf.RelayC2pKey
	key.ClientAddr.B = addr16(k.Client.Addr())
	key.ClientPort = byteorder.Htons(k.Client.Port())
	key.Channel = byteorder.Htons(k.Channel)
	key.ListenerId = m.listenerID(k.Listener)
	return key
}

// p2cKey is where the peer's datagrams are looked up: from the peer to the
// relay as the peer sees it.
func p2cKey(b Binding) bpf.RelayP2cKey {
	var key bpf.RelayP2cKey
	wire := b.OnWire()
	key.PeerAddr.B = addr16(b.Peer.Addr())
	key.RelayAddr.B = addr16(wire.Addr())
	key.PeerPort = byteorder.Htons(b.Peer.Port())
	key.RelayPort = byteorder.Htons(wire.Port())
	return key
}

func validate(b Binding) error {
	switch {
	case !b.Client.IsValid() || b.Client.Port() == 0:
		return fmt.Errorf("invalid client address %v", b.Client)
	case !b.Peer.IsValid() || b.Peer.Port() == 0:
		return fmt.Errorf("invalid peer address %v", b.Peer)
	case !b.Relay.IsValid() || b.Relay.Port() == 0 || b.Relay.Addr().IsUnspecified():
		return fmt.Errorf("invalid relay address %v", b.Relay)
	case b.Wire.IsValid() && (b.Wire.Port() == 0 || b.Wire.Addr().IsUnspecified()):
		return fmt.Errorf("invalid relay address on the wire %v", b.Wire)
	case !b.Listener.IsValid() || b.Listener.Port() == 0:
		return fmt.Errorf("invalid listener address %v", b.Listener)
	case b.Channel < 0x4000 || b.Channel > 0x7FFF:
		return fmt.Errorf("invalid channel number %#x", b.Channel)
	}
	// Clients may be IPv4 or IPv6; relays and peers are IPv4.
	for _, a := range []netip.Addr{b.Peer.Addr(), b.Relay.Addr(), b.OnWire().Addr()} {
		if !a.Unmap().Is4() {
			return fmt.Errorf("address %v: relays and peers are IPv4 in the kernel", a)
		}
	}
	return nil
}

// SetDestinations makes d the destinations the listeners accept: a client's
// packet to a key of d (the address and port on the wire) is for the listener
// socket d maps it to, and ChannelData to any other destination is passed to
// the kernel untouched (which forwards transit traffic and delivers the rest).
// Whoever computes d answers for it being what the kernel would deliver to
// each listener socket (see internal/destinations). A destination whose port
// is not its listener's (a DNAT translated the port: a NodePort) also puts
// its port into the program's wire_ports, without which the program takes
// only listener ports for client traffic.
func (m *Maps) SetDestinations(d map[netip.AddrPort]netip.AddrPort) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.retryInvalidate()
	want := make(map[bpf.RelayDstKey]bpf.RelayDstVal, len(d))
	var bits [wirePortWords]uint64
	for wire, l := range d {
		if wire.IsValid() && l.IsValid() && wire.Port() != l.Port() {
			bits[wire.Port()/64] |= 1 << (wire.Port() % 64)
		}
		if !wire.IsValid() || wire.Addr().IsUnspecified() || wire.Port() == 0 {
			return fmt.Errorf("destination %v: not a unicast address and port", wire)
		}
		if !l.IsValid() || l.Port() == 0 {
			return fmt.Errorf("destination %v: invalid listener %v", wire, l)
		}
		var k bpf.RelayDstKey
		k.Addr.B = addr16(wire.Addr())
		k.Port = byteorder.Htons(wire.Port())
		v := bpf.RelayDstVal{ListenerId: m.listenerID(l)}
		v.Group = bpf.FlowGroup(unix.IPPROTO_UDP, l) // the shield's key of the socket
		want[k] = v
	}
	var errs []error
	changed := false
	for k, v := range want {
		if cur, ok := m.dstTable[k]; ok && cur == v {
			continue
		}
		changed = true
		if err := m.dsts.Put(k, v); err != nil {
			errs = append(errs, fmt.Errorf("destination %v:%d: %w", fromAddr16(k.Addr.B), byteorder.Htons(k.Port), mapErr(err)))
			continue
		}
		m.dstTable[k] = v
	}
	for k := range m.dstTable {
		if _, ok := want[k]; ok {
			continue
		}
		changed = true
		if err := m.dsts.Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			errs = append(errs, fmt.Errorf("remove destination %v:%d: %w", fromAddr16(k.Addr.B), byteorder.Htons(k.Port), err))
			continue
		}
		delete(m.dstTable, k)
	}
	// The ports after the table: a port's bit without its destination (or
	// the reverse) passes the packet, as no bit does.
	for w := range bits {
		if bits[w] == m.wireBits[w] {
			continue
		}
		changed = true
		if err := m.wirePorts.Put(uint32(w), bits[w]); err != nil {
			errs = append(errs, fmt.Errorf("destination ports %d-%d: %w", w*64, w*64+63, err))
			continue
		}
		m.wireBits[w] = bits[w]
	}
	if changed {
		// Flows the program cached went through the old table (after the
		// change: a flow resolved before it is stored as stale).
		if err := m.invalidate(); err != nil {
			errs = append(errs, fmt.Errorf("destinations changed: %w", err))
		}
	}
	return errors.Join(errs...)
}

// Destinations returns the destination table as the kernel has it.
func (m *Maps) Destinations() (map[netip.AddrPort]netip.AddrPort, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := map[netip.AddrPort]netip.AddrPort{}
	var (
		k bpf.RelayDstKey
		v bpf.RelayDstVal
	)
	it := m.dsts.Iterate()
	for it.Next(&k, &v) {
		out[netip.AddrPortFrom(fromAddr16(k.Addr.B), byteorder.Htons(k.Port))] = m.listenerAddr[v.ListenerId]
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("iterate destination map: %w", err)
	}
	return out, nil
}

// Upsert installs or replaces a binding in both directions. The reply source
// the program learned for the client on this listener is kept.
func (m *Maps) Upsert(b Binding) error {
	if err := validate(b); err != nil {
		return fmt.Errorf("binding %v: %w", b, err)
	}
	b.Client, b.Listener, b.Peer, b.Relay = unmap(b.Client), unmap(b.Listener), unmap(b.Peer), unmap(b.Relay)
	if b.Wire = unmap(b.Wire); b.Wire == b.Relay {
		b.Wire = netip.AddrPort{} // one spelling of "not translated"
	}
	b.ReplySource, b.ReplyPort = netip.Addr{}, 0
	m.mu.Lock()
	defer m.mu.Unlock()
	m.retryInvalidate()

	k := b.Key()
	old, exists := m.bindings[k]
	id := old.id
	if !exists {
		var err error
		if id, err = m.allocID(); err != nil {
			return err
		}
	}
	// The allocation's id: the same as before unless the binding moved to
	// another relay. A reference taken here is dropped on every failure.
	allocID := old.allocID
	newAlloc := !exists || old.binding.Relay != b.Relay
	if newAlloc {
		var err error
		if allocID, err = m.acquireAlloc(b.Relay); err != nil {
			if !exists {
				m.free(id)
			}
			return fmt.Errorf("binding %v: %w", b, err)
		}
	}
	installed := false
	defer func() {
		if newAlloc && !installed {
			m.releaseAlloc(b.Relay)
		}
	}()
	// The translated relay's port is taken before the peer->client entry
	// can match (a port outside the relay range reaches the lookup only
	// with its bit set), and given back on every failure.
	if err := m.natPortRef(b, +1); err != nil {
		if !exists {
			m.free(id)
		}
		return fmt.Errorf("binding %v: %w", b, err)
	}
	defer func() {
		if !installed {
			_ = m.natPortRef(b, -1)
		}
	}()
	pk := p2cKey(b)
	slotGen := old.slotGen
	if !exists {
		// A fresh slot: nothing learned, no next hop cached (the id may have
		// served a removed binding), a generation of its own. The program
		// reads it only once the entries below point at it.
		if m.slotGen++; m.slotGen == 0 {
			m.slotGen = 1
		}
		slotGen = m.slotGen
		if err := m.states.Put(id, bpf.RelayBindingState{Gen: slotGen}); err != nil {
			m.free(id)
			return fmt.Errorf("clear the state slot of %v: %w", b, err)
		}
	}

	var cv bpf.RelayC2pVal
	cv.Key = m.c2pKey(k)
	cv.PeerAddr.B = addr16(b.Peer.Addr())
	// The source client->peer packets leave from: the relay as the peer
	// sees it (the translation netfilter would have applied).
	cv.RelayAddr.B = addr16(b.OnWire().Addr())
	cv.PeerPort = byteorder.Htons(b.Peer.Port())
	cv.RelayPort = byteorder.Htons(b.OnWire().Port())
	cv.BindingId = id
	cv.AllocId = allocID
	cv.Gen = slotGen

	var pv bpf.RelayP2cVal
	pv.Key = pk
	pv.Bind.ClientAddr.B = addr16(b.Client.Addr())
	pv.Bind.ClientPort = byteorder.Htons(b.Client.Port())
	pv.Bind.Channel = byteorder.Htons(b.Channel)
	pv.Bind.BindingId = id
	pv.Bind.AllocId = allocID
	pv.Bind.Gen = slotGen

	moved := exists && p2cKey(old.binding) != pk
	if moved {
		// The channel moved to another peer or relay: the old peer->client
		// entry must not survive it.
		if err := m.p2c.Delete(p2cKey(old.binding)); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return fmt.Errorf("delete stale peer->client entry of %v: %w", old.binding, err)
		}
	}
	// peer->client first: the two directions are one binding, and the kernel
	// must never see a client->peer entry without its twin.
	if err := m.p2c.Put(pk, pv); err != nil {
		m.fail(k, exists, id)
		return fmt.Errorf("install peer->client entry of %v: %w", b, mapErr(err))
	}
	if err := m.c2p.Put(m.c2pKey(k), cv); err != nil {
		err = fmt.Errorf("install client->peer entry of %v: %w", b, mapErr(err))
		if delErr := m.p2c.Delete(pk); delErr != nil && !errors.Is(delErr, ebpf.ErrKeyNotExist) {
			err = errors.Join(err, fmt.Errorf("roll back peer->client entry: %w", delErr))
		}
		m.fail(k, exists, id)
		return err
	}
	installed = true
	if exists && newAlloc {
		m.releaseAlloc(old.binding.Relay)
	}
	if exists {
		// A failure leaves a bit set for nothing: the program then looks
		// up peer->client entries on that port and finds none.
		_ = m.natPortRef(old.binding, -1)
	}
	e := entry{binding: b, id: id, allocID: allocID, gen: old.gen, slotGen: slotGen, account: m.accountOf(b), base: old.base}
	if exists && e.account != old.account {
		// Traffic so far was the old account's: it must not move to the new one.
		e.base = m.fold(id, old.account, old.base)
	}
	if !exists || e.account != old.account {
		m.gen++
		e.gen = m.gen
	}
	m.bindings[k] = e
	if moved {
		// The next hop the program cached for the old peer is not the new
		// one's, nor are the flows it cached: resolve again (the program
		// reads the generation before the binding, so a lookup racing this
		// update is stored as stale).
		if err := m.invalidate(); err != nil {
			return fmt.Errorf("binding %v moved: %w", b, err)
		}
	}
	return nil
}

// InvalidateNextHops makes the program resolve every cached next hop and
// flow again (after a change of routes, neighbours or links).
func (m *Maps) InvalidateNextHops() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.invalidate()
}

// SetFibGen makes m bump g, the loaded program's FIB generation over the
// same map, which its other writers share.
func (m *Maps) SetFibGen(g *bpf.FibGen) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.fibGen = g
}

// invalidate bumps the FIB generation: every flow and next hop the program
// cached is resolved again. A failure is retried by the next write (called
// with mu held).
func (m *Maps) invalidate() error {
	if err := m.fibGen.Bump(); err != nil {
		m.invalidPending = true
		return err
	}
	m.invalidPending = false
	return nil
}

// retryInvalidate repeats a bump that failed (called with mu held).
func (m *Maps) retryInvalidate() {
	if m.invalidPending {
		_ = m.invalidate()
	}
}

func (m *Maps) accountOf(b Binding) string {
	if m.account == nil {
		return ""
	}
	return m.account(b)
}

// fail undoes an Upsert that could not write both directions. A replaced
// binding loses its old client->peer entry too: it pointed at the peer->client
// entry just removed, and the reconcile installs the binding again. Called with
// mu held.
func (m *Maps) fail(k Key, existed bool, id uint32) {
	if !existed {
		// Nothing points at the slot; its generation goes with it.
		_ = m.states.Put(id, bpf.RelayBindingState{})
		m.free(id)
		return
	}
	// The entries are half gone: what the program cached of them too.
	_ = m.invalidate()
	if err := m.c2p.Delete(m.c2pKey(k)); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return // keep the record: the reconcile retries and RemoveStray knows it
	}
	old := m.bindings[k]
	delete(m.bindings, k)
	m.retire(old)
}

// mapErr marks a full map.
func mapErr(err error) error {
	if errors.Is(err, unix.E2BIG) {
		return fmt.Errorf("%w: %w", ErrFull, err)
	}
	return err
}

// Delete removes a binding in both directions. Deleting an absent binding is
// not an error.
func (m *Maps) Delete(k Key) error {
	k.Client, k.Listener = unmap(k.Client), unmap(k.Listener)
	m.mu.Lock()
	defer m.mu.Unlock()
	m.retryInvalidate()
	e, ok := m.bindings[k]
	if !ok {
		return nil
	}
	var errs []error
	if err := m.c2p.Delete(m.c2pKey(k)); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		errs = append(errs, fmt.Errorf("delete client->peer entry of %v: %w", e.binding, err))
	}
	if err := m.p2c.Delete(p2cKey(e.binding)); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		errs = append(errs, fmt.Errorf("delete peer->client entry of %v: %w", e.binding, err))
	}
	if len(errs) > 0 {
		// Keep the record so a retry or the reconcile removes it for good.
		// One direction may be gone while the slot still holds its
		// generation: the cached flows must not stand in for it.
		if err := m.invalidate(); err != nil {
			errs = append(errs, err)
		}
		return errors.Join(errs...)
	}
	delete(m.bindings, k)
	m.retire(e)
	return nil
}

// Len returns the number of bindings installed.
func (m *Maps) Len() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return len(m.bindings)
}

// Installed returns the bindings this process installed.
func (m *Maps) Installed() []Binding {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make([]Binding, 0, len(m.bindings))
	for _, e := range m.bindings {
		out = append(out, e.binding)
	}
	return out
}

func (m *Maps) allocID() (uint32, error) {
	if m.nextID < m.maxID {
		id := m.nextID
		m.nextID++
		return id, nil
	}
	if len(m.freed) == 0 || m.now().Sub(m.freed[0].at) < idQuarantine {
		return 0, ErrFull
	}
	f := m.freed[0]
	m.freed = m.freed[1:]
	// Packets that were in flight when the slot's binding went counted into
	// it after retire: they belong to the totals, not to the new owner (whose
	// Upsert clears the slot).
	m.fold(f.id, f.account, Stats{})
	return f.id, nil
}

// free returns an id that was never used by a binding.
func (m *Maps) free(id uint32) {
	m.freed = append(m.freed, freedID{id: id})
}

// retire folds a removed binding's counters into the totals, zeroes its slot
// (what the program learned belongs to the binding) and puts the id in
// quarantine. Called with mu held, after both map entries are gone.
func (m *Maps) retire(e entry) {
	m.releaseAlloc(e.binding.Relay)
	_ = m.natPortRef(e.binding, -1) // a bit left set only costs lookups that miss
	m.fold(e.id, e.account, e.base)
	if err := m.states.Put(e.id, bpf.RelayBindingState{}); err != nil {
		// The slot keeps the generation its cached flows were made in.
		_ = m.invalidate()
	}
	m.freed = append(m.freed, freedID{id: e.id, at: m.now(), account: e.account})
}

// fold adds what slot id counted since base to the totals (overall and the
// account's) and returns the slot's counters now, the next base. It only
// reads the slot: writing a live binding's slot back would race the program's
// updates of what it learned (reply source, cached next hops). On a read
// error nothing is folded and base stays.
func (m *Maps) fold(id uint32, account string, base Stats) Stats {
	s, err := m.bindingStats(id)
	if err != nil {
		return base
	}
	d := s.since(base)
	m.retired.add(d)
	if m.byAccount != nil {
		a := m.byAccount[account]
		a.add(d)
		m.byAccount[account] = a
	}
	return s
}

// SetAccount has the maps keep their counters by account: account(b) names
// the account binding b's traffic counts under (the metrics' listener and
// cluster), from its installation to its removal. Bindings installed before
// the first call are assigned whole; a later call leaves what bindings counted
// so far with their old accounts. account runs under the maps' lock: it must not call back
// into Maps.
func (m *Maps) SetAccount(account func(Binding) string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	first := m.account == nil
	m.account = account
	if m.byAccount == nil {
		m.byAccount = map[string]Stats{}
	}
	for k, e := range m.bindings {
		if a := account(e.binding); a != e.account {
			if !first {
				e.base = m.fold(e.id, e.account, e.base)
			}
			m.gen++
			e.account, e.gen = a, m.gen
			m.bindings[k] = e
		}
	}
}

// AccountTotals returns what the fast path relayed by account (see
// SetAccount) over the process's lifetime: removed bindings' counters plus the
// live ones'. Each total only grows.
func (m *Maps) AccountTotals() (map[string]Stats, error) {
	var out map[string]Stats
	err := m.eachLive(func() { out = maps.Clone(m.byAccount) }, func(e entry, s Stats) {
		if out == nil {
			out = map[string]Stats{}
		}
		a := out[e.account]
		a.add(s.since(e.base))
		out[e.account] = a
	})
	if out == nil {
		out = map[string]Stats{}
	}
	return out, err
}

// eachLive reads the counters of the installed bindings outside the lock
// (readSlots: batches of slots up to the highest id given out, which stays
// within slotsDense times the live bindings, or a lookup per binding), so
// the cost follows the live bindings (not the map's size) and writers are
// not held up. Then, under the lock, it calls
// retired (to take the removed bindings' totals) and f with each binding
// still installed as it was read. A binding removed or moved to another
// account meanwhile is skipped: its counters are in the retired totals taken
// under the same lock, so a sum of both only grows.
func (m *Maps) eachLive(retired func(), f func(entry, Stats)) error {
	snap, slots, errs := m.snapshotSlots()
	live := make([]Stats, len(snap))
	for i := range snap {
		if errs[i] != nil {
			snap[i].gen = 0 // not counted: the caller reports the error
		}
		live[i] = statsOf(slots[i].Stats)
	}

	m.mu.Lock()
	defer m.mu.Unlock()
	retired()
	for i, e := range snap {
		if cur, ok := m.bindings[e.binding.Key()]; ok && e.gen != 0 && cur.gen == e.gen {
			f(e, live[i])
		}
	}
	return errors.Join(errs...)
}

// snapshotSlots copies the installed bindings' entries under mu and reads
// their state slots outside it (readSlots).
func (m *Maps) snapshotSlots() ([]entry, []bpf.RelayBindingState, []error) {
	m.mu.Lock()
	snap := make([]entry, 0, len(m.bindings))
	for _, e := range m.bindings {
		snap = append(snap, e)
	}
	next := m.nextID
	m.mu.Unlock()
	ids := make([]uint32, len(snap))
	for i, e := range snap {
		ids[i] = e.id
	}
	slots := make([]bpf.RelayBindingState, len(snap))
	return snap, slots, m.readSlots(ids, next, slots)
}

func (m *Maps) bindingStats(id uint32) (Stats, error) {
	var st bpf.RelayBindingState
	if err := m.states.Lookup(id, &st); err != nil {
		return Stats{}, fmt.Errorf("read counters of binding %d: %w", id, err)
	}
	return statsOf(st.Stats), nil
}

func statsOf(c bpf.RelayBindingStats) Stats {
	return Stats{ClientToPeerPackets: c.C2pPackets, ClientToPeerBytes: c.C2pBytes,
		PeerToClientPackets: c.P2cPackets, PeerToClientBytes: c.P2cBytes}
}

// Stats returns the counters of one installed binding.
func (m *Maps) Stats(k Key) (Stats, error) {
	k.Client, k.Listener = unmap(k.Client), unmap(k.Listener)
	m.mu.Lock()
	defer m.mu.Unlock()
	e, ok := m.bindings[k]
	if !ok {
		return Stats{}, fmt.Errorf("no binding %v", k)
	}
	return m.bindingStats(e.id)
}

// Totals returns what the fast path relayed over the process's lifetime,
// including bindings already removed (see eachLive for the cost).
func (m *Maps) Totals() (Stats, error) {
	var total Stats
	err := m.eachLive(func() { total = m.retired }, func(e entry, s Stats) { total.add(s.since(e.base)) })
	return total, err
}

// Verdicts returns the per-reason packet counts summed over CPUs, indexed by
// bpf.RelayReason.
func (m *Maps) Verdicts() ([]uint64, error) {
	out := make([]uint64, bpf.RelayReasonREASON_MAX)
	for r := range out {
		var perCPU []uint64
		if err := m.verdicts.Lookup(uint32(r), &perCPU); err != nil {
			return nil, fmt.Errorf("read verdict counter %d: %w", r, err)
		}
		for _, v := range perCPU {
			out[r] += v
		}
	}
	return out, nil
}

// Dump reads the bindings as the kernel has them, for reconciliation and
// tests: a client->peer entry counts only with the peer->client entry that
// points back at it (else the binding is broken and the reconcile installs it
// again). ReplySource is what the program learned (invalid: nothing yet).
func (m *Maps) Dump() (map[Key]Binding, error) {
	m.mu.Lock()
	listeners := maps.Clone(m.listenerAddr)
	recorded := make(map[Key]Binding, len(m.bindings))
	for k, e := range m.bindings {
		recorded[k] = e.binding
	}
	m.mu.Unlock()
	out := make(map[Key]Binding)
	var (
		k  bpf.RelayC2pKey
		v  bpf.RelayC2pVal
		pv bpf.RelayP2cVal
		st bpf.RelayBindingState
	)
	it := m.c2p.Iterate()
	for it.Next(&k, &v) {
		l, ok := listeners[k.ListenerId]
		if !ok {
			continue // not this process's: RemoveStray's
		}
		b := Binding{
			Client:   netip.AddrPortFrom(fromAddr16(k.ClientAddr.B), byteorder.Htons(k.ClientPort)),
			Listener: l,
			Channel:  byteorder.Htons(k.Channel),
			Peer:     netip.AddrPortFrom(fromAddr16(v.PeerAddr.B), byteorder.Htons(v.PeerPort)),
			Relay:    netip.AddrPortFrom(fromAddr16(v.RelayAddr.B), byteorder.Htons(v.RelayPort)),
		}
		// The kernel holds the relay on the wire; pion's relay socket is
		// this process's record of it.
		if r, ok := recorded[b.Key()]; ok && r.OnWire() == b.Relay {
			b.Relay, b.Wire = r.Relay, r.Wire
		}
		if err := m.p2c.Lookup(p2cKey(b), &pv); err != nil || pv.Bind.BindingId != v.BindingId ||
			pv.Bind.ClientAddr.B != k.ClientAddr.B || pv.Bind.ClientPort != k.ClientPort || pv.Bind.Channel != k.Channel {
			continue
		}
		if err := m.states.Lookup(v.BindingId, &st); err == nil {
			b.ReplySource, b.ReplyPort = learned(&st)
		}
		out[b.Key()] = b
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("iterate client->peer map: %w", err)
	}
	return out, nil
}

// DumpPeerToClient returns the number of peer->client entries in the kernel.
func (m *Maps) DumpPeerToClient() (int, error) {
	var (
		k bpf.RelayP2cKey
		v bpf.RelayP2cVal
		n int
	)
	it := m.p2c.Iterate()
	for it.Next(&k, &v) {
		n++
	}
	if err := it.Err(); err != nil {
		return n, fmt.Errorf("iterate peer->client map: %w", err)
	}
	return n, nil
}

// RemoveStray deletes kernel entries this process does not know about (left by
// a failed delete) and returns how many it removed.
func (m *Maps) RemoveStray() (int, error) {
	m.mu.Lock()
	known := make(map[bpf.RelayC2pKey]bool, len(m.bindings))
	knownP := make(map[bpf.RelayP2cKey]bool, len(m.bindings))
	for k, e := range m.bindings {
		known[m.c2pKey(k)] = true
		knownP[p2cKey(e.binding)] = true
	}
	m.mu.Unlock()

	var (
		stray  []bpf.RelayC2pKey
		strayP []bpf.RelayP2cKey
		k      bpf.RelayC2pKey
		v      bpf.RelayC2pVal
		pk     bpf.RelayP2cKey
		pv     bpf.RelayP2cVal
	)
	it := m.c2p.Iterate()
	for it.Next(&k, &v) {
		if !known[k] {
			stray = append(stray, k)
		}
	}
	if err := it.Err(); err != nil {
		return 0, fmt.Errorf("iterate client->peer map: %w", err)
	}
	pit := m.p2c.Iterate()
	for pit.Next(&pk, &pv) {
		if !knownP[pk] {
			strayP = append(strayP, pk)
		}
	}
	if err := pit.Err(); err != nil {
		return 0, fmt.Errorf("iterate peer->client map: %w", err)
	}
	var errs []error
	for _, k := range stray {
		if err := m.c2p.Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			errs = append(errs, err)
		}
	}
	for _, k := range strayP {
		if err := m.p2c.Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			errs = append(errs, err)
		}
	}
	if len(stray)+len(strayP) > 0 {
		// A flow the program cached from a stray entry must go with it.
		m.mu.Lock()
		if err := m.invalidate(); err != nil {
			errs = append(errs, err)
		}
		m.mu.Unlock()
	}
	return len(stray) + len(strayP), errors.Join(errs...)
}

// RateLimit is what every allocation may relay per second, all its channels
// and both directions together: the program's GCRA in the allocation's bucket
// (alloc_rates) enforces it, with a
// burst of RateBurst worth of the rates. Zero rates are no limit.
type RateLimit struct {
	// PacketsPerSecond counts datagrams.
	PacketsPerSecond uint64
	// BytesPerSecond counts application data (the ChannelData payload, the
	// peer's UDP payload): what the allocation relays, not headers.
	BytesPerSecond uint64
	// Pass hands a packet over the limit to pion/turn (whose relay applies
	// the same limit in userspace) instead of dropping it.
	Pass bool
}

// RateBurst is how far ahead of its rates an allocation may run (the program's
// RATE_LIMIT_BURST_NS).
const RateBurst = 50 * time.Millisecond

// Off tells whether the limit limits nothing.
func (r RateLimit) Off() bool { return r.PacketsPerSecond == 0 && r.BytesPerSecond == 0 }

// SetRateLimit sets the rate limit of every allocation, taking effect on the
// next packet (no reload). What allocations owe so far stays in their buckets.
func (m *Maps) SetRateLimit(r RateLimit) error {
	var v bpf.RelayRateLimit
	if r.PacketsPerSecond > 0 {
		v.PktCostNs = max(uint64(time.Second)/r.PacketsPerSecond, 1)
	}
	v.BytesPerSec = r.BytesPerSecond
	if r.Pass {
		v.Pass = 1
	}
	if err := m.rateLimits.Put(uint32(0), v); err != nil {
		return fmt.Errorf("set rate limit: %w", err)
	}
	return nil
}

// Shield is the listener shield's settings (bpf/relay.c listener_shield).
type Shield struct {
	// Junk drops what pion/turn would discard unanswered at a listener
	// socket; Allocations also ChannelData from clients without an
	// allocation, which only a complete allocation table
	// (internal/allocflows) may say.
	Junk, Allocations bool
	// AdmitCost is what a request of a client without an allocation costs
	// its source address (1 s / requests per second; 0: no limit), and
	// AdmitBurst how far ahead of now an address may run (burst-1 costs).
	AdmitCost, AdmitBurst time.Duration
}

// SetShield sets the listener shield (the next packet sees it). Without Junk
// it is off, whatever else it says.
func (m *Maps) SetShield(s Shield) error {
	var v bpf.RelayShield
	if s.Junk {
		v.Flags |= uint32(bpf.RelayShieldFlagSHIELD_JUNK)
		if s.Allocations {
			v.Flags |= uint32(bpf.RelayShieldFlagSHIELD_ALLOCS)
		}
		v.AdmitCostNs, v.AdmitBurstNs = uint64(s.AdmitCost), uint64(s.AdmitBurst)
	}
	if err := m.shields.Put(uint32(0), v); err != nil {
		return fmt.Errorf("set listener shield: %w", err)
	}
	return nil
}

// acquireAlloc returns the id of the allocation relayed at relay, taking a
// reference; a new allocation's bucket starts with nothing owed. Called with
// mu held.
func (m *Maps) acquireAlloc(relay netip.AddrPort) (uint32, error) {
	if r := m.allocs[relay]; r != nil {
		r.refs++
		return r.id, nil
	}
	var id uint32
	reuse := len(m.allocFree) > 0
	switch {
	case reuse:
		id = m.allocFree[len(m.allocFree)-1]
	case m.nextAlloc < m.maxID: // at most one allocation per binding
		id = m.nextAlloc
	default:
		return 0, ErrFull
	}
	// A packet in flight may still charge a reused bucket: a few ns of debt.
	if err := m.allocRates.Put(id, bpf.RelayAllocRate{}); err != nil {
		return 0, fmt.Errorf("clear the rate bucket of allocation %v: %w", relay, err)
	}
	if reuse {
		m.allocFree = m.allocFree[:len(m.allocFree)-1]
	} else {
		m.nextAlloc++
	}
	m.allocs[relay] = &allocRef{id: id, refs: 1}
	return id, nil
}

// releaseAlloc drops a reference to relay's allocation id. Called with mu held.
func (m *Maps) releaseAlloc(relay netip.AddrPort) {
	r := m.allocs[relay]
	if r == nil {
		return
	}
	if r.refs--; r.refs == 0 {
		delete(m.allocs, relay)
		m.allocFree = append(m.allocFree, r.id)
	}
}

// AllocID returns the rate-limit bucket id of the allocation relayed at relay
// (false: no binding of it installed).
func (m *Maps) AllocID(relay netip.AddrPort) (uint32, bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	r := m.allocs[unmap(relay)]
	if r == nil {
		return 0, false
	}
	return r.id, true
}
