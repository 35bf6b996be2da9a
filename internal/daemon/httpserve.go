package daemon

import (
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// serve starts an HTTP server on addr; while the port is taken (the previous
// daemon on this node is still draining) it retries in the background.
func (d *Daemon) serve(addr string, h http.Handler, what string) error {
	if addr == "" {
		return nil
	}
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 5 * time.Second}
	d.https = append(d.https, srv)
	listen := func() error {
		ln, err := net.Listen("tcp", addr)
		if err != nil {
			return err
		}
		go func() { _ = srv.Serve(ln) }()
		d.log.Info(what+" endpoint listening", "addr", ln.Addr().String())
		return nil
	}
	err := listen()
	if err == nil {
		return nil
	}
	if !errors.Is(err, syscall.EADDRINUSE) {
		return fmt.Errorf("%s endpoint on %s: %w", what, addr, err)
	}
	d.log.Warn(what+" endpoint busy, retrying until it is free (another stunnerd-xdp on this node?)", "addr", addr)
	d.wg.Add(1)
	go func() {
		defer d.wg.Done()
		d.tick(time.Second, func() bool { return listen() == nil })
	}()
	return nil
}

func (d *Daemon) serveHTTP() error {
	cfg := d.config() // the endpoints' addresses need a restart to change
	mm := http.NewServeMux()
	mm.Handle("/metrics", promhttp.HandlerFor(d.registry, promhttp.HandlerOpts{}))
	if err := d.serve(cfg.MetricsAddr, mm, "metrics"); err != nil {
		return err
	}
	hm := http.NewServeMux()
	hm.HandleFunc("/live", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(`{"status":"live"}` + "\n"))
	})
	hm.HandleFunc("/ready", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		// Clusters that blackhole UDP to unready pods would cut live sessions
		// during the drain: --force-ready-status keeps it green for them.
		if d.draining.Load() && !d.config().ForceReady {
			w.WriteHeader(http.StatusServiceUnavailable)
			_, _ = w.Write([]byte(`{"status":"terminating"}` + "\n"))
			return
		}
		_, _ = w.Write([]byte(`{"status":"ready"}` + "\n"))
	})
	hm.HandleFunc("/status", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(d.Status())
	})
	if err := d.serve(cfg.HealthAddr, hm, "health"); err != nil {
		return err
	}
	return d.serveUnix(cfg.HealthSocket, hm)
}
