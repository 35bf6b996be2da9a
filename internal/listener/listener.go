// Package listener runs the TURN listeners: each listener's sockets and its
// pion/turn servers, built from explicit dependencies (Deps) through one
// ordered chain of hooks, relay address generators and connections
// (Set.serverConfigs). A reload changes a listener in place or restarts it
// (Set.Prune, Set.Apply).
package listener

import (
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"sync/atomic"
	"time"

	"github.com/pion/turn/v4"

	"github.com/l7mp/stunnerd-xdp/internal/allocflows"
	"github.com/l7mp/stunnerd-xdp/internal/config"
	"github.com/l7mp/stunnerd-xdp/internal/connlimit"
	"github.com/l7mp/stunnerd-xdp/internal/credentials"
	"github.com/l7mp/stunnerd-xdp/internal/destinations"
	"github.com/l7mp/stunnerd-xdp/internal/logging"
	"github.com/l7mp/stunnerd-xdp/internal/metrics"
	"github.com/l7mp/stunnerd-xdp/internal/peerpolicy"
	"github.com/l7mp/stunnerd-xdp/internal/quota"
	"github.com/l7mp/stunnerd-xdp/internal/shield"
	"github.com/l7mp/stunnerd-xdp/internal/steering"
	"github.com/l7mp/stunnerd-xdp/internal/turnguard"
	"github.com/l7mp/stunnerd-xdp/internal/userspace"
)

// Deps are what the listeners' servers report to and ask; they live as long
// as the Set.
type Deps struct {
	Logger      *logging.Factory
	Credentials *credentials.Store
	// Mirror is the end of every UDP listener's hook chain (mirror.Mirror's
	// EventHandler): only UDP listeners are mirrored into the maps. pion/turn
	// v4 reports every allocation as "UDP" (its five-tuples hard-code it), so
	// a TCP client's channel would otherwise be offloaded, and the kernel
	// would answer a TCP client with UDP datagrams it never reads.
	Mirror turn.EventHandler
	// Destinations learns the VIPs UDP clients come through.
	Destinations *destinations.Tracker
	// Steering shares the listener ports with the node's other daemons
	// (nil: the ports are bound exclusively).
	Steering *steering.Steering
	// Allocations is the listener shield's table of UDP allocations (nil:
	// none, the shield tests no allocation).
	Allocations *allocflows.Table
	// Shield is the read loops' listener shield (nil: off).
	Shield      *shield.Shield
	Quota       *quota.Counter
	Permissions *quota.Permissions
	// Draining says whether new allocations are refused (486).
	Draining func() bool
	// Conns bounds the TCP and TLS listeners' clients, over all of them.
	Conns *connlimit.Limiter
	// Guarded counts what the listeners' turnguards refused.
	Guarded *turnguard.Counts
	// Counters and RateLimit are the userspace path's.
	Counters  *userspace.Counters
	RateLimit *userspace.RateLimiter
	Traffic   *metrics.Traffic
	// ClusterNets are the cluster networks learned from the Kubernetes API,
	// refused as peers unless allowed.
	ClusterNets *peerpolicy.Learned
}

// Settings are the daemon-wide settings every listener runs with; a reload
// passes the new ones to Apply (the relay address and ports and the socket
// settings only take effect for listeners started after it).
type Settings struct {
	Realm                      string
	RelayAddress               netip.Addr
	MinRelayPort, MaxRelayPort uint16
	// ChannelBindTimeout overrides pion/turn's 10-minute channel lifetime.
	ChannelBindTimeout time.Duration
	// SocketBuffer is the receive and send buffer of the listener sockets.
	SocketBuffer int
	// ReadLoops is the number of sockets, each with its pion/turn server,
	// of a UDP listener.
	ReadLoops int
	// NoShortcut leaves every datagram that reaches userspace to pion/turn's
	// own handlers (userspace.ListenerConn, userspace.Replies).
	NoShortcut bool
	// MaxChannels bounds the channels one allocation holds (0: no limit).
	MaxChannels int
	// AllowPeers and DenyPeers are the peer access control applied to every
	// listener, beside its own (peerpolicy.Policy).
	AllowPeers, DenyPeers []netip.Prefix
}

// Listener is one listener with its own pion/turn servers, so that a reload
// can start, stop or restart it without touching the others' sessions. A UDP
// listener has one socket per read loop (Settings.ReadLoops), bound with
// SO_REUSEPORT, each served by its own pion/turn server: pion keeps the
// allocations of each socket apart, and the kernel's reuseport hash (or the
// steering) keeps a client's 4-tuple on the socket that holds its allocation.
type Listener struct {
	l       config.ResolvedListener
	servers []*turn.Server
	// quotas[i] is servers[i]'s identity for the quota counter.
	quotas []quota.Server
	policy atomic.Pointer[peerpolicy.Policy]
	ports  portState

	// The sockets' steering slots, when the node's daemons share the port.
	group   steering.Group
	slots   []uint32
	steered bool
}

// start opens the listener's sockets and starts its pion/turn servers.
// Called with mu held or before the set serves.
func (s *Set) start(st Settings, l config.ResolvedListener) error {
	ls := &Listener{l: l}
	scs, err := s.serverConfigs(st, ls)
	if err != nil {
		return fmt.Errorf("listener %q: %w", l.Name, err)
	}
	// Before the servers start: their permission handlers, hooks and relay
	// sockets read the policy and the port ranges.
	ls.ports.policy, ls.ports.userOK = &ls.policy, s.deps.Credentials.Known
	s.configure(st, ls, l)
	for i, sc := range scs {
		srv, err := turn.NewServer(sc)
		if err != nil {
			s.unsteer(ls)
			for _, srv := range ls.servers {
				srv.Close()
			}
			for _, sc := range scs[i:] {
				for _, c := range sc.PacketConnConfigs {
					c.PacketConn.Close()
				}
				for _, c := range sc.ListenerConfigs {
					c.Listener.Close()
				}
			}
			return fmt.Errorf("listener %q: start TURN server: %w", l.Name, err)
		}
		ls.servers = append(ls.servers, srv)
	}
	s.byName[l.Name] = ls
	// Whether its channels are relayed in the kernel is the daemon's to say
	// (the "kernel" line, path=): nothing is attached yet, and may never be.
	s.log.Info("TURN listener up", "listener", l.Name, "protocol", string(l.Protocol), "addr", l.Addr.String(),
		"kernel-path-eligible", l.Protocol == config.UDP, "read-loops", len(ls.servers),
		"relay-address", st.RelayAddress.String(), "relay-ports", fmt.Sprintf("%d-%d", st.MinRelayPort, st.MaxRelayPort))
	return nil
}

// stage is one link of a server's hook chain: it returns h behind itself.
type stage func(h turn.EventHandler) turn.EventHandler

// serverConfigs builds the pion/turn servers of ls, one per socket, and is
// the one place that orders what stands between pion and the rest of the
// daemon: the connections pion reads (outermost first), the relay address
// generator it allocates from, and the hooks its reports pass through.
func (s *Set) serverConfigs(st Settings, ls *Listener) ([]turn.ServerConfig, error) {
	l := ls.l
	permit := func(client net.Addr, peer net.IP) bool { return ls.policy.Load().Handler(client, peer) }
	// Relay sockets, outermost first: the shortcut's table (it writes to
	// relay sockets as pion does), the peer port ranges and revocations,
	// the traffic accounting, the userspace path's counters and rate limit.
	relays := userspace.NewRelaySockets()
	gen := relays.Generator(&portFilterGenerator{ps: &ls.ports,
		RelayAddressGenerator: s.deps.Traffic.RelayAddressGenerator(l.Name, &userspace.RelayAddressGenerator{
			RelayAddressGeneratorPortRange: turn.RelayAddressGeneratorPortRange{
				RelayAddress: net.IP(st.RelayAddress.AsSlice()),
				Address:      st.RelayAddress.String(),
				MinPort:      st.MinRelayPort,
				MaxPort:      st.MaxRelayPort,
			},
			Counters:    s.deps.Counters,
			RateLimiter: s.deps.RateLimit,
			Sockets:     relays,
		})})
	sc := turn.ServerConfig{
		Realm: st.Realm,
		// pion logs requests and datagrams anyone can send (a datagram to a
		// relay port without a permission, a refused peer): rate-limited.
		LoggerFactory:      s.deps.Logger.LimitedFactory(),
		ChannelBindTimeout: st.ChannelBindTimeout,
		AuthHandler:        s.deps.Credentials.Authenticate,
	}
	lc := s.listenConfig(st, l.Protocol == config.UDP && st.ReadLoops > 1)
	// pion/turn relays over IPv4 whatever the client's family; the listener
	// itself may be IPv6.
	udp, tcp := "udp4", "tcp4"
	if l.Addr.Addr().Is6() {
		udp, tcp = "udp6", "tcp6"
	}
	// One port filter for all the listener's sockets: the channels it holds
	// back are the listener's. It is the last stage before the mirror.
	var mirror turn.EventHandler
	if l.Protocol == config.UDP {
		mirror = s.deps.Mirror
	}
	base := ls.ports.withPeerPorts(mirror)
	var scs []turn.ServerConfig
	switch l.Protocol {
	case config.UDP:
		conns, err := s.listenUDP(st, ls, lc, udp, l.Addr.String())
		if err != nil {
			return nil, err
		}
		for i, conn := range conns {
			// 441 and nonce expiry, which pion/turn v4 leaves out, and the
			// channel cap; a refused peer gets 403 before pion, which
			// answers its permission handler's refusal without an error code.
			guard := s.guard(st, permit)
			// The table also carries the IP header fields across pion
			// (TTL, TOS), with the shortcut or without.
			chans := userspace.NewChannels(relays, s.deps.Counters)
			ls.quotas = append(ls.quotas, s.deps.Quota.NewServer())
			// Listener sockets, outermost first: the request checks, the
			// counters and the client->peer shortcut, the traffic
			// accounting, the header-field table, the batched socket.
			pc := guard.PacketConn(&userspace.ListenerConn{
				PacketConn: s.deps.Traffic.ListenerConn(l.Name, chans.ListenerSocket(conn)),
				Counters:   s.deps.Counters, Channels: chans, NoShortcut: st.NoShortcut, Shield: s.deps.Shield.Listener(l.Addr)})
			// The peer->client shortcut writes to the listener socket as
			// pion holds it; it learns each allocation's client from pion's
			// own report, before every other stage.
			var replies stage
			if !st.NoShortcut {
				replies = userspace.NewReplies(relays, pc, s.deps.Counters).EventHandler
			}
			c := sc
			c.EventHandler = s.hooks(replies, ls.quotas[i], relays, guard, &ls.ports,
				chans.EventHandler, s.gate.wrap, s.destinationHooks(ls), s.flowHooks(ls, i), s.allocationHooks(ls))(base)
			c.PacketConnConfigs = []turn.PacketConnConfig{{
				PacketConn:            pc,
				PermissionHandler:     s.limitPermissions(ls.quotas[i], permit),
				RelayAddressGenerator: gen,
			}}
			scs = append(scs, c)
		}
	case config.TCP, config.TLS, config.DTLS:
		ln, err := s.listenConns(ls, lc, tcp, udp)
		if err != nil {
			return nil, err
		}
		var tlsConf *tls.Config
		if l.Protocol == config.TLS {
			tlsConf = &tls.Config{Certificates: []tls.Certificate{*l.Cert}, MinVersion: tls.VersionTLS12}
		}
		guard := s.guard(st, permit)
		ls.quotas = append(ls.quotas, s.deps.Quota.NewServer())
		sc.EventHandler = s.hooks(nil, ls.quotas[0], relays, guard, &ls.ports)(base)
		// Connection caps, deadlines, the (D)TLS handshake's timeout and
		// bounded frames (connlimit): pion has none, and anyone can connect.
		sc.ListenerConfigs = []turn.ListenerConfig{{
			Listener:              s.deps.Traffic.Listener(l.Name, s.deps.Conns.Listener(ln, tlsConf, guard.Filter)),
			PermissionHandler:     s.limitPermissions(ls.quotas[0], permit),
			RelayAddressGenerator: gen,
		}}
		scs = []turn.ServerConfig{sc}
	default:
		return nil, fmt.Errorf("protocol %q is not supported", l.Protocol)
	}
	for i := range scs {
		scs[i].QuotaHandler = s.quotaHandler(ls.quotas[i])
	}
	return scs, nil
}

// guard is a turnguard for one server.
func (s *Set) guard(st Settings, permit turn.PermissionHandler) *turnguard.Guard {
	g := turnguard.New(s.deps.Credentials.Authenticate, s.deps.Guarded)
	g.MaxChannels = st.MaxChannels
	g.Peers = permit
	return g
}

// hooks is the hook chain of server qs, first stage first; outer (nil:
// none) comes before every other stage, inner are the protocol's own stages,
// between the common ones and the port filter (base). Every stage sees a
// report before the stages after it:
//   - outer: for UDP the peer->client shortcut (userspace.Replies), which
//     learns each allocation's client as pion reports it;
//   - the relay sockets' permission and channel tables take pion's events
//     as it reports them: the sockets charge the rate limit only for what
//     pion relays, whatever the stages after do with its reports;
//   - replacements puts each five-tuple's reports in order (one allocation
//     at a time) for every stage after it;
//   - the relay sockets learn their allocation's username (revocation of a
//     user a reload removes);
//   - the turnguard counts channels (its cap);
//   - the quota counts the allocations and permissions pion granted;
//   - inner: for UDP the shortcut's table, the gate (nothing after it runs
//     once the daemon closed what they write to), the destinations tracker
//     and the steering flow of each client.
func (s *Set) hooks(outer stage, qs quota.Server, relays *userspace.RelaySockets, guard *turnguard.Guard, ps *portState, inner ...stage) stage {
	stages := append([]stage{
		outer,
		relays.PeerHooks,
		new(replacements).wrap,
		ps.withAllocationUsers,
		guard.Hooks,
		s.quotaHooks(qs),
	}, inner...)
	return func(h turn.EventHandler) turn.EventHandler {
		for j := len(stages) - 1; j >= 0; j-- {
			if stages[j] != nil {
				h = stages[j](h)
			}
		}
		return h
	}
}

// stop closes one listener and its allocations (pion reports their
// deletion, and the mirror removes their bindings). Called with mu held.
func (s *Set) stop(name string) error {
	ls, ok := s.byName[name]
	if !ok {
		return nil
	}
	delete(s.byName, name)
	s.unsteer(ls)
	var errs []error
	for _, srv := range ls.servers {
		errs = append(errs, srv.Close())
	}
	s.log.Info("TURN listener down", "listener", name)
	return errors.Join(errs...)
}
