package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os"
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

func (o origin) String() string {
	if o.cds != nil {
		return o.cds.String()
	}
	return "file://" + o.file
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
			return origin{}, fmt.Errorf("config origin %q: %w", s, err)
		}
		switch strings.ToLower(scheme) {
		case "http", "ws":
			u.Scheme = "http"
		case "https", "wss":
			u.Scheme = "https"
		default:
			return origin{}, fmt.Errorf("config origin %q: scheme %q, want http(s), ws(s) or file", s, scheme)
		}
		if u.Host == "" {
			return origin{}, fmt.Errorf("config origin %q: no host", s)
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
	log             *slog.Logger
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
	resp, err := c.http.Do(req)
	if err != nil {
		return nil, fmt.Errorf("CDS %s: %w", c.base, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 16<<20))
	if err != nil {
		return nil, fmt.Errorf("CDS %s: %w", c.base, err)
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("CDS %s: %s: %s", c.base, resp.Status, bytes.TrimSpace(b))
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
		c.log.Warn("config discovery connection lost, reconnecting", "server", c.base.String(), "error", fmt.Sprint(err), "in", backoff.String())
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
	d := websocket.Dialer{HandshakeTimeout: 10 * time.Second, Proxy: http.ProxyFromEnvironment}
	conn, resp, err := d.DialContext(ctx, u.String(), hdr)
	if resp != nil && resp.Body != nil {
		resp.Body.Close()
	}
	if err != nil {
		return false, err
	}
	defer conn.Close()
	c.log.Info("connected to the config discovery server", "url", u.String())

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
