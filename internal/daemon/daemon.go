// Package daemon assembles stunnerd-xdp: the pion/turn server, the mirror of its
// channel bindings into the XDP maps, the offload manager that decides between
// the kernel and userspace paths, metrics and health.
package daemon

import (
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"net/netip"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/l7mp/stunnerd-xdp/internal/channelmap"
	"github.com/l7mp/stunnerd-xdp/internal/config"
	"github.com/l7mp/stunnerd-xdp/internal/connlimit"
	"github.com/l7mp/stunnerd-xdp/internal/ctrefresh"
	"github.com/l7mp/stunnerd-xdp/internal/handover"
	"github.com/l7mp/stunnerd-xdp/internal/loader"
	"github.com/l7mp/stunnerd-xdp/internal/logging"
	"github.com/l7mp/stunnerd-xdp/internal/metrics"
	"github.com/l7mp/stunnerd-xdp/internal/mirror"
	"github.com/l7mp/stunnerd-xdp/internal/nodelabel"
	"github.com/l7mp/stunnerd-xdp/internal/offload"
	"github.com/l7mp/stunnerd-xdp/internal/peerpolicy"
	"github.com/l7mp/stunnerd-xdp/internal/quota"
	"github.com/l7mp/stunnerd-xdp/internal/status"
	"github.com/l7mp/stunnerd-xdp/internal/turnguard"
	"github.com/l7mp/stunnerd-xdp/internal/userspace"
)

// Config is everything the daemon runs on.
type Config struct {
	// Listen is the shorthand for one UDP listener (the URI mode); it is
	// used when Listeners is empty. May be a wildcard.
	Listen netip.AddrPort
	// Listeners are the TURN listeners (from a STUNner config).
	Listeners []config.ResolvedListener
	// Users are static long-term credentials (username -> password).
	Users map[string]string
	// Secret, when set, switches to ephemeral TURN REST API credentials.
	Secret string
	Realm  string
	// RelayAddress is the IP relay sockets bind to and packets to peers come from.
	RelayAddress               netip.Addr
	MinRelayPort, MaxRelayPort uint16

	// AllowPeers and DenyPeers are the peer access control applied to every
	// listener (see peerpolicy.Policy); by default loopback, link-local,
	// multicast, internal and special-purpose networks (RFC 1918, RFC 6598,
	// 198.18/15, fc00::/7), the cluster's Service CIDRs and the node's own
	// addresses are refused.
	AllowPeers, DenyPeers []netip.Prefix
	// NoOffloadPeers are relayed in userspace only (see natgate.go); the
	// cluster's Service CIDRs join them when the Kubernetes API lists them.
	NoOffloadPeers []netip.Prefix

	// XDPMode is --xdp-mode when given on the command line; empty when not.
	// ConfigXDPMode is what the config's admin.offload_engine asks for;
	// empty when it does not say. internal/offload decides between them.
	XDPMode, ConfigXDPMode loader.Mode
	Interfaces             []string // empty: those carrying the listener and relay addresses
	MaxBindings            uint32
	// TCEngine loads the TC engine (bpf/relay_tc.c) beside the XDP program:
	// attached wherever XDP is, it relays on the skb path what XDP passes for
	// an egress XDP cannot transmit to (a pod's veth, a bridge, a tunnel),
	// and, attached to the interfaces matching TCPatterns as they come and go
	// (pods' host-side veths), the datagrams local pods send to relay ports.
	TCEngine   bool
	TCPatterns []string

	// UserQuota bounds the allocations of one user-id, TotalQuota the
	// daemon's (0: no limit; AutoQuota: the defaults, see resolveQuotas);
	// over them, Allocate gets 486.
	UserQuota, TotalQuota int
	// MaxPermissions bounds the peer IPs one allocation holds permissions
	// for (0: no limit); beyond it, CreatePermission and ChannelBind fail.
	MaxPermissions int
	// MaxChannels bounds the channels one allocation holds (0: no limit);
	// a ChannelBind for one more gets 508 (turnguard).
	MaxChannels int
	// ConnLimits bound the clients of the TCP and TLS listeners, over all of
	// them (connlimit.Limits); the zero value means connlimit.Defaults().
	ConnLimits connlimit.Limits
	// RateLimit is every allocation's packet and byte rate, all its channels
	// and both directions together, in the XDP program and in pion's relay
	// sockets alike (zero: none). Pass hands what is over it to userspace, which
	// drops it there.
	RateLimit channelmap.RateLimit

	// MetricsAddr and HealthAddr are the endpoints' addresses (empty: off);
	// one without a host listens on PodAddr and loopback (EndpointAddrs).
	MetricsAddr string
	HealthAddr  string
	// PodAddr is the pod's address ($POD_IP, else $STUNNER_ADDR); invalid
	// outside Kubernetes.
	PodAddr netip.Addr
	// PprofAddr serves Go's profiles at /debug/pprof/ (empty: off); it must
	// be a loopback address.
	PprofAddr string
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
	// UDPThreadNum is the number of read loops per UDP listener, each on its
	// own SO_REUSEPORT socket (STUNner's -u/--udp-thread-num); 0: one per CPU.
	UDPThreadNum int
	// NoShortcut leaves every ChannelData datagram that reaches userspace to
	// pion/turn's own handler; by default the read loop relays those on
	// pion's channels itself (userspace.Channels: the same write, without
	// pion's per-datagram logging work).
	NoShortcut bool

	Logger *logging.Factory

	// Source is the STUNner configuration the daemon runs (nil when started
	// from flags): /status reports it as stunnerd does.
	Source *config.Stunner
}

// Defaults for the zero fields of Config.
const (
	DefaultMinRelayPort      = 49152
	DefaultMaxRelayPort      = 65535
	DefaultMaxBindings       = 131072
	DefaultReconcileInterval = 10 * time.Second
	DefaultSocketBuffer      = 4 << 20
	DefaultXDPRetryInterval  = 2 * time.Second
	// MaxUDPThreadNum bounds the read loops per UDP listener; the default, one
	// per CPU, stops at DefaultMaxUDPThreads so that two daemons' sockets
	// (a rolling update) fit the steering array on a big node.
	MaxUDPThreadNum      = 64
	DefaultMaxUDPThreads = 16
)

func (c *Config) validate() error {
	// The running config is a snapshot nobody changes: take copies of what
	// the caller may still hold and of what validate rewrites.
	c.Listeners, c.Users = slices.Clone(c.Listeners), maps.Clone(c.Users)
	c.AllowPeers, c.DenyPeers = slices.Clone(c.AllowPeers), slices.Clone(c.DenyPeers)
	c.NoOffloadPeers, c.Interfaces = slices.Clone(c.NoOffloadPeers), slices.Clone(c.Interfaces)
	c.TCPatterns = slices.Clone(c.TCPatterns)
	if len(c.Listeners) == 0 {
		if !c.Listen.IsValid() || c.Listen.Port() == 0 {
			return fmt.Errorf("invalid listener address %v", c.Listen)
		}
		c.Listeners = []config.ResolvedListener{{Name: "default", Protocol: config.UDP, Addr: c.Listen}}
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
		c.Realm = config.DefaultRealm
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
	if c.UDPThreadNum < 0 {
		return fmt.Errorf("%d UDP read loops per listener: want 1 or more (0: one per CPU)", c.UDPThreadNum)
	}
	if c.UDPThreadNum > MaxUDPThreadNum {
		return fmt.Errorf("%d UDP read loops per listener: at most %d", c.UDPThreadNum, MaxUDPThreadNum)
	}
	if c.PprofAddr != "" {
		ap, err := netip.ParseAddrPort(c.PprofAddr)
		if err != nil || !ap.Addr().IsLoopback() {
			return fmt.Errorf("pprof address %q: want a loopback IP:PORT, like 127.0.0.1:6060 (profiles reveal memory)", c.PprofAddr)
		}
	}
	if c.UserQuota < AutoQuota || c.TotalQuota < AutoQuota || c.MaxPermissions < 0 || c.MaxChannels < 0 {
		return fmt.Errorf("quotas %d per user, %d in total, %d permissions and %d channels per allocation: want 0 (no limit) or more",
			c.UserQuota, c.TotalQuota, c.MaxPermissions, c.MaxChannels)
	}
	c.resolveQuotas()
	if c.ConnLimits == (connlimit.Limits{}) {
		c.ConnLimits = connlimit.Defaults()
	}
	if err := c.ConnLimits.Validate(); err != nil {
		return err
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
	cfg atomic.Pointer[Config]
	log *slog.Logger
	// strangerLog is for lines anyone who can send a datagram can trigger
	// (unknown users, refused peers and allocations): rate-limited.
	strangerLog *slog.Logger
	quota       *quota.Counter
	perms       *quota.Permissions
	conns       *connlimit.Limiter // the TCP and TLS listeners' clients
	guarded     turnguard.Counts   // what the listeners' turnguards refused
	mirror      *mirror.Mirror
	hooks       hookGate // pion's hooks into the mirror and the steering
	auth        atomic.Pointer[authState]
	// clusterNets are the cluster networks learned from the Kubernetes API
	// (Service CIDRs), refused as peers unless allowed (peerpolicy).
	clusterNets peerpolicy.Learned

	lmu        sync.Mutex // guards listeners and cfg.Listeners
	listeners  map[string]*listenerServer
	xdp        *offload.Manager
	dests      *destinationSync
	ctRefresh  *ctrefresh.Refresher
	steer      *handover.Steering
	counters   *userspace.Counters
	rateLimit  *userspace.RateLimiter
	traffic    *metrics.Traffic
	registry   *prometheus.Registry
	closers    []func() // the HTTP endpoints
	stop       chan struct{}
	linkEvents chan struct{} // a network interface changed: retry the attach now
	wg         sync.WaitGroup
	// trackMu orders track against Close: no goroutine joins wg once Close
	// has begun waiting for it.
	trackMu sync.Mutex
	closing bool

	nodeWatcher atomic.Pointer[nodelabel.Watcher]
	stopping    atomic.Bool   // Drain was called
	draining    atomic.Bool   // new allocations are refused (drain.go)
	drained     chan struct{} // closed by Drain when the last allocation is gone
	// successorGone is how many looks in a row found the successor gone;
	// owned by the drain goroutine (followSuccessor).
	successorGone int

	closeOnce sync.Once
}

// Start builds and starts the daemon. XDP problems never stop it: it serves
// from userspace instead and says why.
func Start(cfg Config) (*Daemon, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	d := &Daemon{
		log:         cfg.Logger.Slog("stunnerd-xdp"),
		strangerLog: cfg.Logger.Limited("auth"),
		quota:       quota.New(cfg.quotaLimits()),
		perms:       quota.NewPermissions(cfg.MaxPermissions),
		counters:    &userspace.Counters{},
		traffic:     metrics.NewTraffic(),
		stop:        make(chan struct{}),
		linkEvents:  make(chan struct{}, 1),
		drained:     make(chan struct{}),
	}
	d.rateLimit = userspace.NewRateLimiter(cfg.RateLimit, d.counters)
	d.conns, _ = connlimit.New(cfg.ConnLimits) // validate checked them
	d.cfg.Store(&cfg)
	d.traffic.SetListeners(cfg.trafficListeners())
	d.mirror = mirror.New(cfg.Logger.Slog("control"))
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
	d.assertSteering()

	d.registry = metrics.NewRegistry(d)
	d.registry.MustRegister(d.conntrackRefreshMetrics()...)
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
	load := offload.LoadXDP(xlog)
	if cfg.TCEngine {
		load = offload.LoadEngines(xlog, cfg.TCPatterns)
	}
	d.xdp = offload.New(offload.Options{
		Log: xlog, Load: load, Sink: d.mirror, Program: cfg.loaderConfig(), Interfaces: ifaces,
		Flag: cfg.XDPMode, Config: cfg.ConfigXDPMode,
	})
	d.wg.Add(1)
	go func() {
		defer d.wg.Done()
		d.mirror.RunReconcile(cfg.ReconcileInterval, d.stop)
	}()
	if err := d.xdp.Start(); err != nil {
		xlog.Warn("serving from userspace; retrying the attach", "error", err, "every", cfg.XDPRetryInterval.String())
	}
	d.syncDestinations()
	d.startConntrackRefresh()
	d.wg.Add(3)
	go func() {
		defer d.wg.Done()
		seen := map[quota.Server][2]int{}
		d.tick(quotaCheckInterval, func() bool { d.checkQuotaCounts(seen); return false })
	}()
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

// SetConfigMode applies what the config's admin.offload_engine asks for
// (empty: it does not say); internal/offload weighs it against --xdp-mode and
// the node label. Reconfigure calls it when the config's mode changes.
func (d *Daemon) SetConfigMode(mode loader.Mode) error {
	d.lmu.Lock()
	defer d.lmu.Unlock()
	return d.setConfigModeLocked(mode)
}

func (d *Daemon) setConfigModeLocked(mode loader.Mode) error {
	next := *d.config()
	next.ConfigXDPMode = mode
	d.cfg.Store(&next)
	err := d.xdp.SetConfig(mode)
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

// Attached returns the XDP mode of every interface it runs on.
func (d *Daemon) Attached() map[string]loader.Mode { return d.xdp.Attached() }

// Mode returns the XDP mode the offload manager's inputs give (off: userspace).
func (d *Daemon) Mode() loader.Mode { return d.xdp.Mode() }

// Interfaces returns the interfaces the daemon manages.
func (d *Daemon) Interfaces() []string { return d.xdp.Interfaces() }

// Maps returns the binding maps (nil until XDP was first enabled).
func (d *Daemon) Maps() *channelmap.Maps { return d.xdp.Maps() }

// TCVerdicts returns the TC engine's verdict counters (nil while it is not
// loaded).
func (d *Daemon) TCVerdicts() ([]uint64, error) { return d.xdp.TCVerdicts() }

// Mirror returns the mirror of pion's bindings.
func (d *Daemon) Mirror() *mirror.Mirror { return d.mirror }

// Registry returns the Prometheus registry.
func (d *Daemon) Registry() *prometheus.Registry { return d.registry }

// UserspaceCounters returns what pion/turn relayed.
func (d *Daemon) UserspaceCounters() *userspace.Counters { return d.counters }

// RateLimitDropped is how many datagrams pion's relay sockets dropped over the
// rate limit (the program counts its own as the rate_limited verdict).
func (d *Daemon) RateLimitDropped() uint64 { return d.counters.RateLimited.Load() }

// Traffic returns the listeners' and clusters' accounting.
func (d *Daemon) Traffic() *metrics.Traffic { return d.traffic }

// MirrorStats returns the mirror's counters and the channels pion holds.
func (d *Daemon) MirrorStats() (mirror.Stats, int) {
	_, chans := d.mirror.Counts()
	return d.mirror.Stats(), chans
}

// UserspaceBindings returns how many of pion's bindings stay in userspace, by reason.
func (d *Daemon) UserspaceBindings() map[string]int { return d.mirror.UserspaceBindings() }

// NodeLabel returns the state of the node's offload label.
func (d *Daemon) NodeLabel() nodelabel.State {
	if w := d.nodeWatcher.Load(); w != nil {
		return w.State()
	}
	return nodelabel.Absent
}

// Steering returns the node's listener steering verdicts (nil without it).
func (d *Daemon) Steering() (*handover.Stats, error) {
	if d.steer == nil {
		return nil, nil
	}
	s, err := d.steer.Stats()
	if err != nil {
		return nil, err
	}
	return &s, nil
}

// trafficListeners are the listeners as the metrics account them.
func (c *Config) trafficListeners() []metrics.Listener {
	out := make([]metrics.Listener, 0, len(c.Listeners))
	for _, l := range c.Listeners {
		ml := metrics.Listener{Name: l.Name, Clusters: l.Clusters}
		if l.Protocol == config.UDP {
			ml.Addr = l.Addr
		}
		out = append(out, ml)
	}
	return out
}

// udpThreads is the number of read loops (sockets) per UDP listener.
func (d *Daemon) udpThreads() int {
	if n := d.config().UDPThreadNum; n > 0 {
		return n
	}
	return min(runtime.NumCPU(), DefaultMaxUDPThreads)
}

// AllocationCount returns pion's live allocations.
func (d *Daemon) AllocationCount() int {
	d.lmu.Lock()
	defer d.lmu.Unlock()
	n := 0
	for _, ls := range d.listeners {
		for _, srv := range ls.servers {
			n += srv.AllocationCount()
		}
	}
	return n
}

// track runs f on a goroutine that Close waits for. Once Close has begun it
// runs nothing and returns false: a late caller (the label watcher's first
// list answering after a SIGTERM) must not join a WaitGroup being waited on.
func (d *Daemon) track(f func()) bool {
	d.trackMu.Lock()
	defer d.trackMu.Unlock()
	if d.closing {
		return false
	}
	d.wg.Add(1)
	go func() {
		defer d.wg.Done()
		f()
	}()
	return true
}

// Close stops the TURN server, detaches XDP and frees the maps.
func (d *Daemon) Close() error {
	var errs []error
	d.closeOnce.Do(func() {
		d.trackMu.Lock()
		d.closing = true
		d.trackMu.Unlock()
		close(d.stop)
		for _, c := range d.closers {
			c()
		}
		d.closeListeners()
		d.hooks.close()
		d.closeDestinations()
		d.closeSteering()
		d.wg.Wait()
		if d.xdp != nil {
			errs = append(errs, d.xdp.Close())
		}
		d.mirror.Close()
		d.log.Info("stopped")
	})
	return errors.Join(errs...)
}

// Status returns what /status reports: STUNner's StunnerStatus with the xdp
// section.
func (d *Daemon) Status() status.Status {
	cfg := d.config()
	x := status.XDP{Attached: map[string]string{}, Draining: d.draining.Load()}
	_, x.Channels = d.mirror.Counts()
	if m := d.xdp.Maps(); m != nil {
		x.Offloaded = m.Len()
		if t, err := m.Totals(); err == nil {
			x.XDPPackets = t.ClientToPeerPackets + t.PeerToClientPackets
		}
	}
	x.UserspacePackets = d.counters.ClientToPeerPackets.Load() + d.counters.PeerToClientPackets.Load()
	x.Steering, _ = d.Steering()
	for i, m := range d.xdp.Attached() {
		x.Attached[i] = string(m)
	}
	traffic, _ := metrics.KernelTotals(d) // on error, userspace's only: a status is a snapshot
	return status.New(status.Input{
		Version:     "v1",
		Source:      cfg.stunnerConfig(),
		Offload:     status.OffloadString(d.offloadEngine(), cfg.Interfaces),
		Allocations: d.AllocationCount(),
		Draining:    x.Draining,
		Traffic:     traffic,
		XDP:         x,
	})
}

// offloadEngine names the path in use as STUNner's admin.offload_engine does.
func (d *Daemon) offloadEngine() string {
	if len(d.xdp.Attached()) == 0 {
		return "None"
	}
	return "XDP"
}

// stunnerConfig is the STUNner configuration the daemon runs: the one it was
// given, or one describing the flags.
func (c *Config) stunnerConfig() *config.Stunner {
	if c.Source != nil {
		return c.Source
	}
	s := &config.Stunner{APIVersion: "v1", Auth: config.Auth{Type: string(config.AuthStatic), Realm: c.Realm}}
	if c.Secret != "" {
		s.Auth.Type = string(config.AuthEphemeral)
	}
	for _, l := range c.Listeners {
		s.Listeners = append(s.Listeners, config.Listener{Name: l.Name, Protocol: string(l.Protocol),
			Addr: l.Addr.Addr().String(), Port: int(l.Addr.Port())})
	}
	return s
}
