// Package daemon assembles stunnerd-xdp: the pion/turn server, the mirror of its
// channel bindings into the XDP maps, the loader and the switch between the
// kernel and userspace paths, metrics and health.
package daemon

import (
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/l7mp/stunnerd-xdp/internal/channelmap"
	"github.com/l7mp/stunnerd-xdp/internal/config"
	"github.com/l7mp/stunnerd-xdp/internal/control"
	"github.com/l7mp/stunnerd-xdp/internal/fallback"
	"github.com/l7mp/stunnerd-xdp/internal/handover"
	"github.com/l7mp/stunnerd-xdp/internal/loader"
	"github.com/l7mp/stunnerd-xdp/internal/logging"
)

// Config is everything the daemon runs on.
type Config struct {
	// Listen is the shorthand for one UDP listener (the URI mode); it is
	// used when Listeners is empty. May be a wildcard.
	Listen netip.AddrPort
	// Listeners are the TURN listeners (from a STUNner config).
	Listeners []Listener
	// Users are static long-term credentials (username -> password).
	Users map[string]string
	// Secret, when set, switches to ephemeral TURN REST API credentials.
	Secret string
	Realm  string
	// RelayAddress is the IP relay sockets bind to and packets to peers come from.
	RelayAddress               netip.Addr
	MinRelayPort, MaxRelayPort uint16

	// AllowPeers and DenyPeers are the peer access control applied to every
	// listener (see control.PeerPolicy); by default loopback, link-local,
	// multicast and the node's own addresses are refused.
	AllowPeers, DenyPeers []netip.Prefix
	// NoOffloadPeers are relayed in userspace only (see natgate.go); the
	// cluster's Service CIDRs join them when the Kubernetes API lists them.
	NoOffloadPeers []netip.Prefix

	XDPMode     loader.Mode
	Interfaces  []string // empty: those carrying the listener and relay addresses
	MaxBindings uint32

	MetricsAddr string // empty: no metrics server
	HealthAddr  string // empty: no health server
	// HealthSocket is a unix socket serving the health endpoints for this
	// process only (exec probes while another daemon holds HealthAddr).
	HealthSocket string
	ForceReady   bool

	// HandoverDir is the bpffs directory under which the daemons of a node
	// share listener steering (one subdirectory per network namespace);
	// empty: listeners are bound exclusively.
	HandoverDir string
	// XDPRetryInterval is how often an XDP attach that failed is retried.
	XDPRetryInterval time.Duration

	// ChannelBindTimeout overrides pion/turn's 10-minute channel lifetime.
	ChannelBindTimeout time.Duration
	// ReconcileInterval is how often the maps are compared with pion's state.
	ReconcileInterval time.Duration
	// SocketBuffer is the receive and send buffer of the listener sockets.
	SocketBuffer int
	// UDPThreadNum is the number of userspace readloops per UDP listener
	// (stunnerd's --udp-thread-num); 0: one per CPU.
	UDPThreadNum int

	Logger *logging.Factory
}

// Listener is one TURN listener. UDP listeners are relayed by XDP (up to 8);
// TCP and TLS ones by pion/turn in userspace.
type Listener struct {
	Name     string
	Protocol config.Protocol
	Addr     netip.AddrPort
	Cert     *tls.Certificate // TLS only
	// AllowPeers admits peers (STUNner's clusters); with Allowlist, peers
	// outside them are refused even when AllowPeers is empty.
	AllowPeers []netip.Prefix
	Allowlist  bool
	// PeerPorts are the cluster endpoints with their port ranges: a peer
	// address they cover is relayed to on their ports only (peerports.go).
	PeerPorts []config.Endpoint
}

func (l Listener) equalSocket(o Listener) bool {
	if l.Name != o.Name || l.Protocol != o.Protocol || l.Addr != o.Addr || (l.Cert == nil) != (o.Cert == nil) {
		return false
	}
	return l.Cert == nil || string(l.Cert.Certificate[0]) == string(o.Cert.Certificate[0])
}

// Defaults for the zero fields of Config.
const (
	DefaultRealm             = "stunner.l7mp.io"
	DefaultMinRelayPort      = 49152
	DefaultMaxRelayPort      = 65535
	DefaultMaxBindings       = 131072
	DefaultReconcileInterval = 10 * time.Second
	DefaultSocketBuffer      = 4 << 20
	DefaultXDPRetryInterval  = 2 * time.Second
)

func (c *Config) validate() error {
	if len(c.Listeners) == 0 {
		if !c.Listen.IsValid() || c.Listen.Port() == 0 {
			return fmt.Errorf("invalid listener address %v", c.Listen)
		}
		c.Listeners = []Listener{{Name: "default", Protocol: config.UDP, Addr: c.Listen}}
	}
	names := map[string]bool{}
	udp := 0
	for i, l := range c.Listeners {
		l.Addr = netip.AddrPortFrom(l.Addr.Addr().Unmap(), l.Addr.Port())
		c.Listeners[i] = l
		switch {
		case l.Name == "":
			return fmt.Errorf("listener %d has no name", i)
		case names[l.Name]:
			return fmt.Errorf("listener %q is defined twice", l.Name)
		case !l.Addr.IsValid() || l.Addr.Port() == 0:
			return fmt.Errorf("listener %q: invalid address %v", l.Name, l.Addr)
		case l.Protocol == config.TLS && l.Cert == nil:
			return fmt.Errorf("listener %q: TLS needs a certificate", l.Name)
		case l.Protocol != config.UDP && l.Protocol != config.TCP && l.Protocol != config.TLS:
			return fmt.Errorf("listener %q: protocol %q is not supported", l.Name, l.Protocol)
		}
		names[l.Name] = true
		if l.Protocol == config.UDP {
			udp++
		}
	}
	if udp > 8 {
		return fmt.Errorf("%d UDP listeners: XDP serves at most 8", udp)
	}
	if len(c.Users) == 0 && c.Secret == "" {
		return errors.New("no TURN credentials: give them in the URI as turn://USER:PASS@ADDR:PORT or in the config's auth")
	}
	if c.Realm == "" {
		c.Realm = DefaultRealm
	}
	if !c.RelayAddress.IsValid() || c.RelayAddress.IsUnspecified() {
		for _, l := range c.Listeners {
			if a := l.Addr.Addr(); !a.IsUnspecified() && a.Is4() {
				c.RelayAddress = l.Addr.Addr()
				break
			}
		}
		if !c.RelayAddress.IsValid() || c.RelayAddress.IsUnspecified() {
			return errors.New("no listener is on a specific IPv4 address: set --relay-address to the IPv4 address relayed traffic leaves from")
		}
	}
	c.RelayAddress = c.RelayAddress.Unmap()
	if !c.RelayAddress.Is4() {
		return fmt.Errorf("relay address %v: relays are IPv4 (clients may use IPv6)", c.RelayAddress)
	}
	if c.MinRelayPort == 0 {
		c.MinRelayPort = DefaultMinRelayPort
	}
	if c.MaxRelayPort == 0 {
		c.MaxRelayPort = DefaultMaxRelayPort
	}
	if c.MaxRelayPort < c.MinRelayPort {
		return fmt.Errorf("relay port range %d-%d is empty", c.MinRelayPort, c.MaxRelayPort)
	}
	for _, l := range c.Listeners {
		if p := l.Addr.Port(); p >= c.MinRelayPort && p <= c.MaxRelayPort {
			return fmt.Errorf("listener %q port %d is inside the relay port range %d-%d", l.Name, p, c.MinRelayPort, c.MaxRelayPort)
		}
	}
	if c.XDPMode == "" {
		c.XDPMode = loader.ModeAuto
	}
	if c.MaxBindings == 0 {
		c.MaxBindings = DefaultMaxBindings
	}
	if c.ReconcileInterval == 0 {
		c.ReconcileInterval = DefaultReconcileInterval
	}
	if c.XDPRetryInterval == 0 {
		c.XDPRetryInterval = DefaultXDPRetryInterval
	}
	if c.SocketBuffer == 0 {
		c.SocketBuffer = DefaultSocketBuffer
	}
	if c.Logger == nil {
		return errors.New("no logger")
	}
	return nil
}

// ipv6Listeners reports whether a UDP listener may take IPv6 clients.
func (c *Config) ipv6Listeners() bool {
	for _, l := range c.Listeners {
		if l.Protocol == config.UDP && l.Addr.Addr().Is6() {
			return true
		}
	}
	return false
}

// loaderConfig is the XDP program's load-time configuration.
func (c *Config) loaderConfig() loader.Config {
	return loader.Config{
		ListenerPorts: c.udpPorts(),
		IPv6Clients:   c.ipv6Listeners(),
		MinRelayPort:  c.MinRelayPort,
		MaxRelayPort:  c.MaxRelayPort,
		MaxBindings:   c.MaxBindings,
	}
}

// udpPorts are the ports of the UDP listeners: the XDP program's listener ports.
func (c *Config) udpPorts() []uint16 {
	var ports []uint16
	seen := map[uint16]bool{}
	for _, l := range c.Listeners {
		if l.Protocol == config.UDP && !seen[l.Addr.Port()] {
			seen[l.Addr.Port()] = true
			ports = append(ports, l.Addr.Port())
		}
	}
	return ports
}

// Daemon is a running stunnerd-xdp.
type Daemon struct {
	// cfg is the running configuration: a snapshot that is never modified,
	// replaced whole by Reconfigure; readers take it with config().
	cfg    atomic.Pointer[Config]
	log    *slog.Logger
	mirror *control.Mirror
	hooks  hookGate // pion's hooks into the mirror and the steering
	auth   atomic.Pointer[authState]

	lmu        sync.Mutex // guards listeners and cfg.Listeners
	listeners  map[string]*listenerServer
	sw         *fallback.Switch
	dests      *destinationSync
	modeMu     sync.Mutex   // serialises SetMode and the attach retry
	handedOver bool         // under modeMu: XDP given up for a successor
	want       atomic.Value // loader.Mode asked for by --xdp-mode or the node label
	steer      *handover.Steering
	counters   *fallback.Counters
	registry   *prometheus.Registry
	https      []*http.Server
	stop       chan struct{}
	linkEvents chan struct{} // a network interface changed: retry the attach now
	wg         sync.WaitGroup

	nodeWatcher atomic.Pointer[control.NodeWatcher]
	draining    atomic.Bool
	drained     chan struct{} // closed by Drain when the last allocation is gone

	closeOnce sync.Once
}

// Start builds and starts the daemon. XDP problems never stop it: it serves
// from userspace instead and says why.
func Start(cfg Config) (*Daemon, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	d := &Daemon{
		log:        cfg.Logger.Slog("stunnerd-xdp"),
		counters:   &fallback.Counters{},
		stop:       make(chan struct{}),
		linkEvents: make(chan struct{}, 1),
		drained:    make(chan struct{}),
	}
	d.cfg.Store(&cfg)
	d.mirror = control.New(cfg.Logger.Slog("control"))
	d.startGate()

	// Relay ports are host ports: make sure the range is usable before pion
	// fails on it allocation by allocation.
	if err := checkRelayRange(cfg.RelayAddress, cfg.MinRelayPort, cfg.MaxRelayPort); err != nil {
		d.mirror.Close()
		return nil, err
	}
	d.auth.Store(newAuthState(cfg, cfg.Logger))
	d.listeners = map[string]*listenerServer{}
	d.openSteering()
	d.startDestinations()
	for _, l := range cfg.Listeners {
		if err := d.startListener(l); err != nil {
			d.closeListeners()
			d.hooks.close()
			d.closeDestinations()
			d.closeSteering()
			d.mirror.Close()
			return nil, err
		}
	}
	d.startXDP()

	d.registry = prometheus.NewRegistry()
	d.registry.MustRegister(newCollector(d), newGateCollector(d))
	if err := d.serveHTTP(); err != nil {
		d.Close()
		return nil, err
	}
	return d, nil
}

func (d *Daemon) startXDP() {
	cfg := d.config()
	xlog := cfg.Logger.Slog("loader")
	ifaces := cfg.Interfaces
	if len(ifaces) == 0 {
		addrs := []netip.Addr{cfg.RelayAddress}
		for _, l := range cfg.Listeners {
			if l.Protocol == config.UDP {
				addrs = append(addrs, l.Addr.Addr())
			}
		}
		var err error
		if ifaces, err = loader.InterfacesFor(addrs...); err != nil {
			xlog.Warn("cannot tell which interfaces carry the listener and relay addresses; set --xdp-iface", "error", err)
		}
	}
	d.sw = fallback.NewSwitch(xlog, d.mirror, cfg.loaderConfig(), ifaces)
	d.wg.Add(1)
	go func() {
		defer d.wg.Done()
		d.mirror.RunReconcile(cfg.ReconcileInterval, d.stop)
	}()
	if err := d.SetMode(cfg.XDPMode); err != nil {
		xlog.Warn("serving from userspace; retrying the attach", "error", err, "every", cfg.XDPRetryInterval.String())
	}
	d.wg.Add(2)
	go func() {
		defer d.wg.Done()
		d.xdpRetry(cfg.XDPRetryInterval)
	}()
	go func() {
		defer d.wg.Done()
		loader.WatchLinks(d.stop, func() {
			select {
			case d.linkEvents <- struct{}{}:
			default: // a retry is pending already
			}
		}, xlog)
	}()
}

// config returns the running configuration; it must not be modified.
func (d *Daemon) config() *Config { return d.cfg.Load() }

func (d *Daemon) wantMode() loader.Mode {
	m, _ := d.want.Load().(loader.Mode)
	return m
}

func (d *Daemon) closeSteering() {
	if d.steer == nil {
		return
	}
	if err := d.steer.Close(); err != nil {
		d.log.Warn("closing the listener steering", "error", err)
	}
}

// SetMode moves the relay to the given XDP mode (off: userspace) without
// touching sessions. It is what --xdp-mode does at start and what the node
// label does later.
func (d *Daemon) SetMode(mode loader.Mode) error {
	xlog := d.config().Logger.Slog("loader")
	d.modeMu.Lock()
	defer d.modeMu.Unlock()
	if d.handedOver && mode != loader.ModeOff {
		return errors.New("draining: XDP was handed over to the newer daemon on this node")
	}
	d.want.Store(mode)
	if mode == loader.ModeOff {
		if err := d.sw.Disable(); err != nil {
			return err
		}
		xlog.Info("XDP off: pion/turn relays everything in userspace")
		return nil
	}
	_, err := d.sw.Enable(mode)
	d.syncDestinations()
	return err
}

func checkRelayRange(addr netip.Addr, lo, hi uint16) error {
	// Probe both ends: a range that is entirely taken or not bindable (a relay
	// address the node does not have) fails here with a clear error.
	for _, p := range []uint16{lo, hi} {
		c, err := net.ListenPacket("udp4", netip.AddrPortFrom(addr, p).String())
		if err == nil {
			c.Close()
			return nil
		}
		if errors.Is(err, syscall.EADDRNOTAVAIL) {
			return fmt.Errorf("relay address %v is not an address of this host: %w", addr, err)
		}
	}
	return fmt.Errorf("relay port range %d-%d on %v: both ends are in use", lo, hi, addr)
}

func (d *Daemon) serveHTTP() error {
	cfg := d.config() // the endpoints' addresses need a restart to change
	mm := http.NewServeMux()
	mm.Handle("/metrics", promhttp.HandlerFor(d.registry, promhttp.HandlerOpts{}))
	if err := d.serve(cfg.MetricsAddr, mm, "metrics"); err != nil {
		return err
	}
	hm := http.NewServeMux()
	hm.HandleFunc("/live", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(`{"status":"live"}` + "\n"))
	})
	hm.HandleFunc("/ready", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		// Clusters that blackhole UDP to unready pods would cut live sessions
		// during the drain: --force-ready-status keeps it green for them.
		if d.draining.Load() && !d.config().ForceReady {
			w.WriteHeader(http.StatusServiceUnavailable)
			_, _ = w.Write([]byte(`{"status":"terminating"}` + "\n"))
			return
		}
		_, _ = w.Write([]byte(`{"status":"ready"}` + "\n"))
	})
	hm.HandleFunc("/status", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(d.Status())
	})
	if err := d.serve(cfg.HealthAddr, hm, "health"); err != nil {
		return err
	}
	return d.serveUnix(cfg.HealthSocket, hm)
}

// Attached returns the XDP mode of every interface it runs on.
func (d *Daemon) Attached() map[string]loader.Mode { return d.sw.Attached() }

// Interfaces returns the interfaces the daemon manages.
func (d *Daemon) Interfaces() []string { return d.sw.Interfaces() }

// Maps returns the binding maps (nil until XDP was first enabled).
func (d *Daemon) Maps() *channelmap.Maps { return d.sw.Maps() }

// Mirror returns the mirror of pion's bindings.
func (d *Daemon) Mirror() *control.Mirror { return d.mirror }

// Switch returns the switch between paths.
func (d *Daemon) Switch() *fallback.Switch { return d.sw }

// Registry returns the Prometheus registry.
func (d *Daemon) Registry() *prometheus.Registry { return d.registry }

// UserspaceCounters returns what pion/turn relayed.
func (d *Daemon) UserspaceCounters() *fallback.Counters { return d.counters }

// AllocationCount returns pion's live allocations.
func (d *Daemon) AllocationCount() int {
	d.lmu.Lock()
	defer d.lmu.Unlock()
	n := 0
	for _, ls := range d.listeners {
		n += ls.server.AllocationCount()
	}
	return n
}

// Close stops the TURN server, detaches XDP and frees the maps.
func (d *Daemon) Close() error {
	var errs []error
	d.closeOnce.Do(func() {
		close(d.stop)
		for _, s := range d.https {
			_ = s.Close()
		}
		d.closeListeners()
		d.hooks.close()
		d.closeDestinations()
		d.closeSteering()
		d.wg.Wait()
		if d.sw != nil {
			errs = append(errs, d.sw.Close())
		}
		d.mirror.Close()
		d.log.Info("stopped")
	})
	return errors.Join(errs...)
}

// Drain starts a graceful shutdown: new allocations are refused, existing ones
// keep relaying on whichever path they are, /ready fails (unless
// ForceReady) and /status says TERMINATING. The returned channel closes when the
// last allocation is gone; the caller decides how long to wait for it.
func (d *Daemon) Drain() <-chan struct{} {
	if d.draining.CompareAndSwap(false, true) {
		d.log.Info("draining: new allocations are refused, live ones keep relaying",
			"allocations", d.AllocationCount())
		d.retire()
		d.handOverXDP()
		d.wg.Add(1)
		go func() {
			defer d.wg.Done()
			t := time.NewTicker(100 * time.Millisecond)
			defer t.Stop()
			for i := 0; ; i++ {
				if i%10 == 9 {
					d.handOverXDP() // a successor may start after the drain began
				}
				if d.AllocationCount() == 0 {
					close(d.drained)
					return
				}
				select {
				case <-d.stop:
					return
				case <-t.C:
				}
			}
		}()
	}
	return d.drained
}

// Draining reports whether Drain was called.
func (d *Daemon) Draining() bool { return d.draining.Load() }

// Status is what /status reports.
type Status struct {
	Status      string            `json:"status"`
	Allocations int               `json:"allocations"`
	Channels    int               `json:"channels"`
	Offloaded   int               `json:"offloaded"`
	Attached    map[string]string `json:"attached"`
	Draining    bool              `json:"draining"`
	// Packets relayed since start, by path (both directions).
	XDPPackets       uint64 `json:"xdpPackets"`
	UserspacePackets uint64 `json:"userspacePackets"`
	// Steering holds the node-wide listener steering verdicts when two
	// daemons may share the ports (nil without --handover-dir).
	Steering *handover.Stats `json:"steering,omitempty"`
}

// Status returns the daemon's state.
func (d *Daemon) Status() Status {
	st := Status{Status: "READY", Allocations: d.AllocationCount(), Attached: map[string]string{}}
	if d.draining.Load() {
		st.Status, st.Draining = "TERMINATING", true
	}
	_, st.Channels = d.mirror.Counts()
	if m := d.sw.Maps(); m != nil {
		st.Offloaded = m.Len()
		if t, err := m.Totals(); err == nil {
			st.XDPPackets = t.ClientToPeerPackets + t.PeerToClientPackets
		}
	}
	st.UserspacePackets = d.counters.ClientToPeerPackets.Load() + d.counters.PeerToClientPackets.Load()
	if d.steer != nil {
		if s, err := d.steer.Stats(); err == nil {
			st.Steering = &s
		}
	}
	for i, m := range d.sw.Attached() {
		st.Attached[i] = string(m)
	}
	return st
}
