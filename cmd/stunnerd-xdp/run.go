package main

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/l7mp/stunnerd-xdp/internal/config"
	"github.com/l7mp/stunnerd-xdp/internal/daemon"
	"github.com/l7mp/stunnerd-xdp/internal/endpoints"
	"github.com/l7mp/stunnerd-xdp/internal/logging"
	"github.com/l7mp/stunnerd-xdp/internal/status"
)

// runURI serves the one listener of a TURN URI.
// runURI serves cfg until a signal on sigs (SIGTERM and SIGINT are
// delivered there).
func runURI(o options, cfg daemon.Config, stderr io.Writer, sigs chan os.Signal) int {
	logger, err := logging.New(o.log, o.logFormat, stderr)
	if err != nil {
		fmt.Fprintf(stderr, "stunnerd-xdp: %v\n", err)
		return 2
	}
	cfg.Logger = logger
	log := logger.Slog("stunnerd-xdp")
	warnStunnerdFlags(o, log)
	if o.dryRun {
		if err := daemon.Check(cfg); err != nil {
			log.Error("dry run: refused", "error", err)
			return 2
		}
		listener := cfg.Listen.String()
		if len(cfg.Listeners) == 1 {
			listener = fmt.Sprintf("%s %v", cfg.Listeners[0].Protocol, cfg.Listeners[0].Addr)
		}
		log.Info("dry run: the command line is valid", "listener", listener)
		return 0
	}
	d, err := daemon.Start(cfg)
	if err != nil {
		log.Error("cannot start", "error", err)
		return 1
	}
	if err := followNode(o, d, logger); err != nil {
		_ = d.Close()
		return 1
	}
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT)
	return drain(o, d, log, <-sigs, sigs)
}

// followNode starts the node label watcher. A --node-name or $NODE_NAME
// whose client cannot be built (no in-cluster config, a bad kubeconfig) is an
// error; an API server that does not answer is not: the daemon serves with
// the configured XDP mode and applies the label when the API answers (a node
// rebooting during an API outage must not CrashLoop). $STUNNER_NODENAME (set
// by the operator for the config discovery service, where the pod may have no
// RBAC for Nodes) is followed when the Kubernetes API answers within 30 s, and
// only warned about otherwise.
func followNode(o options, d *daemon.Daemon, logger *logging.Factory) error {
	log := logger.Slog("stunnerd-xdp")
	if o.nodeName == "" {
		return nil
	}
	if o.labelNode {
		go func() {
			if err := watchNode(d, logger, o.nodeName, o.kubeconfig, false); err != nil {
				log.Warn("not following the node label (from $STUNNER_NODENAME): --xdp-mode and the config decide", "node", o.nodeName, "error", err)
			}
		}()
		return nil
	}
	err := watchNode(d, logger, o.nodeName, o.kubeconfig, true)
	switch {
	case errors.Is(err, daemon.ErrNodeNotListed):
		log.Warn("the Kubernetes API does not answer: serving with the configured XDP mode; the node label applies when it answers",
			"node", o.nodeName, "error", err)
	case err != nil:
		log.Error("cannot follow the node label; unset --node-name (NODE_NAME) to run without it", "error", err)
		return err
	}
	return nil
}

// drain is the graceful shutdown after the first signal.
func drain(o options, d *daemon.Daemon, log *slog.Logger, s os.Signal, sigs <-chan os.Signal) int {
	log.Info("graceful shutdown", "signal", s.String(), "grace-period", o.gracePeriod.String())
	drained := d.Drain()
	timer := time.NewTimer(o.gracePeriod)
	select {
	case <-drained:
		log.Info("last allocation gone")
	case <-timer.C:
		log.Warn("grace period over, closing live allocations", "allocations", d.AllocationCount())
	case s := <-sigs:
		log.Warn("second signal, exiting at once", "signal", s.String(), "allocations", d.AllocationCount())
	}
	timer.Stop()
	if err := d.Close(); err != nil {
		log.Error("shutdown", "error", err)
		return 1
	}
	return 0
}

// runOrigin serves the configs of a file or a config discovery service until
// a signal on sigs (SIGTERM and SIGINT are notified to it).
func runOrigin(o options, stderr io.Writer, sigs chan os.Signal) int {
	org, err := parseOrigin(o.configOrigin)
	if err != nil {
		fmt.Fprintf(stderr, "stunnerd-xdp: %v\n", err)
		return 2
	}
	logger, err := logging.New(o.log, o.logFormat, stderr)
	if err != nil {
		fmt.Fprintf(stderr, "stunnerd-xdp: %v\n", err)
		return 2
	}
	log := logger.Slog("stunnerd-xdp")
	warnStunnerdFlags(o, log)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if o.id == "" {
		host, _ := os.Hostname()
		o.id = "default/stunnerd-" + host // stunnerd's default
	}
	configs := make(chan []byte, 1)
	if org.file != "" {
		b, err := os.ReadFile(org.file)
		switch {
		case err == nil:
			configs <- b
		case !o.watch:
			fmt.Fprintf(stderr, "stunnerd-xdp: read config: %v\n", err)
			return 2
		default:
			log.Warn("config file not readable yet, waiting for it", "file", org.file, "error", err)
		}
		if o.watch {
			go watchFile(ctx, org.file, b, configs)
		}
	} else {
		ns, name, err := parseID(o.id)
		if err != nil {
			fmt.Fprintf(stderr, "stunnerd-xdp: %v\n", err)
			return 2
		}
		tlsCfg, err := cdsTLS(o.cds)
		if err != nil {
			fmt.Fprintf(stderr, "stunnerd-xdp: %v\n", err)
			return 2
		}
		if tlsCfg != nil && org.cds.Scheme != "https" {
			fmt.Fprintf(stderr, "stunnerd-xdp: --cds-ca/--cds-cert are for an https:// or wss:// config origin, not %s\n", org)
			return 2
		}
		tr := http.DefaultTransport.(*http.Transport).Clone()
		tr.TLSClientConfig = tlsCfg
		c := &cdsClient{base: org.cds, namespace: ns, name: name, node: o.cdsNode, tls: tlsCfg,
			http: &http.Client{Timeout: 10 * time.Second, Transport: tr}, log: logger.Slog("cds")}
		log.Info("config discovery", "server", org.String(), "id", o.id, "node", o.cdsNode, "watch", o.watch,
			"ca", cmp.Or(o.cds.ca, "system"), "client-cert", o.cds.cert != "")
		if o.watch {
			go c.watch(ctx, configs)
		} else {
			b, err := c.get(ctx)
			if err != nil {
				log.Error("cannot load the config", "error", err)
				return 1
			}
			configs <- b
		}
	}
	a := &applier{o: o, logger: logger, log: log, warned: map[string]bool{}, from: org.String(),
		dns: config.NewDNSCache(net.DefaultResolver), boot: bootstrapHealth{name: o.id}}
	if o.dryRun {
		return a.dryRun(<-configs)
	}
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT)
	// Every way out without drain closes the daemon (Close is idempotent).
	defer func() {
		if a.d != nil {
			_ = a.d.Close()
		}
	}()
	if err := a.boot.start(o.healthAddr, o.healthSocket, log); err != nil {
		log.Error("cannot serve health checks while waiting for a config", "error", err)
		return 1
	}
	defer a.boot.stop()
	defer a.cancelRetry()
	dnsTick := time.NewTicker(config.DNSInterval)
	defer dnsTick.Stop()
	for {
		select {
		case b := <-configs:
			if err := a.apply(b); err != nil && !o.watch {
				if errors.Is(err, errUsage) {
					return 2 // a config that cannot run is bad input, as a bad flag
				}
				return 1
			}
		case <-a.retryC():
			a.retryStart()
		case <-dnsTick.C:
			a.refreshDNS(ctx)
		case s := <-sigs:
			cancel() // stop following the origin, as stunnerd does
			if a.d == nil {
				log.Info("exiting before the first config", "signal", s.String())
				return 0
			}
			return drain(o, a.d, log, s, sigs)
		}
	}
}

// applier turns each config from the origin into the running daemon.
type applier struct {
	o      options
	logger *logging.Factory
	log    *slog.Logger
	d      *daemon.Daemon
	boot   bootstrapHealth
	from   string // the origin, credentials redacted
	dns    *config.DNSCache
	// last is the last config applied, before DNS resolution; lastCfg after.
	last    *config.Resolved
	lastCfg daemon.Config
	warned  map[string]bool
	// retry restarts the daemon on last after a failed start (with -w): a
	// port may be held by the pod this one replaces, and a file origin
	// sends nothing new when it lets go. retryWait is its backoff.
	retry     *time.Timer
	retryWait time.Duration
}

// Backoff of a failed start's retries.
const (
	startRetryFirst = time.Second
	startRetryMax   = 30 * time.Second
)

// apply parses one config and starts or reconfigures the daemon with it.
func (a *applier) apply(b []byte) error {
	r, err := config.Parse(b)
	if errors.Is(err, config.ErrZeroConfig) {
		a.cancelRetry()
		if !a.o.watch {
			a.log.Error("the config is empty: nothing to serve, and without -w no other config follows", "error", err)
			return fmt.Errorf("%w: %w", errUsage, err)
		}
		if a.d == nil {
			a.log.Info("empty config: waiting for the gateway's config, unready")
		} else {
			a.log.Info("ignoring the empty config of a deleted gateway, as stunnerd does: the listeners keep serving until the pod terminates")
		}
		return nil
	}
	if err != nil {
		a.log.Error("config reload", "result", "rejected, the running config stays", "error", err)
		return fmt.Errorf("%w: %w", errUsage, err)
	}
	for _, w := range r.Warnings {
		if !a.warned[w] {
			a.warned[w] = true
			a.log.Warn("config: " + w)
		}
	}
	a.log.Info("config received", "from", a.from, "gateway", r.Name, "listeners", len(r.Listeners), "version", r.Source.APIVersion)
	a.cancelRetry() // a new config replaces the one that could not start
	a.last = r
	return a.run(r, true)
}

// run resolves r's DNS names and applies it.
func (a *applier) run(r *config.Resolved, fresh bool) error {
	if r.HasDNS() {
		var errs []error
		r, errs = a.dns.Apply(context.Background(), r)
		for _, err := range errs {
			a.log.Warn("config: cluster DNS", "error", err)
		}
	}
	cfg, err := fromConfig(a.o, r)
	if err != nil {
		a.log.Error("config reload", "result", "rejected, the running config stays", "error", err)
		return fmt.Errorf("%w: %w", errUsage, err)
	}
	if !fresh && slices.EqualFunc(cfg.Listeners, a.lastCfg.Listeners, equalPolicy) {
		return nil // a DNS refresh that changed nothing
	}
	if len(cfg.Listeners) == 0 {
		// stunnerd runs such a config serving nothing (and closes what it
		// served); the daemon needs a listener: before the first config it
		// waits unready, after it the running listeners stay.
		if a.d == nil {
			a.log.Warn("config: no listeners to serve: waiting for a config with one, unready")
			if !a.o.watch {
				return fmt.Errorf("%w: no listeners to serve, and without -w no other config follows", errUsage)
			}
			return nil
		}
		a.log.Error("config reload", "result", "rejected: no listeners; the running listeners stay (stunnerd would close them)")
		return fmt.Errorf("%w: no listeners", errUsage)
	}
	if fresh && !a.o.set["log"] && !a.o.verbose {
		if err := a.logger.SetLevels(r.LogLevel); err != nil {
			a.log.Warn("config: bad loglevel, keeping the current one", "error", err)
		}
	}
	if a.d == nil {
		return a.start(cfg, r)
	}
	err = a.d.Reconfigure(cfg) // the config's offload_engine goes to internal/offload from there
	a.lastCfg = cfg
	if err != nil {
		a.log.Error("config reload", "result", "applied with problems", "error", err)
		return err
	}
	a.log.Info("config reloaded", "listeners", len(cfg.Listeners))
	return nil
}

// start starts the daemon on its first config, in place of the bootstrap
// health endpoints.
func (a *applier) start(cfg daemon.Config, r *config.Resolved) error {
	cfg.Logger = a.logger
	a.logOffload(cfg, r)
	a.boot.stop()
	d, err := daemon.Start(cfg)
	if err != nil {
		if a.o.watch {
			a.scheduleRetry()
			a.log.Error("cannot start on this config, retrying until another comes", "error", err, "retry-in", a.retryWait.String())
		} else {
			a.log.Error("cannot start on this config", "error", err)
		}
		if berr := a.boot.start(a.o.healthAddr, a.o.healthSocket, a.log); berr != nil {
			a.log.Error("health checks", "error", berr)
		}
		return err
	}
	a.d, a.lastCfg = d, cfg
	if err := followNode(a.o, d, a.logger); err != nil {
		return err
	}
	a.log.Info("serving: ready", "listeners", len(cfg.Listeners), "config", r.Name, "path", d.Kernel().Path)
	return nil
}

// scheduleRetry arms the retry of a failed start, waiting twice as long as
// the last time, up to startRetryMax.
func (a *applier) scheduleRetry() {
	a.retryWait = min(max(2*a.retryWait, startRetryFirst), startRetryMax)
	a.retry = time.NewTimer(a.retryWait)
}

// cancelRetry drops a pending retry and its backoff.
func (a *applier) cancelRetry() {
	if a.retry != nil {
		a.retry.Stop()
		a.retry = nil
	}
	a.retryWait = 0
}

// retryC fires when a failed start is due for another try; nil otherwise.
func (a *applier) retryC() <-chan time.Time {
	if a.retry == nil {
		return nil
	}
	return a.retry.C
}

// retryStart tries the last config again (its DNS names resolved anew).
func (a *applier) retryStart() {
	a.retry = nil
	if a.d != nil || a.last == nil {
		return
	}
	_ = a.run(a.last, true) // a failure is logged and schedules the next try
}

// logOffload says once, at start, what admin.offload_engine made of the XDP
// mode: None, the operator's default, does not turn XDP off.
func (a *applier) logOffload(cfg daemon.Config, r *config.Resolved) {
	engine := r.OffloadEngine
	if engine == "" {
		engine = "unset"
	}
	switch {
	case a.o.set["xdp-mode"]:
		a.log.Info("offload: --xdp-mode decides", "xdp-mode", string(cfg.XDPMode), "offload_engine", engine)
	case r.XDPMode == "":
		a.log.Info("offload: the config's offload_engine "+engine+" (STUNner's default) does not turn XDP off here; "+
			"--xdp-mode=off or the node label stunner.l7mp.io/xdp-offload=disabled does", "xdp-mode", string(requestedMode(cfg)))
	default:
		a.log.Info("offload: from the config", "offload_engine", engine, "xdp-mode", string(requestedMode(cfg)))
	}
}

// refreshDNS re-resolves the STRICT_DNS clusters and reloads when their
// addresses changed.
func (a *applier) refreshDNS(context.Context) {
	if a.d == nil || a.last == nil || !a.last.HasDNS() {
		return
	}
	_ = a.run(a.last, false)
}

// dryRun checks one config and prints what would run.
func (a *applier) dryRun(b []byte) int {
	r, err := config.Parse(b)
	if err != nil {
		a.log.Error("dry run: config rejected", "error", err)
		return 2
	}
	for _, w := range r.Warnings {
		a.log.Warn("config: " + w)
	}
	if r.HasDNS() {
		r, _ = a.dns.Apply(context.Background(), r)
	}
	cfg, err := fromConfig(a.o, r)
	if err == nil {
		cfg.Logger = a.logger
		err = daemon.Check(cfg)
	}
	if err != nil {
		a.log.Error("dry run: config rejected", "error", err)
		return 2
	}
	var ls []string
	for _, l := range cfg.Listeners {
		ls = append(ls, fmt.Sprintf("%s %s %v", l.Name, l.Protocol, l.Addr))
	}
	a.log.Info("dry run: config valid", "listeners", strings.Join(ls, "; "), "xdp-mode", string(requestedMode(cfg)))
	return 0
}

// equalPolicy compares what a DNS refresh may change.
func equalPolicy(x, y config.ResolvedListener) bool {
	return x.Name == y.Name && slices.Equal(x.AllowPeers, y.AllowPeers) && slices.Equal(x.PeerPorts, y.PeerPorts)
}

// bootstrapHealth answers the kubelet while there is no daemon yet: live, not
// ready (stunnerd's zero config). Its TCP port is the daemon's, so a busy one
// is retried as the daemon does.
type bootstrapHealth struct {
	e    *endpoints.Endpoints
	name string // the gateway's NAMESPACE/NAME, as /status names it
}

func (b *bootstrapHealth) start(addr, sock string, log *slog.Logger) error {
	mux := http.NewServeMux()
	mux.HandleFunc("/live", func(w http.ResponseWriter, _ *http.Request) { status.WriteLive(w) })
	mux.HandleFunc("/ready", func(w http.ResponseWriter, _ *http.Request) { status.WriteReady(w, "waiting for a config") })
	// stunnerd answers /status from its zero config: 200, NOT-READY.
	mux.HandleFunc("/status", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(status.Waiting(b.name))
	})
	b.e = endpoints.New(log)
	if err := b.e.ServeTCP(addr, podAddr(), mux, "health"); err != nil {
		b.stop()
		return err
	}
	if err := b.e.ServeUnix(sock, mux); err != nil {
		b.stop()
		return err
	}
	return nil
}

func (b *bootstrapHealth) stop() {
	if b.e != nil {
		b.e.Close()
		b.e = nil
	}
}

// warnStunnerdFlags says what became of stunnerd's flags this daemon does not
// use, and where the config comes from when nothing said.
func warnStunnerdFlags(o options, log *slog.Logger) {
	if len(o.ignoredK8s) > 0 {
		log.Warn("ignoring stunnerd's Kubernetes client flags: they find the config discovery pod for -c k8s, "+
			"which this daemon does not do (give -c the service's address, or --cds-server-address)", "flags", strings.Join(o.ignoredK8s, ","))
	}
	if o.defaultOrigin {
		log.Info("no TURN URI and no config origin (-c, $STUNNER_CONFIG_ORIGIN): loading from stunnerd's default", "origin", stunnerdDefaultOrigin)
	}
}
