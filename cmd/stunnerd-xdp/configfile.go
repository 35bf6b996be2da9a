package main

import (
	"github.com/l7mp/stunnerd-xdp/internal/config"
	"github.com/l7mp/stunnerd-xdp/internal/daemon"
	"github.com/l7mp/stunnerd-xdp/internal/loader"
)

// fromConfig builds the daemon configuration from a STUNner config and the
// flags: the config gives listeners, auth, allowlists, log level, endpoints
// offload settings and the user quota; a flag given on the command line wins.
func fromConfig(o options, r *config.Resolved) (daemon.Config, error) {
	// The flags give everything the config does not; then the config
	// overrides what it sets and the command line did not.
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
	// STUNner's 0 is "no quota" and also what an unset admin.user_quota
	// reads as: the daemon's default then (--user-quota=0 turns it off).
	if !o.set["user-quota"] && r.UserQuota > 0 {
		cfg.UserQuota = r.UserQuota
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
	// A v1alpha1 config's relay port range (STUNner's listener fields).
	if !o.set["min-relay-port"] && r.MinRelayPort != 0 {
		cfg.MinRelayPort = r.MinRelayPort
	}
	if !o.set["max-relay-port"] && r.MaxRelayPort != 0 {
		cfg.MaxRelayPort = r.MaxRelayPort
	}
	if !o.set["xdp-iface"] && len(r.Interfaces) > 0 {
		cfg.Interfaces = r.Interfaces
	}
	return cfg, nil
}

// requestedMode is the XDP mode the flags and the config ask for, before the
// node label (internal/offload has the whole precedence).
func requestedMode(cfg daemon.Config) loader.Mode {
	switch {
	case cfg.XDPMode != "":
		return cfg.XDPMode
	case cfg.ConfigXDPMode != "":
		return cfg.ConfigXDPMode
	}
	return loader.ModeAuto
}
