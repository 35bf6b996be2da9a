package daemon

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/pion/turn/v4"

	"github.com/l7mp/stunnerd-xdp/internal/config"
	"github.com/l7mp/stunnerd-xdp/internal/handover"
	"github.com/l7mp/stunnerd-xdp/internal/logging"
	"github.com/l7mp/stunnerd-xdp/internal/peerpolicy"
	"github.com/l7mp/stunnerd-xdp/internal/quota"
	"github.com/l7mp/stunnerd-xdp/internal/turnguard"
	"github.com/l7mp/stunnerd-xdp/internal/udpio"
	"github.com/l7mp/stunnerd-xdp/internal/userspace"
)

// authState is the authentication in force; swapped atomically on reload so
// that live allocations are not touched.
type authState struct {
	realm string
	keys  map[string][]byte // static users
	rest  turn.AuthHandler  // ephemeral (TURN REST API) credentials
}

func newAuthState(cfg Config, lf *logging.Factory) *authState {
	a := &authState{realm: cfg.Realm, keys: map[string][]byte{}}
	for u, p := range cfg.Users {
		a.keys[u] = turn.GenerateAuthKey(u, cfg.Realm, p)
	}
	if cfg.Secret != "" {
		// stunnerd's username forms (USER:EXPIRY too); it logs every
		// malformed or expired username: rate-limited.
		a.rest = restAuthHandler(cfg.Secret, time.Now, lf.Limited("auth"))
	}
	return a
}

// listenerServer is one listener with its own pion/turn servers, so that a
// reload can start, stop or restart it without touching the others' sessions.
// A UDP listener has one socket per read loop (Config.UDPThreadNum), bound
// with SO_REUSEPORT, each served by its own pion/turn server: pion keeps the
// allocations of each socket apart, and the kernel's reuseport hash (or the
// steering) keeps a client's 4-tuple on the socket that holds its allocation.
type listenerServer struct {
	l       config.ResolvedListener
	servers []*turn.Server
	// quotas[i] is servers[i]'s identity for the quota counter.
	quotas []quota.Server
	policy atomic.Pointer[peerpolicy.Policy]
	ports  portState

	// The sockets' steering slots, when the node's daemons share the port.
	group   handover.Group
	slots   []uint32
	steered bool
}

func (d *Daemon) policyFor(l config.ResolvedListener) *peerpolicy.Policy {
	cfg := d.config()
	allow := append(append([]netip.Prefix(nil), l.AllowPeers...), cfg.AllowPeers...)
	return peerpolicy.New(allow, cfg.DenyPeers, l.Allowlist, &d.clusterNets, d.strangerLog)
}

// startListener opens the listener's socket and starts its pion/turn server.
// Called with lmu held or before the daemon runs.
func (d *Daemon) startListener(l config.ResolvedListener) error {
	cfg := d.config()
	ls := &listenerServer{l: l}
	ls.policy.Store(d.policyFor(l))
	ls.ports.policy, ls.ports.userOK = &ls.policy, d.userKnown
	d.setPeerPorts(&ls.ports, l.PeerPorts)
	permit := func(client net.Addr, peer net.IP) bool { return ls.policy.Load().Handler(client, peer) }
	relays := userspace.NewRelaySockets()
	relay := d.traffic.RelayAddressGenerator(l.Name, &userspace.RelayAddressGenerator{
		RelayAddressGeneratorPortRange: turn.RelayAddressGeneratorPortRange{
			RelayAddress: net.IP(cfg.RelayAddress.AsSlice()),
			Address:      cfg.RelayAddress.String(),
			MinPort:      cfg.MinRelayPort,
			MaxPort:      cfg.MaxRelayPort,
		},
		Counters:    d.counters,
		RateLimiter: d.rateLimit,
		Sockets:     relays,
	})
	// Outermost, so that the shortcut writes to relay sockets as pion does.
	gen := relays.Generator(&portFilterGenerator{RelayAddressGenerator: relay, ps: &ls.ports})
	sc := turn.ServerConfig{
		Realm: cfg.Realm,
		// pion logs requests and datagrams anyone can send (a datagram to a
		// relay port without a permission, a refused peer): rate-limited.
		LoggerFactory:      cfg.Logger.LimitedFactory(),
		ChannelBindTimeout: cfg.ChannelBindTimeout,
		AuthHandler:        d.authenticate,
	}
	// Only UDP listeners are mirrored into the maps. pion/turn v4 reports every
	// allocation as "UDP" (its five-tuples hard-code it), so a TCP client's
	// channel would otherwise be offloaded, and the kernel would answer a
	// TCP client with UDP datagrams it never reads.
	if l.Protocol == config.UDP {
		sc.EventHandler = d.mirror.EventHandler()
	}
	lc := d.listenConfig(l.Protocol == config.UDP && d.udpThreads() > 1)
	addr := l.Addr.String()
	var scs []turn.ServerConfig
	// guards[i] checks what scs[i]'s server reads (turnguard): 441 and nonce
	// expiry, which pion/turn v4 leaves out.
	var guards []*turnguard.Guard
	// pion/turn relays over IPv4 whatever the client's family; the listener
	// itself may be IPv6.
	udp, tcp := "udp4", "tcp4"
	if l.Addr.Addr().Is6() {
		udp, tcp = "udp6", "tcp6"
	}
	switch l.Protocol {
	case config.UDP:
		conns, err := d.listenUDP(ls, lc, udp, addr)
		if err != nil {
			return fmt.Errorf("listener %q: %w", l.Name, err)
		}
		// One port filter for all the listener's sockets: the channels it
		// holds back are the listener's.
		base := withPeerPorts(&ls.ports, sc.EventHandler)
		scs = make([]turn.ServerConfig, len(conns))
		for i, conn := range conns {
			scs[i] = sc
			guards = append(guards, turnguard.New(d.authenticate, &d.guarded))
			scs[i].EventHandler = d.hooks.wrap(d.withDestinations(ls, d.withFlows(ls, i, base)))
			// The table also carries the IP header fields across pion
			// (TTL, TOS), with the shortcut or without.
			chans := userspace.NewChannels(relays, d.counters)
			scs[i].EventHandler = chans.EventHandler(scs[i].EventHandler)
			scs[i].PacketConnConfigs = []turn.PacketConnConfig{{
				PacketConn: guards[i].PacketConn(&userspace.ListenerConn{PacketConn: d.traffic.ListenerConn(l.Name, chans.ListenerSocket(conn)),
					Counters: d.counters, Channels: chans, NoShortcut: cfg.NoShortcut}),
				PermissionHandler:     permit,
				RelayAddressGenerator: gen,
			}}
		}
	case config.TCP, config.TLS:
		ln, err := lc.Listen(context.Background(), tcp, addr)
		if err != nil {
			return fmt.Errorf("listener %q: listen on tcp %v: %w", l.Name, addr, err)
		}
		if err := d.steerSockets(ls, ln.(*net.TCPListener)); err != nil {
			ln.Close()
			return fmt.Errorf("listener %q: %w", l.Name, err)
		}
		var tlsConf *tls.Config
		if l.Protocol == config.TLS {
			tlsConf = &tls.Config{Certificates: []tls.Certificate{*l.Cert}, MinVersion: tls.VersionTLS12}
		}
		// Connection caps, deadlines and bounded frames (connlimit): pion
		// has none, and anyone can connect.
		guards = append(guards, turnguard.New(d.authenticate, &d.guarded))
		ln = d.conns.Listener(ln, tlsConf, guards[0].Filter)
		ln = d.traffic.Listener(l.Name, ln)
		sc.ListenerConfigs = []turn.ListenerConfig{{
			Listener:              ln,
			PermissionHandler:     permit,
			RelayAddressGenerator: gen,
		}}
		scs = []turn.ServerConfig{sc}
	default:
		return fmt.Errorf("listener %q: protocol %q is not supported", l.Name, l.Protocol)
	}
	for i := range scs {
		// The quotas count across every listener and read loop; the
		// permission limit per allocation.
		qs := d.quota.NewServer()
		ls.quotas = append(ls.quotas, qs)
		scs[i].QuotaHandler = d.quotaHandler(qs)
		scs[i].EventHandler = d.withQuota(qs, scs[i].EventHandler)
		guards[i].MaxChannels = cfg.MaxChannels
		// A refused peer gets 403 before pion, which answers its
		// permission handler's refusal without an error code.
		guards[i].Peers = permit
		scs[i].EventHandler = guards[i].Hooks(scs[i].EventHandler)
		scs[i].EventHandler = withAllocationUsers(&ls.ports, scs[i].EventHandler)
		// Outermost, so that every hook above sees one allocation per
		// five-tuple at a time.
		scs[i].EventHandler = new(replacements).wrap(scs[i].EventHandler)
		// pion's own events, as it reports them: the relay sockets charge
		// the rate limit only for what pion relays (its permissions and
		// channels), whatever the hooks above do with them.
		scs[i].EventHandler = relays.PeerHooks(scs[i].EventHandler)
		for j, c := range scs[i].PacketConnConfigs {
			scs[i].PacketConnConfigs[j].PermissionHandler = d.limitPermissions(qs, c.PermissionHandler)
		}
		for j, c := range scs[i].ListenerConfigs {
			scs[i].ListenerConfigs[j].PermissionHandler = d.limitPermissions(qs, c.PermissionHandler)
		}
	}
	for i, sc := range scs {
		srv, err := turn.NewServer(sc)
		if err != nil {
			d.unsteer(ls)
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
	d.listeners[l.Name] = ls
	path := "userspace"
	if l.Protocol == config.UDP {
		path = "xdp+userspace"
	}
	d.log.Info("TURN listener up", "listener", l.Name, "protocol", string(l.Protocol), "addr", addr, "path", path, "read-loops", len(ls.servers),
		"relay-address", cfg.RelayAddress.String(), "relay-ports", fmt.Sprintf("%d-%d", cfg.MinRelayPort, cfg.MaxRelayPort))
	return nil
}

// listenUDP opens the sockets of a UDP listener, one per read loop, and
// registers them for steering.
func (d *Daemon) listenUDP(ls *listenerServer, lc net.ListenConfig, network, addr string) ([]net.PacketConn, error) {
	conns := make([]net.PacketConn, d.udpThreads())
	closeAll := func() {
		for _, c := range conns {
			if c != nil {
				c.Close()
			}
		}
	}
	if len(conns) > 1 && d.steer == nil {
		// Sockets bound with SO_REUSEPORT let any later one of the same user
		// join them, and a second daemon would take a share of the clients:
		// without the steering the port stays exclusive, as with one socket.
		// A bind without SO_REUSEPORT fails while anyone holds the port.
		excl := d.listenConfig(false)
		probe, err := excl.ListenPacket(context.Background(), network, addr)
		if err != nil {
			return nil, fmt.Errorf("listen on udp %v: %w", addr, err)
		}
		probe.Close()
	}
	scs := make([]syscall.Conn, len(conns))
	for i := range conns {
		c, err := lc.ListenPacket(context.Background(), network, addr)
		if err != nil {
			closeAll()
			return nil, fmt.Errorf("listen on udp %v (socket %d of %d): %w", addr, i+1, len(conns), err)
		}
		scs[i] = c.(*net.UDPConn)
		// pion reads one datagram per call; the socket underneath is read a
		// batch per recvmmsg, with no allocation per datagram.
		if conns[i], err = udpio.NewBatchConn(c); err != nil {
			c.Close()
			closeAll()
			return nil, err
		}
	}
	if err := d.steerSockets(ls, scs...); err != nil {
		closeAll()
		return nil, err
	}
	return conns, nil
}

// stopListener closes one listener and its allocations (pion reports their
// deletion, and the mirror removes their bindings).
func (d *Daemon) stopListener(name string) error {
	ls, ok := d.listeners[name]
	if !ok {
		return nil
	}
	delete(d.listeners, name)
	d.unsteer(ls)
	var errs []error
	for _, srv := range ls.servers {
		errs = append(errs, srv.Close())
	}
	d.log.Info("TURN listener down", "listener", name)
	return errors.Join(errs...)
}

func (d *Daemon) closeListeners() {
	d.lmu.Lock()
	defer d.lmu.Unlock()
	for name := range d.listeners {
		if err := d.stopListener(name); err != nil && !errors.Is(err, net.ErrClosed) {
			d.log.Warn("closing listener", "listener", name, "error", err)
		}
	}
}

// userKnown says whether user may still relay under the current
// credentials: a static user the configuration still has. Ephemeral
// credentials name no users to remove (a new secret leaves live
// allocations, as in STUNner).
func (d *Daemon) userKnown(user string) bool {
	a := d.auth.Load()
	if a.rest != nil {
		return true
	}
	_, ok := a.keys[user]
	return ok
}

// authenticate is the pion/turn AuthHandler over the current credentials.
func (d *Daemon) authenticate(username, realm string, src net.Addr) ([]byte, bool) {
	a := d.auth.Load()
	if a.rest != nil {
		return a.rest(username, realm, src)
	}
	key, ok := a.keys[username]
	if !ok {
		d.strangerLog.Info("unknown user", "user", username, "client", src.String())
	}
	return key, ok
}
