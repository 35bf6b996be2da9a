// Package endpoints serves the daemon's HTTP endpoints (metrics, health,
// status, pprof): on which addresses an endpoint listens, the limits that keep
// slow or many clients from starving a probe, and the retried bind of a port
// the previous daemon on the node still holds.
package endpoints

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"os"
	"sync"
	"syscall"
	"time"

	"github.com/l7mp/stunnerd-xdp/internal/connlimit"
)

// Limits of the HTTP endpoints: a probe or a scrape is one short request, so
// slow or many clients must not pile up goroutines and file descriptors. At
// httpMaxConns a newcomer displaces a connection that is not being served
// (connlimit.ShedListener), so idle connections cannot make a probe wait.
const (
	httpMaxConns          = 64
	httpReadHeaderTimeout = 5 * time.Second
	httpReadTimeout       = 10 * time.Second
	httpWriteTimeout      = 30 * time.Second // a scrape of a full node
	// A kept-alive idle connection holds one of httpMaxConns: scrapers come
	// back every 15-60 s and can reconnect, holders must not starve them.
	httpIdleTimeout    = 5 * time.Second
	httpMaxHeaderBytes = 16 << 10
)

// Serve serves h on ln with the endpoints' timeouts and connection limit
// until the returned server is closed.
func Serve(ln net.Listener, h http.Handler) *http.Server {
	return ServeSlow(ln, h, httpWriteTimeout)
}

// ServeSlow is Serve for responses that take up to write to send (a CPU
// profile).
func ServeSlow(ln net.Listener, h http.Handler, write time.Duration) *http.Server {
	shed := connlimit.Shed(ln, httpMaxConns)
	// A connection in a handler is not displaced: the handler knows its
	// connection through the request's context.
	served := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if c, ok := r.Context().Value(connKey{}).(net.Conn); ok {
			defer shed.Serving(c)()
		}
		h.ServeHTTP(w, r)
	})
	srv := &http.Server{Handler: served, ReadHeaderTimeout: httpReadHeaderTimeout, ReadTimeout: httpReadTimeout,
		WriteTimeout: write, IdleTimeout: httpIdleTimeout, MaxHeaderBytes: httpMaxHeaderBytes,
		ConnContext: func(ctx context.Context, c net.Conn) context.Context { return context.WithValue(ctx, connKey{}, c) }}
	go func() { _ = srv.Serve(shed) }()
	return srv
}

// connKey is the request context's key for its connection.
type connKey struct{}

// EndpointAddrs are the addresses an endpoint address given without a host
// (":8086", STUNner's "http://:8086") listens on: the pod's address (a
// hostNetwork pod's is the node's internal address, where the kubelet probes
// and Prometheus scrapes) and loopback (kubectl port-forward, a sidecar),
// never the node's every address, which may be public. Without a pod address
// (outside Kubernetes) loopback only. An address with a host, a wildcard
// included, is taken as written.
func EndpointAddrs(addr string, pod netip.Addr) ([]string, error) {
	if addr == "" {
		return nil, nil
	}
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return nil, err
	}
	if host != "" {
		return []string{addr}, nil
	}
	out := []string{net.JoinHostPort("127.0.0.1", port)}
	if pod.IsValid() && !pod.IsLoopback() && !pod.IsUnspecified() {
		out = append([]string{net.JoinHostPort(pod.String(), port)}, out...)
	}
	return out, nil
}

// Endpoints are HTTP servers with one lifetime: the daemon's, or those of
// cmd/stunnerd-xdp answering the kubelet before the first config. A TCP port
// that is taken (the previous daemon on this node is still draining) is
// retried in the background until Close.
type Endpoints struct {
	log  *slog.Logger
	mu   sync.Mutex // a retried listen and Close may race
	srvs []*http.Server
	lns  []net.Listener // closed by Close itself, see add
	stop chan struct{}  // closed by Close: later listens give up
	wg   sync.WaitGroup
}

// New returns an empty set logging to log.
func New(log *slog.Logger) *Endpoints {
	return &Endpoints{log: log, stop: make(chan struct{})}
}

// ServeTCP serves h on each of addr's EndpointAddrs (pod is the pod's
// address).
func (e *Endpoints) ServeTCP(addr string, pod netip.Addr, h http.Handler, what string) error {
	addrs, err := EndpointAddrs(addr, pod)
	if err != nil {
		return fmt.Errorf("%s endpoint %q: %w", what, addr, err)
	}
	for _, a := range addrs {
		if err := e.serveOn(a, h, what); err != nil {
			return err
		}
	}
	return nil
}

func (e *Endpoints) serveOn(addr string, h http.Handler, what string) error {
	listen := func() error {
		e.mu.Lock()
		defer e.mu.Unlock()
		select {
		case <-e.stop:
			return nil // closed
		default:
		}
		ln, err := net.Listen("tcp", addr)
		if err != nil {
			return err
		}
		e.add(ln, h)
		if host, _, _ := net.SplitHostPort(addr); host == "" || net.ParseIP(host).IsUnspecified() {
			e.log.Warn(what+" endpoint listening on every address of the node, public ones included: give it a host to narrow it", "addr", ln.Addr().String())
		} else {
			e.log.Info(what+" endpoint listening", "addr", ln.Addr().String())
		}
		return nil
	}
	err := listen()
	if err == nil {
		return nil
	}
	if !errors.Is(err, syscall.EADDRINUSE) {
		return fmt.Errorf("%s endpoint on %s: %w", what, addr, err)
	}
	e.log.Warn(what+" endpoint busy, retrying until it is free (another stunnerd-xdp on this node?)", "addr", addr)
	e.wg.Add(1)
	go func() {
		defer e.wg.Done()
		t := time.NewTicker(time.Second)
		defer t.Stop()
		for {
			select {
			case <-e.stop:
				return
			case <-t.C:
			}
			if listen() == nil {
				return
			}
		}
	}()
	return nil
}

// add serves h on ln. Its caller holds mu.
func (e *Endpoints) add(ln net.Listener, h http.Handler) {
	e.srvs = append(e.srvs, Serve(ln, h))
	// A server closed before its goroutine reaches Serve closes ln only
	// then: a unix socket would be unlinked after Close returned, under the
	// next server on the same path.
	e.lns = append(e.lns, ln)
}

// Close stops the servers and the retries.
func (e *Endpoints) Close() {
	e.mu.Lock()
	select {
	case <-e.stop:
	default:
		close(e.stop)
	}
	for _, s := range e.srvs {
		_ = s.Close()
	}
	for _, ln := range e.lns {
		_ = ln.Close() // a unix socket is unlinked once, here
	}
	e.srvs, e.lns = nil, nil
	e.mu.Unlock()
	e.wg.Wait()
}

// ServeUnix serves the health endpoints on a unix socket: it answers for this
// process only, which is what a probe needs while two daemons share the node's
// network namespace (`stunnerd-xdp probe` is its client).
func (e *Endpoints) ServeUnix(path string, h http.Handler) error {
	if path == "" {
		return nil
	}
	if fi, err := os.Lstat(path); err == nil && fi.Mode()&os.ModeSocket != 0 {
		_ = os.Remove(path) // left by a daemon that was killed
	}
	ln, err := net.Listen("unix", path)
	if err != nil {
		return fmt.Errorf("health socket: %w", err)
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	e.add(ln, h)
	e.log.Info("health socket listening", "path", path)
	return nil
}
