// Package config reads STUNner's dataplane configuration (`version: v1`, YAML or
// JSON, as stunnerd reads it with -c or gets it from the operator's config
// discovery service) and turns it into what stunnerd-xdp runs: listeners,
// authentication, and per-listener peer allowlists from the clusters.
//
// A field this dataplane does not implement, and a field it does not know (a
// newer operator's), is a warning in Resolved.Warnings and is ignored: a config
// the operator renders must never take a node down. A value it cannot serve
// faithfully (an open relay, a DTLS-only gateway, a bad address) is an error:
// the running configuration stays.
package config

import (
	"cmp"
	"crypto/tls"
	"encoding/base64"
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"net/url"
	"os"
	"reflect"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"

	"sigs.k8s.io/yaml"

	"github.com/l7mp/stunnerd-xdp/internal/prefix"
)

// Stunner is STUNner's dataplane configuration, v1.
type Stunner struct {
	APIVersion string     `json:"version"`
	Admin      Admin      `json:"admin,omitempty"`
	Auth       Auth       `json:"auth"`
	Listeners  []Listener `json:"listeners,omitempty"`
	Clusters   []Cluster  `json:"clusters,omitempty"`
}

// Admin holds the operational settings.
type Admin struct {
	Name                string   `json:"name,omitempty"`
	LogLevel            string   `json:"loglevel,omitempty"`
	MetricsEndpoint     string   `json:"metrics_endpoint,omitempty"`
	HealthCheckEndpoint *string  `json:"healthcheck_endpoint,omitempty"`
	UserQuota           int      `json:"user_quota,omitempty"`
	OffloadEngine       string   `json:"offload_engine,omitempty"`
	OffloadInterfaces   []string `json:"offload_interfaces,omitempty"`
	LicenseConfig       any      `json:"license_config,omitempty"`
}

// Auth is the TURN authentication: static (plaintext) or ephemeral (TURN REST
// API, longterm).
type Auth struct {
	Type        string            `json:"type,omitempty"`
	Realm       string            `json:"realm,omitempty"`
	Credentials map[string]string `json:"credentials"`
}

// Listener is one TURN server socket.
type Listener struct {
	Name       string   `json:"name,omitempty"`
	Protocol   string   `json:"protocol,omitempty"`
	PublicAddr string   `json:"public_address,omitempty"`
	PublicPort int      `json:"public_port,omitempty"`
	Addr       string   `json:"address,omitempty"`
	Port       int      `json:"port,omitempty"`
	Cert       string   `json:"cert,omitempty"`
	Key        string   `json:"key,omitempty"`
	Routes     []string `json:"routes,omitempty"`
	// MinRelayPort and MaxRelayPort are a v1alpha1 listener's relay port
	// range (0: not given); v1 has none (stunnerd v1.2.1 drops them when it
	// converts).
	MinRelayPort int `json:"min_relay_port,omitempty"`
	MaxRelayPort int `json:"max_relay_port,omitempty"`
	// rawAddr is Addr as the document wrote it, before $VARIABLE expansion.
	rawAddr string
}

// Cluster is a set of peers clients may reach through the listeners routing to it.
type Cluster struct {
	Name      string   `json:"name"`
	Type      string   `json:"type,omitempty"`
	Protocol  string   `json:"protocol,omitempty"`
	Endpoints []string `json:"endpoints,omitempty"`
}

// Protocol is a listener's transport.
type Protocol string

const (
	UDP Protocol = "TURN-UDP" // relayed by XDP and pion/turn
	TCP Protocol = "TURN-TCP" // pion/turn in userspace
	TLS Protocol = "TURN-TLS" // pion/turn in userspace
	// DTLS is served by pion/turn in userspace over pion/dtls.
	DTLS Protocol = "TURN-DTLS"
)

// AuthType is the authentication mechanism.
type AuthType string

const (
	AuthStatic    AuthType = "static"
	AuthEphemeral AuthType = "ephemeral"
)

// Defaults, as STUNner's.
const (
	DefaultRealm       = "stunner.l7mp.io"
	DefaultPort        = 3478
	DefaultMetricsAddr = ":8080"
	DefaultHealthAddr  = ":8086"
	// DefaultHealthEndpoint is STUNner's healthcheck_endpoint default.
	DefaultHealthEndpoint = "http://:8086"
	DefaultMetricsPort    = "8080"
	DefaultHealthPort     = "8086"
)

// Resolved is a validated configuration in the daemon's terms.
type Resolved struct {
	// Name is admin.name: the operator renders the gateway's namespace/name there.
	Name        string
	LogLevel    string
	MetricsAddr string // empty: off
	HealthAddr  string // empty: off
	// XDPMode is what admin.offload_engine asks for, in loader.Mode terms
	// ("auto"), or empty when the config has no preference (unset or None,
	// which the operator renders by default: see OffloadEngineNone).
	XDPMode string
	// UserQuota is admin.user_quota: allocations per user-id (0: no quota).
	UserQuota int
	// OffloadEngine is admin.offload_engine as written.
	OffloadEngine string
	// MinRelayPort and MaxRelayPort are the relay port range a v1alpha1
	// config's listeners give (0: none).
	MinRelayPort, MaxRelayPort uint16
	Interfaces                 []string
	Auth                       ResolvedAuth
	Listeners                  []ResolvedListener
	// Source is the configuration as given: /status reports it as stunnerd does.
	Source *Stunner
	// Warnings name what the config asks for that this dataplane ignores:
	// unknown fields, fields it does not implement, listeners it skips.
	Warnings []string
}

// ResolvedAuth is the authentication in force.
type ResolvedAuth struct {
	Type     AuthType
	Realm    string
	Username string // static
	Password string // static
	Secret   string // ephemeral
}

// ResolvedListener is one TURN listener in the daemon's terms, from a config
// file or from the command line. UDP listeners are relayed by XDP (up to 8);
// TCP and TLS ones by pion/turn in userspace.
type ResolvedListener struct {
	Name     string
	Protocol Protocol
	Addr     netip.AddrPort
	// Cert is the TLS certificate of a TURN-TLS listener.
	Cert *tls.Certificate
	// AllowPeers admits peers: the endpoints of the clusters the listener
	// routes to. With Allowlist, a peer outside them is refused even when
	// AllowPeers is empty (STUNner's listener without routes). STRICT_DNS
	// endpoints join them once resolved (ResolveDNS).
	AllowPeers []netip.Prefix
	Allowlist  bool
	// PeerPorts are the STATIC endpoints with their port ranges (1-65535
	// when the endpoint has none): a peer address they cover is reachable on
	// the ports of the endpoints covering it only.
	PeerPorts []Endpoint
	// DNSNames are the STRICT_DNS endpoints the listener routes to.
	DNSNames []string
	// SkippedRoutes name the clusters the listener routes to that the config
	// does not define: skipped, as stunnerd skips them.
	SkippedRoutes []string
	// Clusters are the clusters the listener routes to, in route order: the
	// metrics count a peer's traffic under the first that has it.
	Clusters []ResolvedCluster
}

// ResolvedCluster is a cluster's name and peers.
type ResolvedCluster struct {
	Name  string
	Peers []netip.Prefix
}

// Endpoint is a STATIC cluster endpoint: `IP[/len][:<min-max>]`.
type Endpoint struct {
	Prefix           netip.Prefix
	MinPort, MaxPort uint16
}

// Contains reports whether the endpoint admits the peer address and port.
func (e Endpoint) Contains(p netip.AddrPort) bool {
	return e.Prefix.Contains(p.Addr().Unmap()) && p.Port() >= e.MinPort && p.Port() <= e.MaxPort
}

// SameSocket reports whether two listeners run the same socket: a reload
// keeps such a listener's allocations and changes only its peer policy.
func (l ResolvedListener) SameSocket(o ResolvedListener) bool {
	if l.Name != o.Name || l.Protocol != o.Protocol || l.Addr != o.Addr || (l.Cert == nil) != (o.Cert == nil) {
		return false
	}
	return l.Cert == nil || string(l.Cert.Certificate[0]) == string(o.Cert.Certificate[0])
}

// ErrZeroConfig is the config the operator's discovery service sends for a
// deleted gateway (and stunnerd boots with): no listeners, no clusters, the
// dummy static credentials. stunnerd -w ignores it and keeps serving; so do we.
var ErrZeroConfig = errors.New("zero config (the gateway is deleted, or not rendered yet)")

// Parse decodes a YAML or JSON configuration and resolves it. Unknown fields
// are warnings (Resolved.Warnings), not errors. $VARIABLES anywhere in the
// document but the credentials are expanded from the environment before it is
// decoded, as stunnerd's ParseConfig does ($STUNNER_PORT defaults to
// $STUNNER_PUBLIC_PORT, else 3478). A zero config is ErrZeroConfig.
func Parse(b []byte) (*Resolved, error) {
	return ParseEnv(b, os.LookupEnv)
}

// ParseEnv is Parse with the environment given as a lookup function.
func ParseEnv(b []byte, lookup func(string) (string, bool)) (*Resolved, error) {
	// What the expansion must not touch, read from the document as written:
	// the credentials (a password may hold a '$'), and the listener addresses,
	// to tell an unset $STUNNER_ADDR from an address left out. A lenient
	// shape: the document as written may have $VARIABLES in typed fields
	// (`port: $STUNNER_PORT`, as STUNner's own sample has).
	var raw struct {
		Auth struct {
			Credentials map[string]any `json:"credentials"`
		} `json:"auth"`
		Listeners []struct {
			Addr any `json:"address"`
		} `json:"listeners"`
	}
	if err := yaml.Unmarshal(b, &raw); err != nil {
		return nil, fmt.Errorf("decode: %w", err)
	}
	b = []byte(Expand(string(b), lookup))
	var s Stunner
	if err := yaml.Unmarshal(b, &s); err != nil {
		return nil, fmt.Errorf("decode (after $VARIABLE expansion): %w", err)
	}
	var generic any
	if err := yaml.Unmarshal(b, &generic); err != nil {
		return nil, fmt.Errorf("decode: %w", err)
	}
	for k, v := range raw.Auth.Credentials {
		if str, ok := v.(string); ok {
			if s.Auth.Credentials == nil {
				s.Auth.Credentials = map[string]string{}
			}
			s.Auth.Credentials[k] = str
		}
	}
	if len(raw.Listeners) == len(s.Listeners) {
		for i, l := range raw.Listeners {
			if a, ok := l.Addr.(string); ok {
				s.Listeners[i].rawAddr = a
			}
		}
	}
	unknown := unknownFields(generic, reflect.TypeOf(s), "")
	if s.isZero() {
		return nil, ErrZeroConfig
	}
	r, err := s.Resolve()
	if err != nil {
		return nil, err
	}
	for _, f := range unknown {
		r.Warnings = append(r.Warnings, fmt.Sprintf("unknown field %s: ignored (a newer STUNner's?)", f))
	}
	return r, nil
}

// Expand replaces $VAR and ${VAR} in s from lookup as stunnerd does (an unset
// variable is empty), with $STUNNER_PORT defaulted as stunnerd defaults it:
// when unset or not a number, $STUNNER_PUBLIC_PORT if that is a number, else
// 3478.
func Expand(s string, lookup func(string) (string, bool)) string {
	return os.Expand(s, func(k string) string {
		v, _ := lookup(k)
		if k != "STUNNER_PORT" || isDigits(v) {
			return v
		}
		if p, ok := lookup("STUNNER_PUBLIC_PORT"); ok {
			if _, err := strconv.Atoi(p); err == nil {
				return p
			}
		}
		return strconv.Itoa(DefaultPort)
	})
}

func isDigits(s string) bool {
	return s != "" && strings.Trim(s, "0123456789") == ""
}

// isZero tells the zero config (client.ZeroConfig in STUNner) from a real one.
func (s *Stunner) isZero() bool {
	return len(s.Listeners) == 0 && len(s.Clusters) == 0 && strings.EqualFold(s.Auth.Type, "static") &&
		s.Auth.Credentials["username"] == "dummy-username" && s.Auth.Credentials["password"] == "dummy-password"
}

// unknownFields lists the keys of a decoded document that the JSON tags of t
// do not name (matching as encoding/json does, case-insensitively).
func unknownFields(v any, t reflect.Type, path string) []string {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	var out []string
	switch v := v.(type) {
	case map[string]any:
		if t.Kind() != reflect.Struct {
			return nil // a map field (credentials) or an any (license_config)
		}
		fields := map[string]reflect.Type{}
		for i := range t.NumField() {
			name, _, _ := strings.Cut(t.Field(i).Tag.Get("json"), ",")
			fields[strings.ToLower(name)] = t.Field(i).Type
		}
		keys := slices.Sorted(maps.Keys(v))
		for _, k := range keys {
			p := k
			if path != "" {
				p = path + "." + k
			}
			ft, ok := fields[strings.ToLower(k)]
			if !ok {
				out = append(out, p)
				continue
			}
			out = append(out, unknownFields(v[k], ft, p)...)
		}
	case []any:
		if t.Kind() != reflect.Slice {
			return nil
		}
		for i, e := range v {
			out = append(out, unknownFields(e, t.Elem(), fmt.Sprintf("%s[%d]", path, i))...)
		}
	}
	return out
}

// Offload engines STUNner's admin.offload_engine names.
const (
	// OffloadEngineNone is STUNner's default, which the operator renders for
	// every Dataplane that does not set one. It is not taken as "no XDP": this
	// dataplane exists for its kernel path, and a default nobody chose must
	// not switch it off. It means "no preference": --xdp-mode and the node
	// label decide (auto by default). Turn XDP off with --xdp-mode=off in the
	// Dataplane's args or the node label stunner.l7mp.io/xdp-offload=disabled.
	OffloadEngineNone = "none"
	OffloadEngineAuto = "auto"
	OffloadEngineXDP  = "xdp"
	// OffloadEngineTC asks for STUNner's TC offload; this dataplane offloads
	// at the earlier XDP hook instead (the same bindings, relayed before the
	// stack): it runs as Auto, with a warning.
	OffloadEngineTC = "tc"
)

// Resolve validates the configuration and turns it into daemon terms.
func (s *Stunner) Resolve() (*Resolved, error) {
	switch s.APIVersion {
	case "v1":
	case "v1alpha1":
		// stunnerd converts v1alpha1 (its own sample config's version) to
		// v1: the same fields; the auth types plaintext and longterm, which
		// Auth.resolve reads as static and ephemeral.
	default:
		return nil, fmt.Errorf("version %q is not supported, want v1 or v1alpha1", s.APIVersion)
	}
	r := &Resolved{Name: s.Admin.Name, LogLevel: s.Admin.LogLevel, OffloadEngine: s.Admin.OffloadEngine, Source: s}
	if r.LogLevel == "" {
		r.LogLevel = "all:INFO"
	}
	warn := func(format string, args ...any) { r.Warnings = append(r.Warnings, fmt.Sprintf(format, args...)) }
	var err error
	// As stunnerd: no metrics_endpoint is no metrics (the operator renders
	// one only for a Dataplane with enableMetricsEndpoint); no
	// healthcheck_endpoint is http://:8086, an empty one is none; a URL
	// without a port has the default one.
	if r.MetricsAddr, err = endpointAddr(s.Admin.MetricsEndpoint, DefaultMetricsPort, "admin.metrics_endpoint"); err != nil {
		return nil, err
	}
	health := DefaultHealthAddr
	if s.Admin.HealthCheckEndpoint != nil {
		if health, err = endpointAddr(*s.Admin.HealthCheckEndpoint, DefaultHealthPort, "admin.healthcheck_endpoint"); err != nil {
			return nil, err
		}
	}
	r.HealthAddr = health
	if s.Admin.UserQuota < 0 {
		return nil, fmt.Errorf("admin.user_quota %d: want 0 (no quota) or more", s.Admin.UserQuota)
	}
	r.UserQuota = s.Admin.UserQuota
	if s.Admin.LicenseConfig != nil {
		warn("admin.license_config: ignored (this dataplane has no licensed features)")
	}
	switch e := strings.ToLower(s.Admin.OffloadEngine); e {
	case "", OffloadEngineNone:
	case OffloadEngineAuto, OffloadEngineXDP:
		r.XDPMode = "auto"
	case OffloadEngineTC:
		r.XDPMode = "auto"
		warn("admin.offload_engine TC: running as Auto: XDP where it can transmit, the TC engine beside it where it cannot (--tc-engine, on by default)")
	default:
		// As stunnerd v1.2.1 (stnrv1.NewOffloadEngine): a config naming
		// another engine is refused, not run with a guess.
		return nil, fmt.Errorf("admin.offload_engine %q: unknown offload mode (want None, XDP, TC or Auto)", s.Admin.OffloadEngine)
	}
	r.Interfaces = s.Admin.OffloadInterfaces

	if r.Auth, err = s.Auth.resolve(); err != nil {
		return nil, err
	}

	clusters := map[string]cluster{}
	for i, c := range s.Clusters {
		if c.Name == "" {
			return nil, fmt.Errorf("clusters[%d]: missing name", i)
		}
		if _, dup := clusters[c.Name]; dup {
			return nil, fmt.Errorf("cluster %q: defined twice", c.Name)
		}
		switch p := strings.ToUpper(c.Protocol); p {
		case "", "UDP":
		case "TCP":
			// stunnerd v1.2.1 does not implement TCP clusters either: it admits
			// their endpoints like a UDP cluster's, and relays are UDP.
			warn("cluster %q: protocol TCP is not implemented (as in stunnerd): relays are UDP, its endpoints admit UDP peers", c.Name)
		default:
			return nil, fmt.Errorf("cluster %q: unknown protocol %s, want UDP or TCP", c.Name, c.Protocol)
		}
		var rc cluster
		switch t := strings.ToUpper(c.Type); t {
		case "", "STATIC":
			for _, e := range c.Endpoints {
				ep, err := ParseEndpoint(e)
				if err != nil {
					return nil, fmt.Errorf("cluster %q: endpoint %q: %w", c.Name, e, err)
				}
				rc.static = append(rc.static, ep)
			}
		case "STRICT_DNS":
			for _, e := range c.Endpoints {
				if _, err := netip.ParseAddr(e); err == nil || e == "" || strings.ContainsAny(e, "/: ") {
					return nil, fmt.Errorf("cluster %q: STRICT_DNS endpoint %q: want a DNS name", c.Name, e)
				}
				rc.dns = append(rc.dns, strings.TrimSuffix(e, "."))
			}
		default:
			return nil, fmt.Errorf("cluster %q: unknown type %s, want STATIC or STRICT_DNS", c.Name, c.Type)
		}
		clusters[c.Name] = rc
	}

	seen := map[string]bool{}
	for i, l := range s.Listeners {
		rl, err := l.resolve(clusters)
		if errors.Is(err, errSkipListener) {
			warn("listeners[%d] %q: %v", i, l.Name, err)
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("listeners[%d] %q: %w", i, l.Name, err)
		}
		if seen[rl.Name] {
			return nil, fmt.Errorf("listener %q: defined twice", rl.Name)
		}
		for _, route := range rl.SkippedRoutes {
			warn("listener %q: route to cluster %q, which the config does not define: skipped, as stunnerd does", rl.Name, route)
		}
		seen[rl.Name] = true
		r.Listeners = append(r.Listeners, rl)
	}
	if len(r.Listeners) == 0 {
		// stunnerd runs such a config, serving nothing; it is a warning here
		// too, and the daemon waits for one with a listener (see ErrNoListeners).
		warn("no listeners this dataplane can serve: nothing to serve")
	}
	if n := udpPorts(r.Listeners); n > MaxUDPPorts {
		return nil, fmt.Errorf("%d TURN-UDP listener ports: at most %d (the XDP program's listener-port table, "+
			"MAX_LISTENER_PORTS in bpf/consts.h, has %d slots, and a port outside it would be relayed "+
			"as no listener's); split the listeners over Gateways", n, MaxUDPPorts, MaxUDPPorts)
	}
	if r.MinRelayPort, r.MaxRelayPort, err = s.relayPorts(warn); err != nil {
		return nil, err
	}
	sort.Slice(r.Listeners, func(i, j int) bool { return r.Listeners[i].Name < r.Listeners[j].Name })
	return r, nil
}

// The relay port range a v1alpha1 listener has unless it says otherwise
// (STUNner's v1alpha1 DefaultMinRelayPort and DefaultMaxRelayPort).
const (
	v1alpha1MinRelayPort = 1 << 15
	v1alpha1MaxRelayPort = 1<<16 - 1
)

// relayPorts is the relay port range a v1alpha1 config's listeners give (0,
// 0: none given). One daemon relays from one range: listeners that give
// different ones are refused. In a v1 config the fields warn.
func (s *Stunner) relayPorts(warn func(string, ...any)) (lo, hi uint16, err error) {
	given := false
	for i, l := range s.Listeners {
		if l.MinRelayPort == 0 && l.MaxRelayPort == 0 {
			continue
		}
		if s.APIVersion != "v1alpha1" {
			warn("listeners[%d] %q: min_relay_port and max_relay_port are v1alpha1 fields: ignored in a v1 config (the relay ports are --min-relay-port and --max-relay-port)", i, l.Name)
			continue
		}
		min, max := l.MinRelayPort, l.MaxRelayPort
		if min == 0 {
			min = v1alpha1MinRelayPort
		}
		if max == 0 {
			max = v1alpha1MaxRelayPort
		}
		if min < 1 || max > 65535 || min > max {
			return 0, 0, fmt.Errorf("listeners[%d] %q: relay port range %d-%d: want 1 <= min_relay_port <= max_relay_port <= 65535", i, l.Name, min, max)
		}
		if given && (uint16(min) != lo || uint16(max) != hi) {
			return 0, 0, fmt.Errorf("listeners[%d] %q: relay port range %d-%d, another listener's is %d-%d: one daemon relays from one range", i, l.Name, min, max, lo, hi)
		}
		lo, hi, given = uint16(min), uint16(max), true
	}
	return lo, hi, nil
}

// MaxUDPPorts is how many distinct TURN-UDP listener ports one daemon serves:
// the slots of the XDP program's listener-port table (bpf/consts.h).
const MaxUDPPorts = 8

// udpPorts counts the distinct ports of the UDP listeners.
func udpPorts(ls []ResolvedListener) int {
	ports := map[uint16]bool{}
	for _, l := range ls {
		if l.Protocol == UDP {
			ports[l.Addr.Port()] = true
		}
	}
	return len(ports)
}

// cluster is a resolved cluster: STATIC endpoints or STRICT_DNS names.
type cluster struct {
	static []Endpoint
	dns    []string
}

func (a Auth) resolve() (ResolvedAuth, error) {
	r := ResolvedAuth{Realm: a.Realm}
	if r.Realm == "" {
		r.Realm = DefaultRealm
	}
	switch strings.ToLower(a.Type) {
	case "", "static", "plaintext":
		r.Type = AuthStatic
		r.Username, r.Password = a.Credentials["username"], a.Credentials["password"]
		if r.Username == "" || r.Password == "" {
			return r, errors.New("auth: static authentication needs credentials.username and credentials.password")
		}
	case "ephemeral", "longterm", "timewindowed":
		r.Type = AuthEphemeral
		r.Secret = a.Credentials["secret"]
		if r.Secret == "" {
			return r, errors.New("auth: ephemeral authentication needs credentials.secret")
		}
	case "none":
		return r, errors.New("auth: type none is not supported: an open relay is an amplifier")
	default:
		return r, fmt.Errorf("auth: unknown type %q, want static or ephemeral", a.Type)
	}
	return r, nil
}

// errSkipListener marks a listener this dataplane cannot serve: it is left
// out with a warning and the others run.
var errSkipListener = errors.New("listener skipped")

func (l Listener) resolve(clusters map[string]cluster) (ResolvedListener, error) {
	r := ResolvedListener{Name: l.Name, Allowlist: true}
	if r.Name == "" {
		return r, errors.New("missing name")
	}
	switch strings.ToUpper(l.Protocol) {
	case "", "UDP", "TURN-UDP":
		r.Protocol = UDP
	case "TCP", "TURN-TCP":
		r.Protocol = TCP
	case "TLS", "TURN-TLS":
		r.Protocol = TLS
	case "DTLS", "TURN-DTLS":
		r.Protocol = DTLS
	default:
		return r, fmt.Errorf("unknown protocol %q", l.Protocol)
	}
	addrStr := strings.TrimSpace(l.Addr)
	if addrStr == "" && strings.TrimSpace(l.rawAddr) != "" {
		// An unset $STUNNER_ADDR must not quietly become a wildcard
		// (stunnerd would listen on 0.0.0.0 here).
		return r, fmt.Errorf("address %q expands to nothing: is the variable set?", l.rawAddr)
	}
	if addrStr == "" {
		addrStr = "0.0.0.0"
	}
	addr, err := netip.ParseAddr(addrStr)
	if err != nil {
		return r, fmt.Errorf("address %q (from %q) is not an IP address", addrStr, cmp.Or(l.rawAddr, l.Addr))
	}
	port := l.Port
	if port == 0 {
		port = DefaultPort
	}
	if port < 1 || port > 65535 {
		return r, fmt.Errorf("port %d out of range", port)
	}
	r.Addr = netip.AddrPortFrom(addr.Unmap(), uint16(port))
	if r.Protocol == TLS || r.Protocol == DTLS {
		cert, err := decodeCert(r.Protocol, l.Cert, l.Key)
		if err != nil {
			return r, err
		}
		r.Cert = cert
	} else if l.Cert != "" || l.Key != "" {
		return r, fmt.Errorf("cert and key are for TURN-TLS and TURN-DTLS listeners, not %s", r.Protocol)
	}
	for _, route := range l.Routes {
		c, ok := clusters[route]
		if !ok {
			// stunnerd's permission handler skips a route whose cluster is
			// not there (the operator renders routes before their clusters
			// exist): the listener admits the peers of the others.
			r.SkippedRoutes = append(r.SkippedRoutes, route)
			continue
		}
		for _, e := range c.static {
			r.AllowPeers = append(r.AllowPeers, e.Prefix)
			r.PeerPorts = append(r.PeerPorts, e)
		}
		r.DNSNames = append(r.DNSNames, c.dns...)
		rc := ResolvedCluster{Name: route}
		for _, e := range c.static {
			rc.Peers = append(rc.Peers, e.Prefix)
		}
		r.Clusters = append(r.Clusters, rc)
	}
	return r, nil
}

// decodeCert reads a base64-encoded PEM certificate and key, as STUNner has them.
func decodeCert(p Protocol, certB64, keyB64 string) (*tls.Certificate, error) {
	if certB64 == "" || keyB64 == "" {
		return nil, fmt.Errorf("a %s listener needs cert and key (base64-encoded PEM)", p)
	}
	certPEM, err := base64.StdEncoding.DecodeString(certB64)
	if err != nil {
		return nil, fmt.Errorf("cert is not base64: %w", err)
	}
	keyPEM, err := base64.StdEncoding.DecodeString(keyB64)
	if err != nil {
		return nil, fmt.Errorf("key is not base64: %w", err)
	}
	cert, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		return nil, fmt.Errorf("TLS certificate: %w", err)
	}
	return &cert, nil
}

// ParseEndpoint reads a STATIC cluster endpoint as STUNner writes it: an
// address or a CIDR prefix, optionally followed by a port range `:<min-max>`
// (the operator renders a backend's port and endPort so).
func ParseEndpoint(s string) (Endpoint, error) {
	e := Endpoint{MinPort: 1, MaxPort: 65535}
	if m := portRange.FindStringSubmatch(s); m != nil {
		lo, err1 := strconv.ParseUint(m[2], 10, 16)
		hi, err2 := strconv.ParseUint(m[3], 10, 16)
		if err1 != nil || err2 != nil || lo == 0 || hi < lo {
			return e, fmt.Errorf("port range <%s-%s>: want 1 <= min <= max <= 65535", m[2], m[3])
		}
		s, e.MinPort, e.MaxPort = m[1], uint16(lo), uint16(hi)
	}
	p, err := prefix.Parse(s)
	if err != nil {
		return e, fmt.Errorf("%w (with an optional :<min-max> port range; DNS names belong in STRICT_DNS clusters)", err)
	}
	e.Prefix = p
	return e, nil
}

// portRange is STUNner's endpoint port-range suffix (internal/util.ParseEndpoint).
var portRange = regexp.MustCompile(`^(.*):<([0-9]+)-([0-9]+)>$`)

// endpointAddr turns "http://:8080/metrics" into ":8080", and a URL without a
// port into the one with defPort; empty means off.
func endpointAddr(ep, defPort, field string) (string, error) {
	if ep == "" {
		return "", nil
	}
	u, err := url.Parse(ep)
	if err != nil || u.Scheme != "http" || u.Host == "" {
		return "", fmt.Errorf("%s %q: want http://ADDR:PORT[/path]", field, ep)
	}
	if u.Path != "" && u.Path != "/" && !(field == "admin.metrics_endpoint" && u.Path == "/metrics") {
		return "", fmt.Errorf("%s %q: path %q is not supported (metrics are at /metrics, health at /live and /ready)", field, ep, u.Path)
	}
	host, port := u.Hostname(), u.Port()
	if port == "" {
		port = defPort
	}
	if _, err := strconv.ParseUint(port, 10, 16); err != nil {
		return "", fmt.Errorf("%s %q: bad port", field, ep)
	}
	if strings.Contains(host, ":") {
		host = "[" + host + "]"
	}
	return host + ":" + port, nil
}
