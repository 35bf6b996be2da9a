package daemon

import (
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"runtime"
	"slices"
	"time"

	"github.com/l7mp/stunnerd-xdp/internal/channelmap"
	"github.com/l7mp/stunnerd-xdp/internal/config"
	"github.com/l7mp/stunnerd-xdp/internal/connlimit"
	"github.com/l7mp/stunnerd-xdp/internal/credentials"
	"github.com/l7mp/stunnerd-xdp/internal/listener"
	"github.com/l7mp/stunnerd-xdp/internal/loader"
	"github.com/l7mp/stunnerd-xdp/internal/logging"
	"github.com/l7mp/stunnerd-xdp/internal/metrics"
	"github.com/l7mp/stunnerd-xdp/internal/offload"
	"github.com/l7mp/stunnerd-xdp/internal/quota"
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
	// NoListenerShield turns the listener shield off: the programs then pass
	// to pion/turn what it discards unanswered (bpf/relay.c listener_shield).
	NoListenerShield bool
	// AdmissionRate is how many requests per second each source address
	// without an allocation may send (an Allocate before it is answered, a
	// Binding), AdmissionBurst how many at once; the shield drops the rest in
	// the kernel (0: no limit).
	AdmissionRate  float64
	AdmissionBurst int
	// load loads the program in place of LoadXDP and LoadEngines: what a
	// test gives to stand for a kernel that refuses it.
	load offload.LoadFunc

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

	// SteeringDir is the bpffs directory under which the daemons of a node
	// share listener steering (one subdirectory per network namespace);
	// empty: listeners are bound exclusively.
	SteeringDir string
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
	// NoShortcut leaves every datagram that reaches userspace to pion/turn's
	// own handlers; by default the listener's read loop relays ChannelData
	// on pion's channels itself (userspace.Channels) and the relay sockets
	// relay peers' datagrams to the client (userspace.Replies): the writes
	// pion would make, without its per-datagram allocations.
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
	// The listener shield's admission (--admission-rate, --admission-burst):
	// a client needs two or three requests before it has an allocation,
	// and a NAT may put a few hundred clients behind one address.
	DefaultAdmissionRate  = 100
	DefaultAdmissionBurst = 200
	// MaxUDPThreadNum bounds the read loops per UDP listener; the default, one
	// per CPU, stops at DefaultMaxUDPThreads so that two daemons' sockets
	// (a rolling update) fit the steering array on a big node.
	MaxUDPThreadNum      = 64
	DefaultMaxUDPThreads = 16
)

// Check validates cfg as Start does, without opening a socket or loading a
// program: what a dry run (-d) reports, so that it calls valid only what a
// real start takes.
func Check(cfg Config) error { return cfg.validate() }

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
		case (l.Protocol == config.TLS || l.Protocol == config.DTLS) && l.Cert == nil:
			return fmt.Errorf("listener %q: %s needs a certificate", l.Name, l.Protocol)
		case l.Protocol != config.UDP && l.Protocol != config.TCP && l.Protocol != config.TLS && l.Protocol != config.DTLS:
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

// listenerSettings are the settings every listener runs with.
func (c *Config) listenerSettings() listener.Settings {
	loops := c.UDPThreadNum
	if loops == 0 {
		loops = min(runtime.NumCPU(), DefaultMaxUDPThreads)
	}
	return listener.Settings{
		Realm: c.Realm, RelayAddress: c.RelayAddress, MinRelayPort: c.MinRelayPort, MaxRelayPort: c.MaxRelayPort,
		ChannelBindTimeout: c.ChannelBindTimeout, SocketBuffer: c.SocketBuffer, ReadLoops: loops,
		NoShortcut: c.NoShortcut, MaxChannels: c.MaxChannels, AllowPeers: c.AllowPeers, DenyPeers: c.DenyPeers,
	}
}

// credentials are the configured credentials.
func (c *Config) credentials() credentials.Set {
	return credentials.Set{Realm: c.Realm, Users: c.Users, Secret: c.Secret}
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

// AutoQuota in Config.UserQuota or Config.TotalQuota asks for the default.
const AutoQuota = -1

// memoryLimit is the process's memory limit (a variable for tests).
var memoryLimit = quota.MemoryLimit

// resolveQuotas replaces AutoQuota with the defaults:
//   - the total quota is what the relay port range and the memory limit
//     allow (quota.DefaultTotal);
//   - the per-user quota is quota.DefaultPerUser when the credentials tell
//     users apart: ephemeral credentials (the user-id beside the expiry) or
//     more than one static user. With one static username every client is
//     the same user, and a per-user quota would be a second total quota:
//     none, and the total quota bounds them all.
func (c *Config) resolveQuotas() {
	if c.TotalQuota == AutoQuota {
		mem, err := memoryLimit()
		if err != nil {
			mem = 0 // the port range alone
		}
		c.TotalQuota = quota.DefaultTotal(int(c.MaxRelayPort)-int(c.MinRelayPort)+1, mem)
	}
	if c.UserQuota == AutoQuota {
		c.UserQuota = 0
		if c.Secret != "" || len(c.Users) > 1 {
			c.UserQuota = quota.DefaultPerUser
			if c.TotalQuota > 0 {
				c.UserQuota = min(c.UserQuota, c.TotalQuota)
			}
		}
	}
}

// quotaLimits are the configured quotas.
func (c *Config) quotaLimits() quota.Limits {
	return quota.Limits{PerUser: c.UserQuota, Total: c.TotalQuota}
}

// udpListenerAddrs are the socket addresses of the UDP listeners.
func (c *Config) udpListenerAddrs() []netip.AddrPort {
	var out []netip.AddrPort
	for _, l := range c.Listeners {
		if l.Protocol == config.UDP {
			out = append(out, l.Addr)
		}
	}
	return out
}

// keepRunning makes c, the configuration a reload asks for, keep from the
// running one cur what only a restart changes and what the command line set
// (it does not change under a running process); it names the settings c
// wanted to change but cannot. With validate, this is where the reload's
// precedence is decided: command line over config file, running over new.
func (c *Config) keepRunning(cur *Config) (kept []string) {
	if c.RelayAddress != cur.RelayAddress {
		kept = append(kept, "relay address")
	}
	if c.MinRelayPort != cur.MinRelayPort || c.MaxRelayPort != cur.MaxRelayPort {
		kept = append(kept, "relay port range")
	}
	if c.MaxBindings != cur.MaxBindings {
		kept = append(kept, "max bindings")
	}
	if c.MetricsAddr != cur.MetricsAddr || c.HealthAddr != cur.HealthAddr {
		kept = append(kept, "metrics and health endpoints")
	}
	if len(c.Interfaces) > 0 && !slices.Equal(c.Interfaces, cur.Interfaces) {
		kept = append(kept, "XDP interfaces")
	}
	c.RelayAddress, c.MinRelayPort, c.MaxRelayPort = cur.RelayAddress, cur.MinRelayPort, cur.MaxRelayPort
	c.MaxBindings, c.MetricsAddr, c.HealthAddr, c.Interfaces = cur.MaxBindings, cur.MetricsAddr, cur.HealthAddr, cur.Interfaces
	c.SocketBuffer, c.ReconcileInterval, c.ChannelBindTimeout = cur.SocketBuffer, cur.ReconcileInterval, cur.ChannelBindTimeout
	c.PodAddr, c.PprofAddr = cur.PodAddr, cur.PprofAddr
	c.XDPMode, c.RateLimit = cur.XDPMode, cur.RateLimit
	return kept
}
