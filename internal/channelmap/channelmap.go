// Package channelmap is the typed Go view of the XDP program's binding maps and
// the only code that writes them. Every write goes to the kernel first; the Go
// side records a binding only after its map update succeeded, and a failed
// update of one direction is rolled back in the other.
package channelmap

import (
	"errors"
	"fmt"
	"math/bits"
	"net/netip"
	"sync"

	"github.com/cilium/ebpf"

	"github.com/l7mp/stunnerd-xdp/bpf"
)

// Binding is one TURN channel binding as the fast path sees it: ChannelData from
// Client to ListenerPort with Channel goes Relay -> Peer, and Peer's datagrams to
// Relay go ListenerAddr:ListenerPort -> Client with Channel.
type Binding struct {
	Client       netip.AddrPort
	ListenerPort uint16
	Channel      uint16
	Peer         netip.AddrPort
	Relay        netip.AddrPort
	// ListenerAddr is the source for packets to the client. When it is not
	// known (a wildcard listener), leave it invalid or unspecified: the program
	// learns it from the client's first ChannelData.
	ListenerAddr netip.Addr
}

// Key identifies a binding: one client's channel on one listener port.
type Key struct {
	Client       netip.AddrPort
	ListenerPort uint16
	Channel      uint16
}

// Key returns the binding's identity.
func (b Binding) Key() Key {
	return Key{Client: b.Client, ListenerPort: b.ListenerPort, Channel: b.Channel}
}

func (b Binding) String() string {
	return fmt.Sprintf("%s ch=%#x listener=:%d <-> relay=%s peer=%s", b.Client, b.Channel, b.ListenerPort, b.Relay, b.Peer)
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

// ErrFull is returned when every binding slot is in use (see --max-bindings).
var ErrFull = errors.New("binding maps are full")

// Maps writes bindings into the program's maps.
type Maps struct {
	c2p, p2c, counters, verdicts *ebpf.Map

	mu       sync.Mutex
	bindings map[Key]entry
	freeIDs  []uint32
	nextID   uint32
	maxID    uint32
	retired  Stats // counters of bindings already removed, so totals only grow
}

type entry struct {
	binding Binding
	id      uint32
}

// New wraps the loaded maps.
func New(m *bpf.RelayMaps) *Maps {
	return &Maps{
		c2p:      m.C2pBindings,
		p2c:      m.P2cBindings,
		counters: m.BindingCounters,
		verdicts: m.Verdicts,
		bindings: make(map[Key]entry),
		maxID:    m.BindingCounters.MaxEntries(),
	}
}

func htons(v uint16) uint16 { return bits.ReverseBytes16(v) }

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

func c2pKey(k Key) bpf.RelayC2pKey {
	var key bpf.RelayC2pKey
	key.ClientAddr.B = addr16(k.Client.Addr())
	key.ClientPort = htons(k.Client.Port())
	key.ListenerPort = htons(k.ListenerPort)
	key.Channel = htons(k.Channel)
	return key
}

func p2cKey(b Binding) bpf.RelayP2cKey {
	var key bpf.RelayP2cKey
	key.PeerAddr.B = addr16(b.Peer.Addr())
	key.RelayAddr.B = addr16(b.Relay.Addr())
	key.PeerPort = htons(b.Peer.Port())
	key.RelayPort = htons(b.Relay.Port())
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
	case b.ListenerPort == 0:
		return fmt.Errorf("invalid listener port 0")
	case b.Channel < 0x4000 || b.Channel > 0x7FFF:
		return fmt.Errorf("invalid channel number %#x", b.Channel)
	}
	// Clients may be IPv4 or IPv6, and the source of their replies with them;
	// relays and peers are IPv4.
	client6 := !b.Client.Addr().Unmap().Is4()
	if l := b.ListenerAddr; l.IsValid() && !l.IsUnspecified() && l.Unmap().Is4() == client6 {
		return fmt.Errorf("listener address %v is not of the client's family (%v)", l, b.Client)
	}
	for _, a := range []netip.Addr{b.Peer.Addr(), b.Relay.Addr()} {
		if !a.Unmap().Is4() {
			return fmt.Errorf("address %v: relays and peers are IPv4 in the kernel", a)
		}
	}
	return nil
}

// Upsert installs or replaces a binding in both directions.
func (m *Maps) Upsert(b Binding) error {
	if err := validate(b); err != nil {
		return fmt.Errorf("binding %v: %w", b, err)
	}
	m.mu.Lock()
	defer m.mu.Unlock()

	k := b.Key()
	old, exists := m.bindings[k]
	id := old.id
	if !exists {
		var err error
		if id, err = m.allocID(); err != nil {
			return err
		}
	} else if old.binding.Peer != b.Peer || old.binding.Relay != b.Relay {
		// The channel moved to another peer or relay: the old peer->client
		// entry must not survive it.
		if err := m.p2c.Delete(p2cKey(old.binding)); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return fmt.Errorf("delete stale peer->client entry of %v: %w", old.binding, err)
		}
	}

	var cv bpf.RelayC2pVal
	cv.PeerAddr.B = addr16(b.Peer.Addr())
	cv.RelayAddr.B = addr16(b.Relay.Addr())
	cv.PeerPort = htons(b.Peer.Port())
	cv.RelayPort = htons(b.Relay.Port())
	cv.BindingId = id

	var pv bpf.RelayP2cVal
	pv.ClientAddr.B = addr16(b.Client.Addr())
	pv.ListenerAddr.B = addr16(b.ListenerAddr)
	pv.ClientPort = htons(b.Client.Port())
	pv.ListenerPort = htons(b.ListenerPort)
	pv.Channel = htons(b.Channel)
	pv.BindingId = id

	// peer->client first: a client->peer packet learns the listener address
	// into the peer->client entry, so that one must exist when traffic starts.
	pk := p2cKey(b)
	if err := m.p2c.Put(pk, pv); err != nil {
		if !exists {
			m.freeIDs = append(m.freeIDs, id)
		}
		return fmt.Errorf("install peer->client entry of %v: %w", b, err)
	}
	if err := m.c2p.Put(c2pKey(k), cv); err != nil {
		if delErr := m.p2c.Delete(pk); delErr != nil && !errors.Is(delErr, ebpf.ErrKeyNotExist) {
			err = errors.Join(err, fmt.Errorf("roll back peer->client entry: %w", delErr))
		}
		if !exists {
			m.freeIDs = append(m.freeIDs, id)
		} else {
			delete(m.bindings, k)
			m.retire(old.id)
		}
		return fmt.Errorf("install client->peer entry of %v: %w", b, err)
	}
	m.bindings[k] = entry{binding: b, id: id}
	return nil
}

// Delete removes a binding in both directions. Deleting an absent binding is
// not an error.
func (m *Maps) Delete(k Key) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	e, ok := m.bindings[k]
	if !ok {
		return nil
	}
	var errs []error
	if err := m.c2p.Delete(c2pKey(k)); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		errs = append(errs, fmt.Errorf("delete client->peer entry of %v: %w", e.binding, err))
	}
	if err := m.p2c.Delete(p2cKey(e.binding)); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		errs = append(errs, fmt.Errorf("delete peer->client entry of %v: %w", e.binding, err))
	}
	if len(errs) > 0 {
		// Keep the record so a retry or the reconcile removes it for good.
		return errors.Join(errs...)
	}
	delete(m.bindings, k)
	m.retire(e.id)
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
	if n := len(m.freeIDs); n > 0 {
		id := m.freeIDs[n-1]
		m.freeIDs = m.freeIDs[:n-1]
		return id, nil
	}
	if m.nextID >= m.maxID {
		return 0, ErrFull
	}
	id := m.nextID
	m.nextID++
	return id, nil
}

// retire folds a removed binding's counters into the totals and zeroes its slot
// for reuse. Called with mu held, after both map entries are gone.
func (m *Maps) retire(id uint32) {
	if s, err := m.bindingStats(id); err == nil {
		m.retired.add(s)
	}
	zero := make([]bpf.RelayBindingStats, ebpf.MustPossibleCPU())
	_ = m.counters.Put(id, zero)
	m.freeIDs = append(m.freeIDs, id)
}

func (m *Maps) bindingStats(id uint32) (Stats, error) {
	var perCPU []bpf.RelayBindingStats
	if err := m.counters.Lookup(id, &perCPU); err != nil {
		return Stats{}, fmt.Errorf("read counters of binding %d: %w", id, err)
	}
	var s Stats
	for _, c := range perCPU {
		s.ClientToPeerPackets += c.C2pPackets
		s.ClientToPeerBytes += c.C2pBytes
		s.PeerToClientPackets += c.P2cPackets
		s.PeerToClientBytes += c.P2cBytes
	}
	return s, nil
}

// Stats returns the counters of one installed binding.
func (m *Maps) Stats(k Key) (Stats, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	e, ok := m.bindings[k]
	if !ok {
		return Stats{}, fmt.Errorf("no binding %v", k)
	}
	return m.bindingStats(e.id)
}

// Totals returns what the fast path relayed over the process's lifetime,
// including bindings already removed.
func (m *Maps) Totals() (Stats, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	total := m.retired
	if len(m.bindings) > batchThreshold {
		// Freed slots are zeroed, so summing every slot in a few batch
		// syscalls beats one syscall per binding.
		s, err := m.sumAllSlots()
		total.add(s)
		return total, err
	}
	for _, e := range m.bindings {
		s, err := m.bindingStats(e.id)
		if err != nil {
			return total, err
		}
		total.add(s)
	}
	return total, nil
}

// batchThreshold is where Totals switches from per-binding lookups to batch
// lookups of the whole counter array.
const batchThreshold = 1024

func (m *Maps) sumAllSlots() (Stats, error) {
	ncpu, err := ebpf.PossibleCPU()
	if err != nil {
		return Stats{}, err
	}
	const chunk = 4096
	keys := make([]uint32, chunk)
	vals := make([]bpf.RelayBindingStats, chunk*ncpu)
	var (
		cursor ebpf.MapBatchCursor
		s      Stats
	)
	for {
		n, err := m.counters.BatchLookup(&cursor, keys, vals, nil)
		for _, c := range vals[:n*ncpu] {
			s.ClientToPeerPackets += c.C2pPackets
			s.ClientToPeerBytes += c.C2pBytes
			s.PeerToClientPackets += c.P2cPackets
			s.PeerToClientBytes += c.P2cBytes
		}
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			return s, nil
		}
		if err != nil {
			return s, fmt.Errorf("batch-read binding counters: %w", err)
		}
	}
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

// Dump reads the client->peer map as the kernel has it, for reconciliation and
// tests. Listener addresses come from the peer->client entries.
func (m *Maps) Dump() (map[Key]Binding, error) {
	out := make(map[Key]Binding)
	var (
		k  bpf.RelayC2pKey
		v  bpf.RelayC2pVal
		pv bpf.RelayP2cVal
	)
	it := m.c2p.Iterate()
	for it.Next(&k, &v) {
		b := Binding{
			Client:       netip.AddrPortFrom(fromAddr16(k.ClientAddr.B), htons(k.ClientPort)),
			ListenerPort: htons(k.ListenerPort),
			Channel:      htons(k.Channel),
			Peer:         netip.AddrPortFrom(fromAddr16(v.PeerAddr.B), htons(v.PeerPort)),
			Relay:        netip.AddrPortFrom(fromAddr16(v.RelayAddr.B), htons(v.RelayPort)),
		}
		if err := m.p2c.Lookup(p2cKey(b), &pv); err == nil {
			b.ListenerAddr = fromAddr16(pv.ListenerAddr.B)
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
		known[c2pKey(k)] = true
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
	return len(stray) + len(strayP), errors.Join(errs...)
}
