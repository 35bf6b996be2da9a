package main

import (
	"bytes"
	"fmt"
	"os"
	"time"

	"github.com/l7mp/stunnerd-xdp/internal/config"
	"github.com/l7mp/stunnerd-xdp/internal/daemon"
	"github.com/l7mp/stunnerd-xdp/internal/loader"
	"github.com/l7mp/stunnerd-xdp/internal/logging"
)

// fromFile builds the daemon configuration from a STUNner config file and the
// flags: the file gives listeners, auth, allowlists, log level, endpoints and
// offload settings; a flag given on the command line wins.
func fromFile(o options, r *config.Resolved) (daemon.Config, error) {
	// The flags give everything the file does not; then the file overrides
	// what it sets and the command line did not.
	cfg, err := flagsConfig(o)
	if err != nil {
		return cfg, err
	}
	if !o.set["realm"] {
		cfg.Realm = r.Auth.Realm
	}
	switch r.Auth.Type {
	case config.AuthStatic:
		cfg.Users = map[string]string{r.Auth.Username: r.Auth.Password}
	case config.AuthEphemeral:
		cfg.Secret = r.Auth.Secret
	}
	cfg.Listeners = r.Listeners
	cfg.Source = r.Source
	if !o.set["log"] {
		o.log = r.LogLevel
	}
	if !o.set["metrics-addr"] {
		cfg.MetricsAddr = r.MetricsAddr
	}
	if !o.set["health-addr"] {
		cfg.HealthAddr = r.HealthAddr
	}
	// internal/offload weighs the two: a mode given on the command line wins.
	if !o.set["xdp-mode"] {
		cfg.XDPMode = ""
	}
	if r.XDPMode != "" {
		if cfg.ConfigXDPMode, err = loader.ParseMode(r.XDPMode); err != nil {
			return cfg, err
		}
	}
	if !o.set["xdp-iface"] && len(r.Interfaces) > 0 {
		cfg.Interfaces = r.Interfaces
	}
	return cfg, nil
}

// watchConfig polls the config file and applies changes: a ConfigMap update
// swaps a symlink, which a content check sees and an inotify on the file
// would miss.
func watchConfig(o options, d *daemon.Daemon, logger *logging.Factory, stop <-chan struct{}) {
	log := logger.Slog("stunnerd-xdp")
	last, _ := os.ReadFile(o.configFile)
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		select {
		case <-stop:
			return
		case <-t.C:
		}
		b, err := os.ReadFile(o.configFile)
		if err != nil || bytes.Equal(b, last) {
			continue
		}
		last = b
		r, err := config.Parse(b)
		if err == nil {
			var cfg daemon.Config
			if cfg, err = fromFile(o, r); err == nil {
				if !o.set["log"] {
					if lerr := logger.SetLevels(r.LogLevel); lerr != nil {
						log.Warn("config: bad loglevel, keeping the current one", "error", lerr)
					}
				}
				err = d.Reconfigure(cfg)
			}
		}
		if err != nil {
			log.Error("config reload", "file", o.configFile, "error", fmt.Sprint(err))
			continue
		}
		log.Info("config reloaded", "file", o.configFile)
	}
}
