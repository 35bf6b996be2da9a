// Package metrics exports what stunnerd-xdp relays under STUNner's metric
// names (stunner_*), with the kernel path's traffic in them, next to the
// fast-path series (stunnerd_xdp_*).
package metrics

import (
	"net"
	"net/netip"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/pion/turn/v4"

	"github.com/l7mp/stunnerd-xdp/internal/channelmap"
	"github.com/l7mp/stunnerd-xdp/internal/config"
)

// Directions, as STUNner names them from its own standpoint: rx is what a
// listener received from clients or a cluster from peers, tx what was sent.
const (
	rx = "rx"
	tx = "tx"
)

// Listener is what the accounting needs to know of a listener.
type Listener struct {
	Name string
	// Addr is the socket address pion/turn reports for the listener's
	// bindings (UDP listeners only; zero for TCP and TLS).
	Addr     netip.AddrPort
	Clusters []config.ResolvedCluster
}

// dir counts one direction.
type dir struct{ packets, bytes atomic.Uint64 }

func (d *dir) add(n int) {
	d.packets.Add(1)
	d.bytes.Add(uint64(n))
}

// counts are one listener's or cluster's userspace counters.
type counts struct {
	rx, tx dir
	// conns are the listener's open downstream connections (UDP: its
	// sockets, as STUNner counts them), connsTotal those ever opened.
	conns, connsTotal atomic.Int64
}

// routes is the listeners' configuration, swapped whole on reload.
type routes struct {
	byName map[string]Listener
	byAddr map[netip.AddrPort]string
}

// Traffic counts the listeners' and clusters' traffic the way STUNner does:
// userspace traffic as pion/turn reads and writes it, kernel traffic from the
// XDP program's per-binding counters, kept by (listener, cluster) account.
type Traffic struct {
	routes atomic.Pointer[routes]

	mu        sync.Mutex
	listeners map[string]*counts
	clusters  map[string]*counts
}

// NewTraffic returns empty counters.
func NewTraffic() *Traffic {
	t := &Traffic{listeners: map[string]*counts{}, clusters: map[string]*counts{}}
	t.SetListeners(nil)
	return t
}

// SetListeners installs the listeners and their routes (at start and on
// reload). Counters of listeners and clusters that went are kept: they are
// counters, and a listener coming back continues them.
func (t *Traffic) SetListeners(ls []Listener) {
	r := &routes{byName: map[string]Listener{}, byAddr: map[netip.AddrPort]string{}}
	for _, l := range ls {
		r.byName[l.Name] = l
		if l.Addr.IsValid() {
			r.byAddr[l.Addr] = l.Name
		}
	}
	t.routes.Store(r)
}

func (t *Traffic) counts(m map[string]*counts, name string) *counts {
	t.mu.Lock()
	defer t.mu.Unlock()
	c, ok := m[name]
	if !ok {
		c = &counts{}
		m[name] = c
	}
	return c
}

// cluster returns the first of the listener's clusters that has the peer
// ("" none: the peer policy refuses such peers, so there is no traffic).
func (r *routes) cluster(listener string, peer netip.Addr) string {
	for _, c := range r.byName[listener].Clusters {
		for _, p := range c.Peers {
			if p.Contains(peer) {
				return c.Name
			}
		}
	}
	return ""
}

// accountSep joins a listener's and a cluster's name into an account; names
// are Kubernetes object paths, which never hold it.
const accountSep = "\x00"

// Account names the account a kernel binding's traffic counts under (see
// channelmap.Maps.SetAccount): its listener and the cluster of its peer.
func (t *Traffic) Account(b channelmap.Binding) string {
	rt := t.routes.Load()
	l := rt.byAddr[b.Listener]
	return l + accountSep + rt.cluster(l, b.Peer.Addr())
}

func splitAccount(a string) (listener, cluster string) {
	listener, cluster, _ = strings.Cut(a, accountSep)
	return listener, cluster
}

// ListenerConn counts a UDP listener's datagrams: every datagram it reads or
// writes, STUN and TURN messages included, as STUNner's listener counters do.
// What the XDP program relays never reaches the socket and is added from its
// counters at scrape time.
func (t *Traffic) ListenerConn(listener string, c net.PacketConn) net.PacketConn {
	cs := t.counts(t.listeners, listener)
	cs.conns.Add(1)
	cs.connsTotal.Add(1)
	return &listenerConn{PacketConn: c, c: cs}
}

type listenerConn struct {
	net.PacketConn
	c    *counts
	once sync.Once
}

func (l *listenerConn) ReadFrom(p []byte) (int, net.Addr, error) {
	n, addr, err := l.PacketConn.ReadFrom(p)
	if n > 0 {
		l.c.rx.add(n)
	}
	return n, addr, err
}

func (l *listenerConn) WriteTo(p []byte, addr net.Addr) (int, error) {
	n, err := l.PacketConn.WriteTo(p, addr)
	if n > 0 {
		l.c.tx.add(n)
	}
	return n, err
}

func (l *listenerConn) Close() error {
	l.once.Do(func() { l.c.conns.Add(-1) })
	return l.PacketConn.Close()
}

// Listener counts a TCP or TLS listener's connections and the bytes read and
// written on them (each read or write counts as a packet, as STUNner's do).
func (t *Traffic) Listener(listener string, ln net.Listener) net.Listener {
	return &streamListener{Listener: ln, c: t.counts(t.listeners, listener)}
}

type streamListener struct {
	net.Listener
	c *counts
}

func (l *streamListener) Accept() (net.Conn, error) {
	conn, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	l.c.conns.Add(1)
	l.c.connsTotal.Add(1)
	return &streamConn{Conn: conn, c: l.c}, nil
}

type streamConn struct {
	net.Conn
	c    *counts
	once sync.Once
}

func (s *streamConn) Read(p []byte) (int, error) {
	n, err := s.Conn.Read(p)
	if n > 0 {
		s.c.rx.add(n)
	}
	return n, err
}

func (s *streamConn) Write(p []byte) (int, error) {
	n, err := s.Conn.Write(p)
	if n > 0 {
		s.c.tx.add(n)
	}
	return n, err
}

func (s *streamConn) Close() error {
	s.once.Do(func() { s.c.conns.Add(-1) })
	return s.Conn.Close()
}

// RelayAddressGenerator wraps a listener's relay socket generator so that
// pion's relay sockets count the cluster traffic: tx what goes to a peer, rx
// what comes from one (before pion checks its permission, as STUNner counts).
func (t *Traffic) RelayAddressGenerator(listener string, g turn.RelayAddressGenerator) turn.RelayAddressGenerator {
	return &relayGen{RelayAddressGenerator: g, t: t, listener: listener}
}

type relayGen struct {
	turn.RelayAddressGenerator
	t        *Traffic
	listener string
}

func (g *relayGen) AllocatePacketConn(network string, requestedPort int) (net.PacketConn, net.Addr, error) {
	c, addr, err := g.RelayAddressGenerator.AllocatePacketConn(network, requestedPort)
	if err != nil {
		return nil, nil, err
	}
	return &relayConn{PacketConn: c, g: g}, addr, nil
}

type relayConn struct {
	net.PacketConn
	g *relayGen
	// The last peer's counters in each direction: a relay socket talks to
	// one peer or a few, and finding the cluster takes a map lookup, a walk
	// over the prefixes and the Traffic's lock, per datagram otherwise.
	lastTx, lastRx atomic.Pointer[peerCounts]
}

// peerCounts are the counters of peer's cluster under one configuration.
type peerCounts struct {
	routes *routes
	peer   netip.Addr
	c      *counts // nil: the peer is in no cluster
}

// clusterOf returns the counters of the peer's cluster (nil: none), from
// last when it holds the same peer under the current configuration.
func (r *relayConn) clusterOf(last *atomic.Pointer[peerCounts], addr net.Addr) *counts {
	u, ok := addr.(*net.UDPAddr)
	if !ok {
		return nil
	}
	ip, ok := netip.AddrFromSlice(u.IP)
	if !ok {
		return nil
	}
	ip = ip.Unmap()
	rt := r.g.t.routes.Load()
	if pc := last.Load(); pc != nil && pc.routes == rt && pc.peer == ip {
		return pc.c
	}
	pc := &peerCounts{routes: rt, peer: ip}
	if name := rt.cluster(r.g.listener, ip); name != "" {
		pc.c = r.g.t.counts(r.g.t.clusters, name)
	}
	last.Store(pc)
	return pc.c
}

func (r *relayConn) WriteTo(p []byte, addr net.Addr) (int, error) {
	n, err := r.PacketConn.WriteTo(p, addr)
	if n > 0 {
		if c := r.clusterOf(&r.lastTx, addr); c != nil {
			c.tx.add(n)
		}
	}
	return n, err
}

func (r *relayConn) ReadFrom(p []byte) (int, net.Addr, error) {
	n, addr, err := r.PacketConn.ReadFrom(p)
	if n > 0 {
		if c := r.clusterOf(&r.lastRx, addr); c != nil {
			c.rx.add(n)
		}
	}
	return n, addr, err
}

// Dir is one direction's packets and bytes.
type Dir struct{ Packets, Bytes uint64 }

// Stats are a listener's or cluster's counters in both directions.
type Stats struct{ Rx, Tx Dir }

// Totals are the listeners' and clusters' counters, by name.
type Totals struct {
	Listeners, Clusters map[string]Stats
	// Kernel is the part the XDP program relayed (STUNner's offload stats).
	KernelListeners, KernelClusters map[string]Stats
	// Conns and ConnsTotal are the listeners' open and all-time connections.
	Conns, ConnsTotal map[string]int64
}

// channelDataHeader is the ChannelData header the kernel path strips from or
// adds to each datagram: a listener's bytes are whole UDP payloads, a
// cluster's the application data. (A client's padding, at most 3 bytes a
// datagram and optional over UDP, is not in the kernel's counters.)
const channelDataHeader = 4

// Totals adds the kernel's per-account counters (from Maps.AccountTotals; nil
// without XDP) to the userspace ones.
func (t *Traffic) Totals(kernel map[string]channelmap.Stats) Totals {
	out := Totals{
		Listeners: map[string]Stats{}, Clusters: map[string]Stats{},
		KernelListeners: map[string]Stats{}, KernelClusters: map[string]Stats{},
		Conns: map[string]int64{}, ConnsTotal: map[string]int64{},
	}
	t.mu.Lock()
	for name, c := range t.listeners {
		out.Listeners[name] = c.stats()
		out.Conns[name], out.ConnsTotal[name] = c.conns.Load(), c.connsTotal.Load()
	}
	for name, c := range t.clusters {
		out.Clusters[name] = c.stats()
	}
	t.mu.Unlock()
	for acct, s := range kernel {
		l, c := splitAccount(acct)
		// Client->peer: received at the listener, sent to the cluster.
		ls := Stats{
			Rx: Dir{s.ClientToPeerPackets, s.ClientToPeerBytes + channelDataHeader*s.ClientToPeerPackets},
			Tx: Dir{s.PeerToClientPackets, s.PeerToClientBytes + channelDataHeader*s.PeerToClientPackets},
		}
		cs := Stats{Rx: Dir{s.PeerToClientPackets, s.PeerToClientBytes}, Tx: Dir{s.ClientToPeerPackets, s.ClientToPeerBytes}}
		if l != "" {
			out.Listeners[l] = out.Listeners[l].plus(ls)
			out.KernelListeners[l] = out.KernelListeners[l].plus(ls)
		}
		if c != "" {
			out.Clusters[c] = out.Clusters[c].plus(cs)
			out.KernelClusters[c] = out.KernelClusters[c].plus(cs)
		}
	}
	return out
}

func (c *counts) stats() Stats {
	return Stats{
		Rx: Dir{c.rx.packets.Load(), c.rx.bytes.Load()},
		Tx: Dir{c.tx.packets.Load(), c.tx.bytes.Load()},
	}
}

func (s Stats) plus(o Stats) Stats {
	return Stats{
		Rx: Dir{s.Rx.Packets + o.Rx.Packets, s.Rx.Bytes + o.Rx.Bytes},
		Tx: Dir{s.Tx.Packets + o.Tx.Packets, s.Tx.Bytes + o.Tx.Bytes},
	}
}
