// Package config reads STUNner's dataplane configuration (`version: v1`, YAML or
// JSON, as stunnerd reads it with -c) and turns it into what stunnerd-xdp runs:
// listeners, authentication, and per-listener peer allowlists from the
// clusters. What it does not support is an error that says so, never a silent
// default.
package config

import (
	"crypto/tls"
	"encoding/base64"
	"errors"
	"fmt"
	"net/netip"
	"net/url"
	"os"
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
)

// Resolved is a validated configuration in the daemon's terms.
type Resolved struct {
	LogLevel    string
	MetricsAddr string // empty: off
	HealthAddr  string // empty: off
	// XDPMode and Interfaces come from admin.offload_engine and
	// admin.offload_interfaces; empty when the config does not say.
	XDPMode    string
	Interfaces []string
	Auth       ResolvedAuth
	Listeners  []ResolvedListener
	// Source is the configuration as given: /status reports it as stunnerd does.
	Source *Stunner
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
	// AllowPeers is empty (STUNner's listener without routes).
	AllowPeers []netip.Prefix
	Allowlist  bool
	// Clusters are the clusters the listener routes to, in route order: the
	// metrics count a peer's traffic under the first that has it.
	Clusters []ResolvedCluster
}

// ResolvedCluster is a cluster's name and peers.
type ResolvedCluster struct {
	Name  string
	Peers []netip.Prefix
}

// SameSocket reports whether two listeners run the same socket: a reload
// keeps such a listener's allocations and changes only its peer policy.
func (l ResolvedListener) SameSocket(o ResolvedListener) bool {
	if l.Name != o.Name || l.Protocol != o.Protocol || l.Addr != o.Addr || (l.Cert == nil) != (o.Cert == nil) {
		return false
	}
	return l.Cert == nil || string(l.Cert.Certificate[0]) == string(o.Cert.Certificate[0])
}

func ReadFile(path string) (*Resolved, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("read config: %w", err)
	}
	r, err := Parse(b)
	if err != nil {
		return nil, fmt.Errorf("config %s: %w", path, err)
	}
	return r, nil
}

// Parse decodes a YAML or JSON configuration strictly (unknown fields are
// errors) and resolves it. $VARIABLES in listener addresses are expanded from
// the environment, as STUNner's $STUNNER_ADDR.
func Parse(b []byte) (*Resolved, error) {
	var s Stunner
	if err := yaml.UnmarshalStrict(b, &s); err != nil {
		return nil, fmt.Errorf("decode: %w", err)
	}
	return s.Resolve()
}

// Resolve validates the configuration and turns it into daemon terms.
func (s *Stunner) Resolve() (*Resolved, error) {
	if s.APIVersion != "v1" {
		return nil, fmt.Errorf("version %q is not supported, want v1", s.APIVersion)
	}
	r := &Resolved{LogLevel: s.Admin.LogLevel, Source: s}
	if r.LogLevel == "" {
		r.LogLevel = "all:INFO"
	}
	var err error
	if r.MetricsAddr, err = endpointAddr(s.Admin.MetricsEndpoint, DefaultMetricsAddr, "admin.metrics_endpoint"); err != nil {
		return nil, err
	}
	health := DefaultHealthAddr
	if s.Admin.HealthCheckEndpoint != nil {
		if health, err = endpointAddr(*s.Admin.HealthCheckEndpoint, "", "admin.healthcheck_endpoint"); err != nil {
			return nil, err
		}
	}
	r.HealthAddr = health
	if s.Admin.UserQuota != 0 {
		return nil, errors.New("admin.user_quota is not supported")
	}
	if s.Admin.LicenseConfig != nil {
		return nil, errors.New("admin.license_config is not supported")
	}
	switch strings.ToLower(s.Admin.OffloadEngine) {
	case "":
	case "none":
		r.XDPMode = "off"
	case "auto", "xdp":
		r.XDPMode = "auto"
	default:
		return nil, fmt.Errorf("admin.offload_engine %q is not supported: want None, Auto or XDP", s.Admin.OffloadEngine)
	}
	r.Interfaces = s.Admin.OffloadInterfaces

	if r.Auth, err = s.Auth.resolve(); err != nil {
		return nil, err
	}

	clusters := map[string][]netip.Prefix{}
	for i, c := range s.Clusters {
		if c.Name == "" {
			return nil, fmt.Errorf("clusters[%d]: missing name", i)
		}
		if _, dup := clusters[c.Name]; dup {
			return nil, fmt.Errorf("cluster %q: defined twice", c.Name)
		}
		if t := strings.ToUpper(c.Type); t != "" && t != "STATIC" {
			return nil, fmt.Errorf("cluster %q: type %s is not supported, only STATIC (endpoint addresses and prefixes)", c.Name, c.Type)
		}
		if p := strings.ToUpper(c.Protocol); p != "" && p != "UDP" {
			return nil, fmt.Errorf("cluster %q: protocol %s is not supported, only UDP", c.Name, c.Protocol)
		}
		var ps []netip.Prefix
		for _, e := range c.Endpoints {
			p, err := prefix.Parse(e) // STRICT_DNS names are refused with the type
			if err != nil {
				return nil, fmt.Errorf("cluster %q: endpoint %q: %w", c.Name, e, err)
			}
			ps = append(ps, p)
		}
		clusters[c.Name] = ps
	}

	seen := map[string]bool{}
	for i, l := range s.Listeners {
		rl, err := l.resolve(clusters)
		if err != nil {
			return nil, fmt.Errorf("listeners[%d] %q: %w", i, l.Name, err)
		}
		if seen[rl.Name] {
			return nil, fmt.Errorf("listener %q: defined twice", rl.Name)
		}
		seen[rl.Name] = true
		r.Listeners = append(r.Listeners, rl)
	}
	if len(r.Listeners) == 0 {
		return nil, errors.New("no listeners")
	}
	sort.Slice(r.Listeners, func(i, j int) bool { return r.Listeners[i].Name < r.Listeners[j].Name })
	return r, nil
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

func (l Listener) resolve(clusters map[string][]netip.Prefix) (ResolvedListener, error) {
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
		return r, errors.New("protocol TURN-DTLS is not supported (UDP, TCP and TLS are)")
	default:
		return r, fmt.Errorf("unknown protocol %q", l.Protocol)
	}
	addrStr := os.ExpandEnv(l.Addr)
	if addrStr == "" && l.Addr != "" {
		// An unset $STUNNER_ADDR must not quietly become a wildcard.
		return r, fmt.Errorf("address %q expands to nothing: is the variable set?", l.Addr)
	}
	if addrStr == "" {
		addrStr = "0.0.0.0"
	}
	addr, err := netip.ParseAddr(addrStr)
	if err != nil {
		return r, fmt.Errorf("address %q (from %q) is not an IP address", addrStr, l.Addr)
	}
	port := l.Port
	if port == 0 {
		port = DefaultPort
	}
	if port < 1 || port > 65535 {
		return r, fmt.Errorf("port %d out of range", port)
	}
	r.Addr = netip.AddrPortFrom(addr.Unmap(), uint16(port))
	if r.Protocol == TLS {
		cert, err := decodeCert(l.Cert, l.Key)
		if err != nil {
			return r, err
		}
		r.Cert = cert
	} else if l.Cert != "" || l.Key != "" {
		return r, fmt.Errorf("cert and key are for TURN-TLS listeners, not %s", r.Protocol)
	}
	for _, route := range l.Routes {
		ps, ok := clusters[route]
		if !ok {
			return r, fmt.Errorf("route to unknown cluster %q", route)
		}
		r.AllowPeers = append(r.AllowPeers, ps...)
		r.Clusters = append(r.Clusters, ResolvedCluster{Name: route, Peers: ps})
	}
	return r, nil
}

// decodeCert reads a base64-encoded PEM certificate and key, as STUNner has them.
func decodeCert(certB64, keyB64 string) (*tls.Certificate, error) {
	if certB64 == "" || keyB64 == "" {
		return nil, errors.New("a TURN-TLS listener needs cert and key (base64-encoded PEM)")
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

// endpointAddr turns "http://:8080/metrics" into ":8080"; empty means off.
func endpointAddr(ep, def, field string) (string, error) {
	if ep == "" {
		return def, nil
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
		return "", fmt.Errorf("%s %q: missing port", field, ep)
	}
	if _, err := strconv.ParseUint(port, 10, 16); err != nil {
		return "", fmt.Errorf("%s %q: bad port", field, ep)
	}
	if strings.Contains(host, ":") {
		host = "[" + host + "]"
	}
	return host + ":" + port, nil
}
