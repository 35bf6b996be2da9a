// Package daemon wires stunnerd-xdp together and owns its lifetime: it builds
// the parts (the listeners, the mirror of pion's bindings, the offload
// manager, the destinations, the steering, the endpoints) from one Config,
// hands a reload to each, and drains and closes them in order.
package daemon

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"syscall"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/l7mp/stunnerd-xdp/internal/allocflows"
	"github.com/l7mp/stunnerd-xdp/internal/channelmap"
	"github.com/l7mp/stunnerd-xdp/internal/config"
	"github.com/l7mp/stunnerd-xdp/internal/connlimit"
	"github.com/l7mp/stunnerd-xdp/internal/credentials"
	"github.com/l7mp/stunnerd-xdp/internal/ctrefresh"
	"github.com/l7mp/stunnerd-xdp/internal/listener"
	"github.com/l7mp/stunnerd-xdp/internal/loader"
	"github.com/l7mp/stunnerd-xdp/internal/metrics"
	"github.com/l7mp/stunnerd-xdp/internal/mirror"
	"github.com/l7mp/stunnerd-xdp/internal/nodelabel"
	"github.com/l7mp/stunnerd-xdp/internal/offload"
	"github.com/l7mp/stunnerd-xdp/internal/peerpolicy"
	"github.com/l7mp/stunnerd-xdp/internal/quota"
	"github.com/l7mp/stunnerd-xdp/internal/shield"
	"github.com/l7mp/stunnerd-xdp/internal/status"
	"github.com/l7mp/stunnerd-xdp/internal/steering"
	"github.com/l7mp/stunnerd-xdp/internal/turnguard"
	"github.com/l7mp/stunnerd-xdp/internal/userspace"
)

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
	creds       *credentials.Store
	// clusterNets are the cluster networks learned from the Kubernetes API
	// (Service CIDRs), refused as peers unless allowed (peerpolicy).
	clusterNets peerpolicy.Learned

	lmu        sync.Mutex // one reload (or config mode change) at a time
	listeners  *listener.Set
	xdp        *offload.Manager
	dests      *destinationSync
	ctRefresh  *ctrefresh.Refresher
	steer      *steering.Steering
	allocs     *allocflows.Table
	shield     *shield.Shield // the read loops' (nil: --listener-shield=false)
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

	kernel      kernelFacts // read once at start
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
	d.kernel = readKernelFacts()
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
	d.creds = credentials.New(cfg.credentials(), d.strangerLog)
	d.openSteering()
	d.openAllocations()
	d.startDestinations()
	d.listeners = listener.NewSet(listener.Deps{
		Logger: cfg.Logger, Credentials: d.creds, Mirror: d.mirror.EventHandler(),
		Destinations: d.dests.tracker, Steering: d.steer, Allocations: d.allocs, Shield: d.shield,
		Quota: d.quota, Permissions: d.perms, Draining: d.draining.Load,
		Conns: d.conns, Guarded: &d.guarded, Counters: d.counters, RateLimit: d.rateLimit,
		Traffic: d.traffic, ClusterNets: &d.clusterNets,
	})
	if err := d.listeners.Start(cfg.listenerSettings(), cfg.Listeners); err != nil {
		d.listeners.Close()
		d.closeDestinations()
		d.closeSteering()
		d.closeAllocations()
		d.mirror.Close()
		return nil, err
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
	if cfg.load != nil {
		load = cfg.load
	}
	// Before any offload is set: the policies in place judge the first bindings.
	policy := d.startPolicy()
	d.xdp = offload.New(offload.Options{
		Log: xlog, Load: load, Sink: mapWriters{d}, Program: d.program(cfg), Interfaces: ifaces,
		Flag: cfg.XDPMode, Config: cfg.ConfigXDPMode,
	})
	d.mirror.SetNoPath(d.xdp.Unavailable)
	d.wg.Add(1)
	go func() {
		defer d.wg.Done()
		d.mirror.RunReconcile(cfg.ReconcileInterval, d.stop)
	}()
	if err := d.xdp.Start(); startErr(err) {
		xlog.Warn("serving from userspace; retrying the attach", "error", err, "every", cfg.XDPRetryInterval.String())
	}
	d.logKernel()
	d.startConntrackRefresh()
	d.watchPolicy(policy)
	d.wg.Add(3)
	go func() {
		defer d.wg.Done()
		seen := map[quota.Server][2]int{}
		d.tick(quotaCheckInterval, func() bool { d.listeners.CheckQuotaCounts(seen); return false })
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
// the node label. A reload does the same when the config's mode changes.
func (d *Daemon) SetConfigMode(mode loader.Mode) error {
	d.lmu.Lock()
	defer d.lmu.Unlock()
	next := *d.config()
	next.ConfigXDPMode = mode
	d.cfg.Store(&next)
	return d.xdp.SetConfig(mode)
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
func (d *Daemon) Steering() (*steering.Stats, error) {
	if d.steer == nil {
		return nil, nil
	}
	s, err := d.steer.Stats()
	if err != nil {
		return nil, err
	}
	return &s, nil
}

// AllocationCount returns pion's live allocations.
func (d *Daemon) AllocationCount() int { return d.listeners.AllocationCount() }

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
		d.listeners.Close()
		d.closeDestinations()
		d.closeSteering()
		d.closeAllocations()
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
	x.Kernel = d.Kernel()
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
	attached := d.xdp.Attached()
	for _, m := range attached {
		if m != loader.ModeTC {
			return "XDP"
		}
	}
	if len(attached) > 0 {
		return "TC" // another daemon's XDP program holds every interface
	}
	return "None"
}
