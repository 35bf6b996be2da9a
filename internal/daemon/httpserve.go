package daemon

import (
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/http/pprof"
	"time"

	"github.com/l7mp/stunnerd-xdp/internal/endpoints"
	"github.com/l7mp/stunnerd-xdp/internal/status"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// servePprof serves Go's profiles on a loopback address (validate checks).
func (d *Daemon) servePprof(addr string) error {
	if addr == "" {
		return nil
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
	mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("pprof endpoint on %s: %w", addr, err)
	}
	srv := endpoints.ServeSlow(ln, mux, 2*time.Minute) // a CPU profile takes 30 s by default
	d.closers = append(d.closers, func() { _ = srv.Close() })
	d.log.Info("pprof endpoint listening", "addr", ln.Addr().String())
	return nil
}

func (d *Daemon) serveHTTP() error {
	cfg := d.config() // the endpoints' addresses need a restart to change
	e := endpoints.New(d.log)
	d.closers = append(d.closers, e.Close)
	mm := http.NewServeMux()
	mm.Handle("/metrics", promhttp.HandlerFor(d.registry, promhttp.HandlerOpts{}))
	if err := e.ServeTCP(cfg.MetricsAddr, cfg.PodAddr, mm, "metrics"); err != nil {
		return err
	}
	hm := http.NewServeMux()
	hm.HandleFunc("/live", func(w http.ResponseWriter, _ *http.Request) { status.WriteLive(w) })
	hm.HandleFunc("/ready", func(w http.ResponseWriter, _ *http.Request) {
		// Clusters that blackhole UDP to unready pods would cut live sessions
		// during the drain: --force-ready-status keeps it green for them.
		if d.draining.Load() && !d.config().ForceReady {
			status.WriteReady(w, "terminating")
			return
		}
		status.WriteReady(w, "")
	})
	hm.HandleFunc("/status", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(d.Status())
	})
	if err := e.ServeTCP(cfg.HealthAddr, cfg.PodAddr, hm, "health"); err != nil {
		return err
	}
	if err := e.ServeUnix(cfg.HealthSocket, hm); err != nil {
		return err
	}
	return d.servePprof(cfg.PprofAddr)
}
