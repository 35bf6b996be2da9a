// Command stunnerd-xdp is a TURN server (pion/turn) whose UDP ChannelData hot
// path runs in XDP. It is run like STUNner's stunnerd, and answers to that
// name too (the image links stunnerd to it):
//
//	stunnerd-xdp [flags] turn://USER:PASS@ADDR:PORT
//	stunnerd -w    (the operator's args; STUNNER_CONFIG_ORIGIN and STUNNER_NAME/NAMESPACE set)
package main

import (
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"time"

	flag "github.com/spf13/pflag"

	"github.com/l7mp/stunnerd-xdp/internal/channelmap"
	"github.com/l7mp/stunnerd-xdp/internal/config"
	"github.com/l7mp/stunnerd-xdp/internal/connlimit"
	"github.com/l7mp/stunnerd-xdp/internal/daemon"
	"github.com/l7mp/stunnerd-xdp/internal/loader"
	"github.com/l7mp/stunnerd-xdp/internal/prefix"
	"github.com/l7mp/stunnerd-xdp/internal/quota"
	"github.com/l7mp/stunnerd-xdp/internal/steering"
)

const usageHead = `stunnerd-xdp: a TURN server (pion/turn) whose UDP ChannelData hot path runs in XDP,
a drop-in dataplane for STUNner (it answers to the name stunnerd as well).

Usage:
  stunnerd-xdp [flags] turn://USER:PASS@ADDR:PORT[?transport=udp|tcp]
  stunnerd-xdp [flags] turns://USER:PASS@ADDR:PORT    (TLS, a self-signed certificate)
  stunnerd-xdp [flags] [-c ORIGIN] [-w] [-i NAMESPACE/NAME]
  stunnerd-xdp probe [--health-socket PATH] live|ready|status

ORIGIN (-c, or $STUNNER_CONFIG_ORIGIN; default :13478, as stunnerd's) is where
STUNner's dataplane config (version v1 or v1alpha1; $VARIABLES expanded but in
the credentials) comes from: the operator's config discovery service as
IP:PORT, HOST:PORT, http(s):// or ws(s):// (--cds-ca and --cds-cert/--cds-key
for TLS), which serves the gateway NAMESPACE/NAME (-i,
or $STUNNER_NAMESPACE/$STUNNER_NAME) for the node $STUNNER_NODENAME; or a file
as file://PATH or a plain PATH. With -w the config is watched: the daemon starts
unready and serves from the first valid config, a change reloads it without
dropping the sessions it does not touch, a lost server is reconnected with
backoff, and a deleted gateway's empty config is ignored (as stunnerd does: the
pod's termination drains it). The operator starts a Dataplane as
  stunnerd -w --udp-thread-num=16
with STUNNER_CONFIG_ORIGIN, STUNNER_NAME, STUNNER_NAMESPACE, STUNNER_ADDR and
STUNNER_NODENAME set; $STUNNER_ADDR in listener addresses is the pod's address.

pion/turn handles everything that needs judgement (Allocate, authentication,
CreatePermission, ChannelBind, Refresh, STUN Binding) and mirrors each channel
binding into BPF maps; an XDP program relays the bound ChannelData in the
kernel. Whatever XDP cannot relay, and everything when XDP is unavailable, is
relayed by pion/turn in userspace. The config's admin.offload_engine None
(the operator's default) does not turn XDP off: --xdp-mode=off or the node
label stunner.l7mp.io/xdp-offload=disabled does.

Two daemons may run on one node at once (a rolling update with surge): they
share the TURN ports through SO_REUSEPORT and a steering program whose maps are
pinned under --steering-dir; clients with allocations stay with their daemon,
new clients go to the newest one, and the newcomer takes over XDP when the old
one detaches (the old one's TC engine keeps relaying its sessions). Daemons of
different Gateways run side by side too, each on its own ports: an interface
takes one XDP program, the first daemon's; the others' TC engines relay there
in the kernel until it frees. The probe command checks this process's health
over --health-socket, which stays per-pod while the health port is shared.

ADDR may be 0.0.0.0 (then --relay-address is required). Example:
  stunnerd-xdp --relay-address 10.0.0.5 --log=all:INFO,turn:DEBUG turn://user1:passwd1@0.0.0.0:3478

Flags:
`

type options struct {
	log, logFormat, realm, relayAddr, xdpMode, xdpIfaces string
	metricsAddr, healthAddr, healthSocket, steeringDir   string
	pprofAddr                                            string
	minPort, maxPort                                     uint
	maxBindings                                          uint
	maxAllocPPS, maxAllocBPS                             uint64
	overLimit                                            string
	forceReady, verbose, dryRun                          bool
	shortcut, version, tcEngine, listenerShield          bool
	tcIfaces                                             string
	udpThreadNum, maxPermissions                         int
	userQuota, totalQuota                                quotaFlag
	gracePeriod                                          time.Duration
	conns                                                connlimit.Limits // TCP and TLS listeners' clients
	maxChannels, admissionBurst                          int
	admissionRate                                        float64
	allowPeers, denyPeers, noOffloadPeers                prefixList
	configOrigin, id, nodeName, kubeconfig               string
	// cdsNode is the node the config discovery service patches configs for
	// ($STUNNER_NODENAME); labelNode says whether nodeName came from it only.
	cdsNode   string
	labelNode bool
	watch     bool
	set       map[string]bool // flags given on the command line
	// cds is how the config discovery service is found and trusted;
	// ignoredK8s names the Kubernetes client flags given (not used here).
	cds        cdsOptions
	ignoredK8s []string
	// defaultOrigin says the origin is stunnerd's default, none being given.
	defaultOrigin bool
}

// prefixList is a repeatable flag of CIDR prefixes or addresses.
// quotaFlag is a quota: a number (0: no limit) or "auto", the daemon's
// default (daemon.AutoQuota).
type quotaFlag int

func (q *quotaFlag) String() string {
	if *q == daemon.AutoQuota {
		return "auto"
	}
	return strconv.Itoa(int(*q))
}

func (q *quotaFlag) Set(v string) error {
	if v == "auto" {
		*q = daemon.AutoQuota
		return nil
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 0 {
		return fmt.Errorf("%q: want auto, 0 (no limit) or more", v)
	}
	*q = quotaFlag(n)
	return nil
}

func (q *quotaFlag) Type() string { return "N|auto" }

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

func (l *prefixList) Type() string { return "CIDR" }

func main() {
	// Answer to stunnerd's name as to ours: the operator runs `stunnerd`.
	os.Exit(run(os.Args[1:], os.Stderr))
}

// errUsage is bad input on the command line (exit 2).
var errUsage = errors.New("usage")

// errVersion says --version was given: print it and exit 0, whatever else the
// command line holds.
var errVersion = errors.New("version")

// parseFlags reads the command line and the environment stunnerd reads.
func parseFlags(args []string, stderr io.Writer) (options, *flag.FlagSet, error) {
	fs := flag.NewFlagSet("stunnerd-xdp", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.SortFlags = false
	var o options
	// stunnerd's own flags, with its short forms.
	fs.StringVarP(&o.configOrigin, "config", "c", "", "config `ORIGIN`: the config discovery service as IP:PORT, HOST:PORT, http(s):// or ws(s)://,\nor a file as file://PATH or a plain PATH (default: $STUNNER_CONFIG_ORIGIN); 'k8s' is refused with an explanation")
	fs.BoolVarP(&o.watch, "watch", "w", false, "watch the config origin: start unready, serve from the first valid config, apply changes\nwithout dropping the sessions they do not touch, reconnect to a lost server")
	fs.StringVarP(&o.log, "log", "l", "all:INFO", "log levels per scope: `SPEC` as scope:LEVEL,... with LEVEL TRACE, DEBUG, INFO, WARN, ERROR or DISABLE;\nscope 'all' is the default; scopes include turn, auth, control, loader, stunnerd-xdp, cds\n(given, it wins over the config's admin.loglevel)")
	fs.StringVarP(&o.id, "id", "i", "", "`NAMESPACE/NAME` of the gateway whose config to ask the discovery service for\n(default: $STUNNER_NAMESPACE/$STUNNER_NAME, else default/stunnerd-HOSTNAME)")
	fs.BoolVarP(&o.dryRun, "dry-run", "d", false, "check the command line and the config (a file, or one fetched from the server), print what\nwould run, and exit without opening sockets or loading XDP")
	fs.BoolVarP(&o.verbose, "verbose", "v", false, "verbose logging, the same as -l all:DEBUG")
	fs.IntVarP(&o.udpThreadNum, "udp-thread-num", "u", 0, "userspace readloops per UDP listener, each on its own SO_REUSEPORT socket;\n0: one per CPU, at most 16 (stunnerd reads 0 as one)")
	fs.BoolVar(&o.forceReady, "force-ready-status", false, "keep /ready green while draining, for clusters that blackhole UDP to unready pods")
	fs.StringVar(&o.logFormat, "log-format", "text", "log format: text or json")
	// This project's flags.
	fs.StringVar(&o.realm, "realm", config.DefaultRealm, "TURN realm for long-term credentials")
	fs.StringVar(&o.relayAddr, "relay-address", "", "`IP` that relay sockets bind to and relayed packets leave from\n(default: the listener address when it is not a wildcard)")
	fs.UintVar(&o.minPort, "min-relay-port", daemon.DefaultMinRelayPort, "lowest relay port (relay ports are host ports)")
	fs.UintVar(&o.maxPort, "max-relay-port", daemon.DefaultMaxRelayPort, "highest relay port")
	fs.StringVar(&o.xdpMode, "xdp-mode", string(loader.ModeAuto), "XDP attach `MODE`: auto (native, then generic, then userspace), native, generic or off (where\nanother daemon's XDP program holds an interface, the TC engine relays there alone); given, it wins over the config's admin.offload_engine; the node label stunner.l7mp.io/xdp-offload wins over both")
	fs.StringVar(&o.xdpIfaces, "xdp-iface", "", "`IFACE[,IFACE]` to attach XDP to (default: the interfaces carrying the listener and relay addresses)")
	fs.BoolVar(&o.tcEngine, "tc-engine", true, "load the TC engine beside XDP: it relays on the skb path what XDP cannot transmit (into a pod's veth,\n"+
		"a bridge, a VXLAN/Geneve device) and what local pods send to relay ports (on the interfaces --tc-iface matches)")
	fs.BoolVar(&o.listenerShield, "listener-shield", true, "drop at the UDP listeners, in the kernel (in the read loops where no program runs), what pion/turn would discard\n"+
		"unanswered: ChannelData from a client without an allocation, datagrams that are neither ChannelData nor STUN, STUN\n"+
		"pion/turn has no handler for (a response, an unknown method); counted by reason as drop_shield_* in\n"+
		"stunnerd_xdp_verdicts_total and stunnerd_xdp_userspace_shield_dropped_total")
	fs.Float64Var(&o.admissionRate, "admission-rate", daemon.DefaultAdmissionRate, "with the listener shield, the `REQUESTS` per second each source address without an allocation may send\n"+
		"(an unauthenticated Allocate, a Binding); the rest is dropped (drop_shield_admission), so that a flood from a\n"+
		"few addresses cannot starve the others' Allocates; 0: no limit")
	fs.IntVar(&o.admissionBurst, "admission-burst", daemon.DefaultAdmissionBurst, "how many such requests a source address may send at once (clients behind one NAT share it)")
	fs.StringVar(&o.tcIfaces, "tc-iface", strings.Join(loader.DefaultTCPatterns, ","), "`PATTERN[,PATTERN]` of interfaces the TC engine attaches to as they come and go, while XDP is attached:\n"+
		"pod:veth  every pod's host-side veth, whatever the CNI calls it (a veth whose peer is in another network\n"+
		"          namespace: Calico cali*, Cilium lxc*, EKS eni*, AKS azv*, bridge plugins veth*, Antrea, OVN-Kubernetes);\n"+
		"          a veth pair with both ends on the node is not a pod's\n"+
		"kind:K    every device of link kind K (ip -d link): kind:vxlan, kind:geneve are overlay devices such as flannel.1,\n"+
		"          kind:ipip, kind:wireguard Calico's tunl0 and wireguard.cali (Cilium's cilium_ipip4, cilium_wg0),\n"+
		"          where a masqueraded peer's replies come back; kind:veth is every veth, pods' or not\n"+
		"NAME      a shell pattern of names, e.g. cali*,lxc* to narrow the default to those CNIs' pods\n"+
		"empty: only beside XDP")
	fs.BoolVar(&o.shortcut, "channeldata-shortcut", true, "in userspace, relay on pion/turn's channels and permissions without pion/turn's per-datagram\n"+
		"handling: ChannelData from clients in the listener's read loop, peers' datagrams in the relay socket's;\n"+
		"the writes pion/turn would make; false: pion/turn handles every datagram")
	fs.UintVar(&o.maxBindings, "max-bindings", daemon.DefaultMaxBindings, "channel bindings the XDP maps hold; beyond that flows stay in userspace")
	o.userQuota, o.totalQuota = daemon.AutoQuota, daemon.AutoQuota
	fs.Var(&o.userQuota, "user-quota", "allocations one user-id may hold at once (the user-id of ephemeral credentials EXPIRY:USERID\n"+
		"or USERID:EXPIRY is USERID); over it, Allocate gets 486 Allocation Quota Reached; 0: no quota;\n"+
		"auto: the config's admin.user_quota when set, else "+strconv.Itoa(quota.DefaultPerUser)+" when the credentials tell users apart\n"+
		"(ephemeral, or several static users), none for one static username (every client is that user)")
	fs.Var(&o.totalQuota, "total-quota", "allocations the daemon holds at once, over all listeners; over it, Allocate gets 486; 0: no quota;\n"+
		"auto: the relay ports in the range, at most one per "+strconv.Itoa(quota.AllocationBytes>>10)+" KiB of half the memory limit (cgroup or machine)")
	fs.IntVar(&o.maxPermissions, "max-permissions", 0, "peer IPs one allocation may hold permissions for; beyond it CreatePermission and ChannelBind\nto a new peer IP fail (refreshes do not); 0: no limit")
	fs.IntVar(&o.maxChannels, "max-channels", 64, "channels one allocation may hold; beyond it a ChannelBind for a new channel gets 508\n"+
		"Insufficient Capacity (refreshes pass); 0: no limit (pion binds up to 16,384)")
	// The TCP and TLS listeners' clients (internal/connlimit; docs/operations.md, Security).
	o.conns.MaxFrame = connlimit.DefaultMaxFrame
	fs.IntVar(&o.conns.MaxConns, "max-tcp-conns", connlimit.DefaultMaxConns, "open connections over all TURN-TCP and TURN-TLS listeners; over it a new connection is\n"+
		"reset at accept (each can pin about 50 KiB, see docs/operations.md); 0: no cap")
	fs.IntVar(&o.conns.MaxConnsPerSource, "max-tcp-conns-per-source", connlimit.DefaultMaxConnsPerSource, "open TURN-TCP and TURN-TLS connections from one client IP (IPv6: one /64); 0: no cap")
	fs.DurationVar(&o.conns.HandshakeTimeout, "tls-handshake-timeout", connlimit.DefaultHandshakeTimeout, "time a TURN-TLS client has to complete its TLS handshake; 0: no limit")
	fs.DurationVar(&o.conns.IdleTimeout, "tcp-idle-timeout", connlimit.DefaultIdleTimeout, "a TURN-TCP or TURN-TLS connection that sends no whole STUN message or ChannelData\n"+
		"for this long is closed, with its allocation (a waiting client refreshes its allocation within\n"+
		"the 10 min of its default lifetime; ICE checks consent every few seconds); 0: never")
	fs.DurationVar(&o.conns.FrameTimeout, "tcp-frame-timeout", connlimit.DefaultFrameTimeout, "time from the first to the last byte of one STUN message or ChannelData on a TURN-TCP or\n"+
		"TURN-TLS connection; slower, the connection is closed (a slow-body attack); 0: no limit")
	fs.Uint64Var(&o.maxAllocPPS, "max-alloc-pps", 0, "datagrams per second one allocation may relay, all its channels and both directions together,\n"+
		"in the kernel and in userspace alike (a burst of 50 ms worth); 0: no limit")
	fs.Uint64Var(&o.maxAllocBPS, "max-alloc-bps", 0, "application-data BYTES (not bits) per second one allocation may relay, all its channels and\n"+
		"both directions together, like coturn's max-bps (a burst of 50 ms worth); 0: no limit")
	fs.StringVar(&o.overLimit, "over-limit", "drop", "what the XDP program does with a datagram over --max-alloc-pps/-bps: drop (XDP_DROP,\n"+
		"counted as rate_limited) or pass (to the stack and pion/turn, whose relay socket charges the same\n"+
		"bucket and drops it there: the limit holds either way)")
	fs.StringVar(&o.metricsAddr, "metrics-addr", ":8080", "`ADDR` for Prometheus metrics at /metrics (empty: off); without a host it listens on the pod's\n"+
		"address ($POD_IP, else $STUNNER_ADDR) and loopback, not on every address of the node")
	fs.StringVar(&o.healthAddr, "health-addr", ":8086", "`ADDR` for health checks at /live, /ready and /status (empty: off); without a host, as --metrics-addr")
	fs.StringVar(&o.pprofAddr, "pprof-addr", "", "loopback `ADDR` (like 127.0.0.1:6060) serving Go's profiles at /debug/pprof/ (empty: off)")
	fs.StringVar(&o.healthSocket, "health-socket", "", "`PATH` of a unix socket serving /live, /ready and /status for this process only\n(for exec probes: 'stunnerd-xdp probe --health-socket PATH ready'; empty: off)")
	fs.StringVar(&o.steeringDir, "steering-dir", steering.DefaultDir, "bpffs `DIR` where the daemons of a node share their TURN ports for hitless rolling updates\n(a subdirectory per network namespace; empty: ports are bound exclusively)")
	// The flag's name before the steering had one name (issue 26).
	fs.StringVar(&o.steeringDir, "handover-dir", steering.DefaultDir, "the old name of --steering-dir")
	_ = fs.MarkDeprecated("handover-dir", "use --steering-dir")
	fs.Var(&o.allowPeers, "allow-peer", "`CIDR` of peers clients may relay to (repeatable); when given, it is an allowlist.\n"+
		"The defaults refuse internal networks (RFC 1918, 100.64.0.0/10, 198.18.0.0/15, fc00::/7, the cluster's\n"+
		"Service CIDRs), loopback, link-local, multicast and this node's addresses; a CIDR inside one of them\n"+
		"opens that part (10.244.0.0/16 opens it, 0.0.0.0/0 does not)")
	fs.Var(&o.denyPeers, "deny-peer", "`CIDR` of peers clients may not relay to (repeatable); the most specific prefix wins")
	fs.Var(&o.noOffloadPeers, "no-offload-peer", "`CIDR` of peers relayed by pion/turn in userspace only, never by XDP (repeatable): ranges the node\n"+
		"NATs (the XDP path runs before netfilter) or whose firewall rules must apply; the cluster's Service CIDRs\n"+
		"are added when --node-name gives access to the Kubernetes API")
	fs.StringVar(&o.nodeName, "node-name", "", "`NODE` whose label stunner.l7mp.io/xdp-offload (enabled|disabled) attaches or detaches XDP live;\n"+
		"empty: no label, --xdp-mode decides (default: $NODE_NAME; else $STUNNER_NODENAME, followed only when\nthe Kubernetes API answers)")
	fs.StringVar(&o.kubeconfig, "kubeconfig", os.Getenv("KUBECONFIG"), "kubeconfig `FILE` for --node-name outside a cluster (default: in-cluster config)")
	fs.BoolVar(&o.version, "version", false, "print the version (set by the build: release tag or VCS revision) and exit")
	fs.DurationVar(&o.gracePeriod, "grace-period", time.Hour, "on SIGTERM or SIGINT, how long to drain: new allocations are refused,\nlive ones keep relaying until they end or this runs out; a second signal exits at once")
	addStunnerdFlags(fs, &o)
	fs.Usage = func() {
		fmt.Fprint(stderr, usageHead)
		fs.PrintDefaults()
	}
	err := fs.Parse(args)
	if err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return o, fs, err
		}
		return o, fs, fmt.Errorf("%w: %w", errUsage, err)
	}
	if o.version {
		return o, fs, errVersion
	}
	o.set = map[string]bool{}
	fs.Visit(func(f *flag.Flag) { o.set[f.Name] = true })
	if o.verbose && !o.set["log"] {
		o.log = "all:DEBUG"
	}
	if o.maxPermissions < 0 {
		return o, fs, fmt.Errorf("%w: --max-permissions %d: want 0 (no limit) or more", errUsage, o.maxPermissions)
	}
	if o.udpThreadNum < 0 {
		return o, fs, fmt.Errorf("%w: --udp-thread-num %d: want 0 (one per CPU) or more", errUsage, o.udpThreadNum)
	}
	// The environment the operator sets, as stunnerd reads it.
	if o.configOrigin == "" && fs.NArg() == 0 {
		o.configOrigin = os.Getenv("STUNNER_CONFIG_ORIGIN")
	}
	if o.id == "" {
		ns, okNS := os.LookupEnv("STUNNER_NAMESPACE")
		name, okName := os.LookupEnv("STUNNER_NAME")
		if okNS && okName {
			o.id = ns + "/" + name
		}
	}
	o.cdsNode = os.Getenv("STUNNER_NODENAME")
	if !o.set["node-name"] {
		if o.nodeName = os.Getenv("NODE_NAME"); o.nodeName == "" && o.cdsNode != "" {
			o.nodeName, o.labelNode = o.cdsNode, true
		}
	}
	o.ignoredK8s = ignoredK8sFlags(fs)
	switch {
	case fs.NArg() > 1:
		return o, fs, fmt.Errorf("%w: one TURN URI at most, like turn://user:pass@10.0.0.1:3478 (see --help)", errUsage)
	case o.configOrigin != "" && fs.NArg() != 0:
		return o, fs, fmt.Errorf("%w: a TURN URI and a config origin (-c or $STUNNER_CONFIG_ORIGIN) exclude each other", errUsage)
	case o.configOrigin == "" && fs.NArg() == 0:
		// As stunnerd: the config discovery service on this host.
		o.configOrigin, o.defaultOrigin = stunnerdDefaultOrigin, true
	}
	if o.configOrigin == "k8s" {
		if o.configOrigin, err = k8sOrigin(o.cds); err != nil {
			return o, fs, err
		}
	}
	if (o.cds.cert == "") != (o.cds.key == "") {
		return o, fs, fmt.Errorf("%w: --cds-cert and --cds-key go together", errUsage)
	}
	return o, fs, nil
}

func run(args []string, stderr io.Writer) int {
	if len(args) > 0 && args[0] == "probe" {
		return probe(args[1:], os.Stdout, stderr)
	}
	o, fs, err := parseFlags(args, stderr)
	if errors.Is(err, flag.ErrHelp) {
		return 0
	}
	if errors.Is(err, errVersion) {
		fmt.Println(versionString())
		return 0
	}
	if err != nil {
		fmt.Fprintf(stderr, "stunnerd-xdp: %v\n", strings.TrimPrefix(err.Error(), errUsage.Error()+": "))
		return 2
	}
	setGCDefault(os.Getenv)
	if o.configOrigin != "" {
		return runOrigin(o, stderr, make(chan os.Signal, 2))
	}
	cfg, err := buildConfig(o, fs.Arg(0))
	if err != nil {
		fmt.Fprintf(stderr, "stunnerd-xdp: %v\n", err)
		return 2
	}
	return runURI(o, cfg, stderr, make(chan os.Signal, 2))
}

// buildConfig turns the flags and the URI into a daemon configuration.
func buildConfig(o options, uri string) (daemon.Config, error) {
	u, err := parseURI(uri)
	if err != nil {
		return daemon.Config{}, err
	}
	cfg, err := flagsConfig(o)
	if err != nil {
		return cfg, err
	}
	if u.proto == config.UDP {
		cfg.Listen = u.addr
	} else {
		l := config.ResolvedListener{Name: "default", Protocol: u.proto, Addr: u.addr}
		if u.proto == config.TLS || u.proto == config.DTLS {
			// As stunnerd: a self-signed certificate for a TLS or DTLS URI.
			if l.Cert, err = selfSigned(); err != nil {
				return cfg, err
			}
		}
		cfg.Listeners = []config.ResolvedListener{l}
	}
	cfg.Users = map[string]string{u.user: u.pass}
	return cfg, nil
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
	cfg.TCEngine = o.tcEngine
	cfg.NoListenerShield = !o.listenerShield
	if o.admissionRate < 0 || o.admissionRate > 0 && o.admissionBurst < 1 {
		return cfg, fmt.Errorf("--admission-rate %v --admission-burst %d: want a rate of 0 (no limit) or more and a burst of 1 or more", o.admissionRate, o.admissionBurst)
	}
	cfg.AdmissionRate, cfg.AdmissionBurst = o.admissionRate, o.admissionBurst
	for _, p := range strings.Split(o.tcIfaces, ",") {
		if p = strings.TrimSpace(p); p == "" {
			continue
		}
		if err := loader.CheckIfacePatterns([]string{p}); err != nil {
			return cfg, fmt.Errorf("--tc-iface %q: %w", p, err)
		}
		cfg.TCPatterns = append(cfg.TCPatterns, p)
	}
	if o.gracePeriod < 0 {
		return cfg, fmt.Errorf("--grace-period %v: must not be negative", o.gracePeriod)
	}
	if o.maxBindings == 0 || o.maxBindings > 1<<24 {
		return cfg, fmt.Errorf("--max-bindings %d: want 1-%d", o.maxBindings, 1<<24)
	}
	cfg.MaxBindings = uint32(o.maxBindings)
	cfg.MetricsAddr, cfg.HealthAddr, cfg.ForceReady = o.metricsAddr, o.healthAddr, o.forceReady
	cfg.PodAddr, cfg.PprofAddr = podAddr(), o.pprofAddr
	cfg.HealthSocket, cfg.SteeringDir = o.healthSocket, o.steeringDir
	cfg.UDPThreadNum, cfg.NoShortcut = o.udpThreadNum, !o.shortcut
	cfg.UserQuota, cfg.TotalQuota, cfg.MaxPermissions = int(o.userQuota), int(o.totalQuota), o.maxPermissions
	if o.maxChannels < 0 {
		return cfg, fmt.Errorf("--max-channels %d: want 0 (no limit) or more", o.maxChannels)
	}
	cfg.MaxChannels = o.maxChannels
	if o.conns != (connlimit.Limits{}) { // zero: the daemon's defaults
		if err := o.conns.Validate(); err != nil {
			return cfg, err
		}
		cfg.ConnLimits = o.conns
	}
	cfg.RateLimit = channelmap.RateLimit{PacketsPerSecond: o.maxAllocPPS, BytesPerSecond: o.maxAllocBPS}
	switch o.overLimit {
	case "", "drop":
	case "pass":
		cfg.RateLimit.Pass = true
	default:
		return cfg, fmt.Errorf("--over-limit %q: want drop or pass", o.overLimit)
	}
	cfg.AllowPeers, cfg.DenyPeers, cfg.NoOffloadPeers = o.allowPeers, o.denyPeers, o.noOffloadPeers
	return cfg, nil
}

// podAddr is the pod's address, where the endpoints listen beside loopback:
// $POD_IP (the downward API's status.podIP; a hostNetwork pod's is the node's
// internal address), else $STUNNER_ADDR (the operator sets it to the same).
func podAddr() netip.Addr {
	for _, env := range []string{"POD_IP", "STUNNER_ADDR"} {
		if a, err := netip.ParseAddr(os.Getenv(env)); err == nil {
			return a.Unmap()
		}
	}
	return netip.Addr{}
}
