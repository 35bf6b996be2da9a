package daemon

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"sync/atomic"

	"github.com/pion/turn/v4"

	"github.com/l7mp/stunnerd-xdp/internal/config"
	"github.com/l7mp/stunnerd-xdp/internal/control"
	"github.com/l7mp/stunnerd-xdp/internal/fallback"
	"github.com/l7mp/stunnerd-xdp/internal/handover"
	"github.com/l7mp/stunnerd-xdp/internal/logging"
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
		a.rest = turn.LongTermTURNRESTAuthHandler(cfg.Secret, lf.NewLogger("auth"))
	}
	return a
}

// listenerServer is one listener with its own pion/turn server, so that a
// reload can start, stop or restart it without touching the others' sessions.
type listenerServer struct {
	l      Listener
	server *turn.Server
	policy atomic.Pointer[control.PeerPolicy]
	ports  portState

	// The socket's steering slot, when the node's daemons share the port.
	group   handover.Group
	slot    uint32
	steered bool
}

func (d *Daemon) policyFor(l Listener) *control.PeerPolicy {
	cfg := d.config()
	allow := append(append([]netip.Prefix(nil), l.AllowPeers...), cfg.AllowPeers...)
	return control.NewPeerPolicy(allow, cfg.DenyPeers, l.Allowlist, cfg.Logger.Slog("auth"))
}

// startListener opens the listener's socket and starts its pion/turn server.
// Called with lmu held or before the daemon runs.
func (d *Daemon) startListener(l Listener) error {
	cfg := d.config()
	ls := &listenerServer{l: l}
	ls.policy.Store(d.policyFor(l))
	d.setPeerPorts(&ls.ports, l.PeerPorts)
	permit := func(client net.Addr, peer net.IP) bool { return ls.policy.Load().Handler(client, peer) }
	relay := &fallback.RelayAddressGenerator{
		RelayAddressGeneratorPortRange: turn.RelayAddressGeneratorPortRange{
			RelayAddress: net.IP(cfg.RelayAddress.AsSlice()),
			Address:      cfg.RelayAddress.String(),
			MinPort:      cfg.MinRelayPort,
			MaxPort:      cfg.MaxRelayPort,
		},
		Counters: d.counters,
	}
	gen := &portFilterGenerator{RelayAddressGenerator: relay, ps: &ls.ports}
	sc := turn.ServerConfig{
		Realm:              cfg.Realm,
		LoggerFactory:      cfg.Logger,
		ChannelBindTimeout: cfg.ChannelBindTimeout,
		AuthHandler:        d.authenticate,
		// While draining, new allocations get 486 (Allocation Quota Reached);
		// existing ones keep refreshing and relaying.
		QuotaHandler: func(username, _ string, src net.Addr) bool {
			if d.draining.Load() {
				cfg.Logger.Slog("auth").Info("allocation refused: draining", "user", username, "client", src.String())
				return false
			}
			return true
		},
	}
	// Only UDP listeners are mirrored into the maps. pion/turn v4 reports every
	// allocation as "UDP" (its five-tuples hard-code it), so a TCP client's
	// channel would otherwise be offloaded, and the kernel would answer a
	// TCP client with UDP datagrams it never reads.
	if l.Protocol == config.UDP {
		sc.EventHandler = d.mirror.EventHandler()
	}
	lc := d.listenConfig()
	addr := l.Addr.String()
	// pion/turn relays over IPv4 whatever the client's family; the listener
	// itself may be IPv6.
	udp, tcp := "udp4", "tcp4"
	if l.Addr.Addr().Is6() {
		udp, tcp = "udp6", "tcp6"
	}
	switch l.Protocol {
	case config.UDP:
		conn, err := lc.ListenPacket(context.Background(), udp, addr)
		if err != nil {
			return fmt.Errorf("listener %q: listen on udp %v: %w", l.Name, addr, err)
		}
		if err := d.steerSocket(ls, conn.(*net.UDPConn)); err != nil {
			conn.Close()
			return fmt.Errorf("listener %q: %w", l.Name, err)
		}
		sc.EventHandler = d.hooks.wrap(d.withDestinations(ls, d.withFlows(ls, withPeerPorts(&ls.ports, sc.EventHandler))))
		sc.PacketConnConfigs = []turn.PacketConnConfig{{
			PacketConn:            &fallback.ListenerConn{PacketConn: conn, Counters: d.counters},
			PermissionHandler:     permit,
			RelayAddressGenerator: gen,
		}}
	case config.TCP, config.TLS:
		ln, err := lc.Listen(context.Background(), tcp, addr)
		if err != nil {
			return fmt.Errorf("listener %q: listen on tcp %v: %w", l.Name, addr, err)
		}
		if err := d.steerSocket(ls, ln.(*net.TCPListener)); err != nil {
			ln.Close()
			return fmt.Errorf("listener %q: %w", l.Name, err)
		}
		if l.Protocol == config.TLS {
			ln = tls.NewListener(ln, &tls.Config{Certificates: []tls.Certificate{*l.Cert}, MinVersion: tls.VersionTLS12})
		}
		sc.ListenerConfigs = []turn.ListenerConfig{{
			Listener:              ln,
			PermissionHandler:     permit,
			RelayAddressGenerator: gen,
		}}
	default:
		return fmt.Errorf("listener %q: protocol %q is not supported", l.Name, l.Protocol)
	}
	srv, err := turn.NewServer(sc)
	if err != nil {
		d.unsteer(ls)
		for _, c := range sc.PacketConnConfigs {
			c.PacketConn.Close()
		}
		for _, c := range sc.ListenerConfigs {
			c.Listener.Close()
		}
		return fmt.Errorf("listener %q: start TURN server: %w", l.Name, err)
	}
	ls.server = srv
	d.listeners[l.Name] = ls
	path := "userspace"
	if l.Protocol == config.UDP {
		path = "xdp+userspace"
	}
	d.log.Info("TURN listener up", "listener", l.Name, "protocol", string(l.Protocol), "addr", addr, "path", path,
		"relay-address", cfg.RelayAddress.String(), "relay-ports", fmt.Sprintf("%d-%d", cfg.MinRelayPort, cfg.MaxRelayPort))
	return nil
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
	err := ls.server.Close()
	d.log.Info("TURN listener down", "listener", name)
	return err
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

// authenticate is the pion/turn AuthHandler over the current credentials.
func (d *Daemon) authenticate(username, realm string, src net.Addr) ([]byte, bool) {
	a := d.auth.Load()
	if a.rest != nil {
		return a.rest(username, realm, src)
	}
	key, ok := a.keys[username]
	if !ok {
		d.config().Logger.Slog("auth").Info("unknown user", "user", username, "client", src.String())
	}
	return key, ok
}
