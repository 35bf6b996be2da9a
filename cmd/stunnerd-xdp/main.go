// Command stunnerd-xdp is a TURN server (pion/turn) whose UDP ChannelData hot
// path runs in XDP. It is run like STUNner's stunnerd:
//
//	stunnerd-xdp [flags] turn://USER:PASS@ADDR:PORT
package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"net/netip"
	"net/url"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/l7mp/stunnerd-xdp/internal/config"
	"github.com/l7mp/stunnerd-xdp/internal/daemon"
	"github.com/l7mp/stunnerd-xdp/internal/handover"
	"github.com/l7mp/stunnerd-xdp/internal/loader"
	"github.com/l7mp/stunnerd-xdp/internal/logging"
	"github.com/l7mp/stunnerd-xdp/internal/prefix"
)

const usageHead = `stunnerd-xdp: a TURN server (pion/turn) whose UDP ChannelData hot path runs in XDP.

Usage:
  stunnerd-xdp [flags] turn://USER:PASS@ADDR:PORT
  stunnerd-xdp [flags] -c stunnerd.conf [-w]
  stunnerd-xdp probe [--health-socket PATH] live|ready|status

pion/turn handles everything that needs judgement (Allocate, authentication,
CreatePermission, ChannelBind, Refresh, STUN Binding) and mirrors each channel
binding into BPF maps; an XDP program relays the bound ChannelData in the
kernel. Whatever XDP cannot relay, and everything when XDP is unavailable, is
relayed by pion/turn in userspace.

Two daemons may run on one node at once (a rolling update with surge): they
share the TURN ports through SO_REUSEPORT and a steering program whose maps are
pinned under --handover-dir; clients with allocations stay with their daemon,
new clients go to the newest one, and the newcomer takes over XDP when the old
one detaches. The probe command checks this process's health over
--health-socket, which stays per-pod while the health port is shared.

ADDR may be 0.0.0.0 (then --relay-address is required). Example:
  stunnerd-xdp --relay-address 10.0.0.5 --log=all:INFO,turn:DEBUG turn://user1:passwd1@0.0.0.0:3478

Flags:
`

type options struct {
	log, logFormat, realm, relayAddr, xdpMode, xdpIfaces string
	metricsAddr, healthAddr, healthSocket, handoverDir   string
	minPort, maxPort                                     uint
	maxBindings                                          uint
	udpThreadNum                                         int // temporary (H6); H4's -u/--udp-thread-num replaces it
	forceReady                                           bool
	gracePeriod                                          time.Duration
	allowPeers, denyPeers, noOffloadPeers                prefixList
	configFile, nodeName, kubeconfig                     string
	watch                                                bool
	set                                                  map[string]bool // flags given on the command line
}

// prefixList is a repeatable flag of CIDR prefixes or addresses.
type prefixList []netip.Prefix

func (l *prefixList) String() string {
	var s []string
	for _, p := range *l {
		s = append(s, p.String())
	}
	return strings.Join(s, ",")
}

func (l *prefixList) Set(v string) error {
	for _, part := range strings.Split(v, ",") {
		p, err := prefix.Parse(strings.TrimSpace(part))
		if err != nil {
			return err
		}
		*l = append(*l, p)
	}
	return nil
}

func main() {
	os.Exit(run(os.Args[1:], os.Stderr))
}

func run(args []string, stderr io.Writer) int {
	if len(args) > 0 && args[0] == "probe" {
		return probe(args[1:], os.Stdout, stderr)
	}
	fs := flag.NewFlagSet("stunnerd-xdp", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var o options
	fs.StringVar(&o.log, "log", "all:INFO", "log levels per scope: `SPEC` as scope:LEVEL,... with LEVEL TRACE, DEBUG, INFO, WARN, ERROR or DISABLE;\nscope 'all' is the default; scopes include turn, auth, control, loader, stunnerd-xdp")
	fs.StringVar(&o.logFormat, "log-format", "text", "log format: text or json")
	fs.StringVar(&o.realm, "realm", config.DefaultRealm, "TURN realm for long-term credentials")
	fs.StringVar(&o.relayAddr, "relay-address", "", "`IP` that relay sockets bind to and relayed packets leave from\n(default: the listener address when it is not a wildcard)")
	fs.UintVar(&o.minPort, "min-relay-port", daemon.DefaultMinRelayPort, "lowest relay port (relay ports are host ports)")
	fs.UintVar(&o.maxPort, "max-relay-port", daemon.DefaultMaxRelayPort, "highest relay port")
	fs.StringVar(&o.xdpMode, "xdp-mode", string(loader.ModeAuto), "XDP attach mode: auto (native, then generic, then userspace), native, generic or off;\ngiven, it wins over the config's admin.offload_engine; the node label wins over both (internal/offload)")
	fs.StringVar(&o.xdpIfaces, "xdp-iface", "", "`IFACE[,IFACE]` to attach XDP to (default: the interfaces carrying the listener and relay addresses)")
	fs.UintVar(&o.maxBindings, "max-bindings", daemon.DefaultMaxBindings, "channel bindings the XDP maps hold; beyond that flows stay in userspace")
	fs.StringVar(&o.metricsAddr, "metrics-addr", ":8080", "`ADDR` for Prometheus metrics at /metrics (empty: off)")
	fs.StringVar(&o.healthAddr, "health-addr", ":8086", "`ADDR` for health checks at /live and /ready (empty: off)")
	fs.StringVar(&o.healthSocket, "health-socket", "", "`PATH` of a unix socket serving /live, /ready and /status for this process only\n(for exec probes: 'stunnerd-xdp probe --health-socket PATH ready'; empty: off)")
	fs.IntVar(&o.udpThreadNum, "udp-thread-num", 0, "read loops per UDP listener, each on its own SO_REUSEPORT socket (0: one per CPU, at most 16)")
	fs.StringVar(&o.handoverDir, "handover-dir", handover.DefaultDir, "bpffs `DIR` where the daemons of a node share their TURN ports for hitless rolling updates\n(a subdirectory per network namespace; empty: ports are bound exclusively)")
	fs.BoolVar(&o.forceReady, "force-ready-status", false, "keep /ready green while draining, for clusters that blackhole UDP to unready pods")
	fs.Var(&o.allowPeers, "allow-peer", "`CIDR` of peers clients may relay to (repeatable); when given, it is an allowlist,\nand it also admits peers the defaults refuse (loopback, link-local, multicast, this node's addresses)")
	fs.Var(&o.denyPeers, "deny-peer", "`CIDR` of peers clients may not relay to (repeatable); the most specific prefix wins")
	fs.Var(&o.noOffloadPeers, "no-offload-peer", "`CIDR` of peers relayed by pion/turn in userspace only, never by XDP (repeatable): ranges the node\n"+
		"NATs (the XDP path runs before netfilter) or whose firewall rules must apply; the cluster's Service CIDRs\n"+
		"are added when --node-name gives access to the Kubernetes API")
	fs.StringVar(&o.configFile, "c", "", "read STUNner's dataplane config `FILE` (version v1, YAML or JSON) instead of a URI:\nlisteners, auth (static or ephemeral), clusters as peer allowlists, admin log level and endpoints;\nflags given on the command line win over it")
	fs.StringVar(&o.nodeName, "node-name", os.Getenv("NODE_NAME"), "`NODE` whose label stunner.l7mp.io/xdp-offload (enabled|disabled) attaches or detaches XDP live;\nempty: no label, --xdp-mode decides (default: $NODE_NAME, set by the downward API)")
	fs.StringVar(&o.kubeconfig, "kubeconfig", os.Getenv("KUBECONFIG"), "kubeconfig `FILE` for --node-name outside a cluster (default: in-cluster config)")
	fs.BoolVar(&o.watch, "w", false, "with -c: reload the config file when it changes, without dropping the sessions the change does not touch")
	fs.DurationVar(&o.gracePeriod, "grace-period", time.Hour, "on SIGTERM or SIGINT, how long to drain: new allocations are refused,\nlive ones keep relaying until they end or this runs out; a second signal exits at once")
	fs.Usage = func() {
		fmt.Fprint(stderr, usageHead)
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	o.set = map[string]bool{}
	fs.Visit(func(f *flag.Flag) { o.set[f.Name] = true })
	if o.configFile == "" && fs.NArg() != 1 || o.configFile != "" && fs.NArg() != 0 {
		fmt.Fprintln(stderr, "stunnerd-xdp: need exactly one of a TURN URI, like turn://user:pass@10.0.0.1:3478, or -c FILE (see --help)")
		return 2
	}
	if o.watch && o.configFile == "" {
		fmt.Fprintln(stderr, "stunnerd-xdp: -w needs -c FILE")
		return 2
	}
	var (
		cfg daemon.Config
		err error
	)
	if o.configFile != "" {
		var r *config.Resolved
		if r, err = config.ReadFile(o.configFile); err == nil {
			cfg, err = fromFile(o, r)
		}
	} else {
		cfg, err = buildConfig(o, fs.Arg(0))
	}
	if err != nil {
		fmt.Fprintf(stderr, "stunnerd-xdp: %v\n", err)
		return 2
	}
	logger, err := logging.New(o.log, o.logFormat, stderr)
	if err != nil {
		fmt.Fprintf(stderr, "stunnerd-xdp: %v\n", err)
		return 2
	}
	cfg.Logger = logger
	log := logger.Slog("stunnerd-xdp")

	d, err := daemon.Start(cfg)
	if err != nil {
		log.Error("cannot start", "error", err)
		return 1
	}
	if o.nodeName != "" {
		if err := watchNode(d, logger, o.nodeName, o.kubeconfig); err != nil {
			log.Error("cannot follow the node label; unset --node-name (NODE_NAME) to run without it", "error", err)
			_ = d.Close()
			return 1
		}
	}
	if o.watch {
		stopWatch := make(chan struct{})
		defer close(stopWatch)
		go watchConfig(o, d, logger, stopWatch)
	}
	sigs := make(chan os.Signal, 2)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT)
	s := <-sigs
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

// buildConfig turns the flags and the URI into a daemon configuration.
func buildConfig(o options, uri string) (daemon.Config, error) {
	listen, user, pass, err := parseURI(uri)
	if err != nil {
		return daemon.Config{}, err
	}
	cfg, err := flagsConfig(o)
	cfg.Listen = listen
	cfg.Users = map[string]string{user: pass}
	return cfg, err
}

// flagsConfig turns the flags into a daemon configuration without listeners
// or credentials.
func flagsConfig(o options) (daemon.Config, error) {
	var (
		cfg daemon.Config
		err error
	)
	cfg.Realm = o.realm
	if o.relayAddr != "" {
		a, err := netip.ParseAddr(o.relayAddr)
		if err != nil {
			return cfg, fmt.Errorf("--relay-address: %w", err)
		}
		cfg.RelayAddress = a
	}
	for _, p := range []struct {
		name string
		v    uint
	}{{"--min-relay-port", o.minPort}, {"--max-relay-port", o.maxPort}} {
		if p.v == 0 || p.v > 65535 {
			return cfg, fmt.Errorf("%s %d: want 1-65535", p.name, p.v)
		}
	}
	cfg.MinRelayPort, cfg.MaxRelayPort = uint16(o.minPort), uint16(o.maxPort)
	if cfg.XDPMode, err = loader.ParseMode(o.xdpMode); err != nil {
		return cfg, fmt.Errorf("--xdp-mode: %w", err)
	}
	if o.xdpIfaces != "" {
		for _, i := range strings.Split(o.xdpIfaces, ",") {
			if i = strings.TrimSpace(i); i == "" {
				return cfg, fmt.Errorf("--xdp-iface %q: empty interface name", o.xdpIfaces)
			}
			cfg.Interfaces = append(cfg.Interfaces, i)
		}
	}
	if o.gracePeriod < 0 {
		return cfg, fmt.Errorf("--grace-period %v: must not be negative", o.gracePeriod)
	}
	if o.maxBindings == 0 || o.maxBindings > 1<<24 {
		return cfg, fmt.Errorf("--max-bindings %d: want 1-%d", o.maxBindings, 1<<24)
	}
	cfg.MaxBindings = uint32(o.maxBindings)
	cfg.UDPThreadNum = o.udpThreadNum
	cfg.MetricsAddr, cfg.HealthAddr, cfg.ForceReady = o.metricsAddr, o.healthAddr, o.forceReady
	cfg.HealthSocket, cfg.HandoverDir = o.healthSocket, o.handoverDir
	cfg.AllowPeers, cfg.DenyPeers, cfg.NoOffloadPeers = o.allowPeers, o.denyPeers, o.noOffloadPeers
	return cfg, nil
}

// parseURI reads turn://USER:PASS@ADDR:PORT[?transport=udp].
func parseURI(s string) (netip.AddrPort, string, string, error) {
	var zero netip.AddrPort
	u, err := url.Parse(s)
	if err != nil {
		return zero, "", "", fmt.Errorf("TURN URI %q: %w", s, err)
	}
	if u.Scheme != "turn" {
		return zero, "", "", fmt.Errorf("TURN URI %q: scheme must be turn (turns/TLS is not served)", s)
	}
	if t := u.Query().Get("transport"); t != "" && !strings.EqualFold(t, "udp") {
		return zero, "", "", fmt.Errorf("TURN URI %q: transport %q is not supported, only udp", s, t)
	}
	if u.User == nil || u.User.Username() == "" {
		return zero, "", "", fmt.Errorf("TURN URI %q: no user, want turn://USER:PASS@ADDR:PORT", s)
	}
	pass, ok := u.User.Password()
	if !ok || pass == "" {
		return zero, "", "", fmt.Errorf("TURN URI %q: no password, want turn://USER:PASS@ADDR:PORT", s)
	}
	host, portStr := u.Hostname(), u.Port()
	if portStr == "" {
		portStr = "3478"
	}
	port, err := strconv.ParseUint(portStr, 10, 16)
	if err != nil || port == 0 {
		return zero, "", "", fmt.Errorf("TURN URI %q: invalid port %q", s, portStr)
	}
	addr, err := netip.ParseAddr(host)
	if err != nil {
		return zero, "", "", fmt.Errorf("TURN URI %q: address %q must be an IP address: %w", s, host, err)
	}
	return netip.AddrPortFrom(addr, uint16(port)), u.User.Username(), pass, nil
}
