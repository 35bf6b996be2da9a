package main

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os"
	"regexp"
	"strings"
	"time"

	"github.com/gorilla/websocket"
)

// The CDS protocol's timings, as STUNner's client has them
// (pkg/config/client): a ping every 5 s, a dead connection after 8 s without
// any message.
const (
	cdsPingPeriod = 5 * time.Second
	cdsPongWait   = 8 * time.Second
	cdsWriteWait  = 2 * time.Second
	// Reconnects back off from cdsMinBackoff, doubling up to cdsMaxBackoff.
	cdsMinBackoff = 250 * time.Millisecond
	cdsMaxBackoff = 5 * time.Second
	// cdsPath is the operator's config discovery API for one gateway.
	cdsPath = "/api/v1/configs/%s/%s"
)

// errK8sOrigin explains why `-c k8s` is refused.
var errK8sOrigin = errors.New(`config origin "k8s": stunnerd finds the operator's config discovery pod through the ` +
	`Kubernetes API and port-forwards to it, for running outside the cluster; stunnerd-xdp runs in the cluster, ` +
	`where the operator sets STUNNER_CONFIG_ORIGIN: give that address instead ` +
	`(-c http://stunner-config-discovery.stunner-system.svc:13478)`)

// origin is where the configuration comes from.
type origin struct {
	file string   // a file path (file://PATH or a plain path)
	cds  *url.URL // the CDS server's base URL (http or https)
}

// String is the origin for logs and errors: credentials in the URL redacted.
func (o origin) String() string {
	if o.cds != nil {
		return redactURL(o.cds)
	}
	return "file://" + o.file
}

// redacted stands for credentials in what is logged.
const redacted = "REDACTED"

// redactURL is u without its credentials (user and password, which the
// client sends as basic auth) and query (a token may be there).
func redactURL(u *url.URL) string {
	c := *u
	if c.User != nil {
		c.User = url.User(redacted)
	}
	if c.RawQuery != "" {
		c.RawQuery = redacted
	}
	return c.String()
}

// userinfo is the user[:password]@ of a URL written as a string.
var userinfo = regexp.MustCompile(`(?i)^([a-z][a-z0-9+.-]*://)[^/?#]*@`)

// redactURI is s, a URL or URI as given, without its credentials: for
// errors about a string that may not even parse.
func redactURI(s string) string {
	if u, err := url.Parse(s); err == nil && u.Host != "" {
		return redactURL(u)
	}
	return userinfo.ReplaceAllString(s, "${1}"+redacted+"@")
}

// urlError is err without the URL url.Parse puts in it (it may hold a
// password).
func urlError(err error) error {
	if ue, ok := err.(*url.Error); ok {
		return ue.Err
	}
	return err
}

// parseOrigin reads -c/--config or STUNNER_CONFIG_ORIGIN as stunnerd does:
// IP:port or HOST:port and http(s):// and ws(s):// are a CDS server, file://PATH
// or a plain path is a file; k8s is refused (errK8sOrigin).
func parseOrigin(s string) (origin, error) {
	switch {
	case s == "":
		return origin{}, errors.New("empty config origin")
	case s == "k8s":
		return origin{}, errK8sOrigin
	case strings.HasPrefix(s, "file://"):
		return origin{file: strings.TrimPrefix(s, "file://")}, nil
	}
	if scheme, _, ok := strings.Cut(s, "://"); ok {
		u, err := url.Parse(s)
		if err != nil {
			return origin{}, fmt.Errorf("config origin %q: %w", redactURI(s), urlError(err))
		}
		switch strings.ToLower(scheme) {
		case "http", "ws":
			u.Scheme = "http"
		case "https", "wss":
			u.Scheme = "https"
		default:
			return origin{}, fmt.Errorf("config origin %q: scheme %q, want http(s), ws(s) or file", redactURI(s), scheme)
		}
		if u.Host == "" {
			return origin{}, fmt.Errorf("config origin %q: no host", redactURI(s))
		}
		u.Path, u.RawQuery = "", ""
		return origin{cds: u}, nil
	}
	// HOST:PORT (":13478" too) is a server; anything else a file.
	if host, port, err := net.SplitHostPort(s); err == nil && !strings.Contains(host, "/") && port != "" {
		return origin{cds: &url.URL{Scheme: "http", Host: s}}, nil
	}
	return origin{file: s}, nil
}

// parseID reads -i/--id NAMESPACE/NAME.
func parseID(id string) (namespace, name string, err error) {
	namespace, name, ok := strings.Cut(id, "/")
	if !ok || namespace == "" || name == "" || strings.Contains(name, "/") {
		return "", "", fmt.Errorf("id %q: want NAMESPACE/NAME (the gateway's)", id)
	}
	return namespace, name, nil
}

// cdsClient gets one gateway's config from the operator's config discovery
// service (STUNner's OpenAPI: pkg/config/api/stunner_openapi.yaml).
type cdsClient struct {
	base            *url.URL
	namespace, name string
	node            string
	http            *http.Client
	// tls is the https/wss client's configuration (nil: Go's default).
	tls *tls.Config
	log *slog.Logger
}

// cdsMaxConfig bounds a config read from the discovery service, over HTTP
// and as a websocket message: a STUNner config is kilobytes (tens with TLS
// certificates); a server that sends more is not one to take configs from,
// and must not be able to make the daemon buffer without end.
const cdsMaxConfig = 4 << 20

// errConfigTooLarge is a config over cdsMaxConfig.
var errConfigTooLarge = fmt.Errorf("config larger than %d bytes", cdsMaxConfig)

// cdsTLS builds the config discovery client's TLS configuration from
// --cds-ca, --cds-cert and --cds-key; nil when none is given.
func cdsTLS(c cdsOptions) (*tls.Config, error) {
	if c.ca == "" && c.cert == "" {
		return nil, nil
	}
	cfg := &tls.Config{MinVersion: tls.VersionTLS12}
	if c.ca != "" {
		pemBytes, err := os.ReadFile(c.ca)
		if err != nil {
			return nil, fmt.Errorf("--cds-ca: %w", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pemBytes) {
			return nil, fmt.Errorf("--cds-ca %s: no PEM certificate in it", c.ca)
		}
		cfg.RootCAs = pool
	}
	if c.cert != "" {
		cert, err := tls.LoadX509KeyPair(c.cert, c.key)
		if err != nil {
			return nil, fmt.Errorf("--cds-cert/--cds-key: %w", err)
		}
		cfg.Certificates = []tls.Certificate{cert}
	}
	return cfg, nil
}

func (c *cdsClient) url(watch bool) *url.URL {
	u := *c.base
	u.Path = fmt.Sprintf(cdsPath, url.PathEscape(c.namespace), url.PathEscape(c.name))
	q := url.Values{}
	if watch {
		q.Set("watch", "true")
		u.Scheme = map[string]string{"http": "ws", "https": "wss"}[u.Scheme]
	}
	if c.node != "" {
		q.Set("node", c.node)
	}
	u.RawQuery = q.Encode()
	return &u
}

// get loads the config once (GET /api/v1/configs/{namespace}/{name}).
func (c *cdsClient) get(ctx context.Context) ([]byte, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, c.url(false).String(), nil)
	if err != nil {
		return nil, err
	}
	server := redactURL(c.base)
	resp, err := c.http.Do(req)
	if err != nil {
		// net/http's error names the URL with the password masked, but the
		// user and the query in clear: only the cause.
		return nil, fmt.Errorf("CDS %s: %w", server, urlError(err))
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, cdsMaxConfig+1))
	if err != nil {
		return nil, fmt.Errorf("CDS %s: %w", server, err)
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("CDS %s: %s: %.200s", server, resp.Status, bytes.TrimSpace(b))
	}
	if len(b) > cdsMaxConfig {
		return nil, fmt.Errorf("CDS %s: %w", server, errConfigTooLarge)
	}
	return b, nil
}

// watch streams the gateway's configs to out until ctx ends, reconnecting
// with backoff: the server sends the current config on every connection.
func (c *cdsClient) watch(ctx context.Context, out chan []byte) {
	backoff := cdsMinBackoff
	for ctx.Err() == nil {
		served, err := c.stream(ctx, out)
		if ctx.Err() != nil {
			return
		}
		if served {
			backoff = cdsMinBackoff
		}
		c.log.Warn("config discovery connection lost, reconnecting", "server", redactURL(c.base), "error", fmt.Sprint(urlError(err)), "in", backoff.String())
		select {
		case <-ctx.Done():
			return
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, cdsMaxBackoff)
	}
}

// stream runs one websocket connection; served says whether it brought a
// config (a server that accepts and hangs up at once is backed off from).
// It never blocks on out: out (one slot) keeps the newest config, so the
// reader keeps answering pings while the daemon is busy with a reload.
func (c *cdsClient) stream(ctx context.Context, out chan []byte) (served bool, err error) {
	u := c.url(true)
	// The server's origin check wants an http:// origin of its own host.
	hdr := http.Header{"Origin": {(&url.URL{Scheme: c.base.Scheme, Host: c.base.Host}).String()}}
	d := websocket.Dialer{HandshakeTimeout: 10 * time.Second, Proxy: http.ProxyFromEnvironment, TLSClientConfig: c.tls}
	conn, resp, err := d.DialContext(ctx, u.String(), hdr)
	if resp != nil && resp.Body != nil {
		resp.Body.Close()
	}
	if err != nil {
		return false, err
	}
	defer conn.Close()
	// A message over the limit fails the read (websocket.ErrReadLimit) and
	// the connection, which is retried with backoff.
	conn.SetReadLimit(cdsMaxConfig)
	c.log.Info("connected to the config discovery server", "url", redactURL(u))

	done := make(chan struct{})
	defer close(done)
	go func() {
		// The pinger; closing the connection on ctx's end unblocks the reader.
		t := time.NewTicker(cdsPingPeriod)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				_ = conn.WriteControl(websocket.CloseMessage, websocket.FormatCloseMessage(websocket.CloseNormalClosure, ""), time.Now().Add(cdsWriteWait))
				conn.Close()
				return
			case <-done:
				return
			case <-t.C:
				if err := conn.WriteControl(websocket.PingMessage, []byte("keepalive"), time.Now().Add(cdsWriteWait)); err != nil {
					conn.Close()
					return
				}
			}
		}
	}()
	_ = conn.SetReadDeadline(time.Now().Add(cdsPongWait))
	conn.SetPongHandler(func(string) error { return conn.SetReadDeadline(time.Now().Add(cdsPongWait)) })
	for {
		typ, msg, err := conn.ReadMessage()
		if err != nil {
			return served, err
		}
		_ = conn.SetReadDeadline(time.Now().Add(cdsPongWait))
		if typ != websocket.TextMessage || len(msg) == 0 {
			continue
		}
		served = true
		latest(out, msg)
	}
}

// latest puts msg in out (one slot, this goroutine its only sender), replacing
// a config the daemon has not taken yet: only the newest matters.
func latest(out chan []byte, msg []byte) {
	select {
	case out <- msg:
		return
	default:
	}
	select {
	case <-out:
	default:
	}
	out <- msg
}

// watchFile polls a config file and sends its content when it changes: a
// ConfigMap update swaps a symlink, which a content check sees and an inotify
// on the file would miss.
func watchFile(ctx context.Context, path string, last []byte, out chan<- []byte) {
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		b, err := os.ReadFile(path)
		if err != nil || len(b) == 0 || bytes.Equal(b, last) {
			continue // a file being replaced is briefly missing or empty
		}
		last = b
		select {
		case out <- b:
		case <-ctx.Done():
			return
		}
	}
}
