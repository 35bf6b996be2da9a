package main

import (
	"fmt"
	"runtime/debug"
	"strings"
)

// version is set at link time by release builds (make build:
// -ldflags "-X main.version=..."); otherwise the build's own record says what
// was built (module version, VCS revision), as `go version -m` would.
var version = ""

// versionString is what --version prints: one line, the version first.
func versionString() string {
	v := version
	info, ok := debug.ReadBuildInfo()
	if !ok {
		if v == "" {
			v = "unknown"
		}
		return "stunnerd-xdp " + v
	}
	settings := map[string]string{}
	for _, s := range info.Settings {
		settings[s.Key] = s.Value
	}
	if v == "" {
		v = info.Main.Version
	}
	if v == "" || v == "(devel)" {
		v = "devel"
		if rev := settings["vcs.revision"]; rev != "" {
			v += "-" + rev[:min(len(rev), 12)]
			if settings["vcs.modified"] == "true" {
				v += "-dirty"
			}
		}
	}
	parts := []string{"stunnerd-xdp " + v, info.GoVersion}
	if t := settings["vcs.time"]; t != "" {
		parts = append(parts, "committed "+t)
	}
	if turn := depVersion(info, "github.com/pion/turn/v4"); turn != "" {
		parts = append(parts, "pion/turn "+turn)
	}
	if ebpf := depVersion(info, "github.com/cilium/ebpf"); ebpf != "" {
		parts = append(parts, "cilium/ebpf "+ebpf)
	}
	return strings.Join(parts, ", ")
}

func depVersion(info *debug.BuildInfo, path string) string {
	for _, d := range info.Deps {
		if d.Path == path {
			if d.Replace != nil {
				return fmt.Sprintf("%s => %s %s", d.Version, d.Replace.Path, d.Replace.Version)
			}
			return d.Version
		}
	}
	return ""
}
