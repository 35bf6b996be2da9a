// Package status is what /status reports: STUNner's StunnerStatus (as
// stunnerd v1.2.1's pkg/apis/v1 has it, which stunnerctl decodes) with an xdp
// section for the fast path.
package status

import (
	"fmt"
	"maps"
	"slices"
	"strings"

	"github.com/l7mp/stunnerd-xdp/internal/config"
	"github.com/l7mp/stunnerd-xdp/internal/metrics"
	"github.com/l7mp/stunnerd-xdp/internal/steering"
)

// States, as stunnerd reports them.
const (
	Ready       = "READY"
	NotReady    = "NOT-READY"
	Terminating = "TERMINATING"
)

// Status is STUNner's StunnerStatus plus the xdp section.
type Status struct {
	Version         string            `json:"version"`
	Admin           *AdminStatus      `json:"admin"`
	Auth            *config.Auth      `json:"auth"`
	Listeners       []*ListenerStatus `json:"listeners"`
	Clusters        []*ClusterStatus  `json:"clusters"`
	AllocationCount int               `json:"allocationCount"`
	Status          string            `json:"status"`
	XDP             XDP               `json:"xdp"`
}

// AdminStatus is STUNner's.
type AdminStatus struct {
	Name                string `json:"name,omitempty"`
	LogLevel            string `json:"loglevel,omitempty"`
	MetricsEndpoint     string `json:"metrics_endpoint,omitempty"`
	HealthCheckEndpoint string `json:"healthcheck_endpoint,omitempty"`
	UserQuota           string `json:"quota,omitempty"`
	OffloadStatus       string `json:"offload,omitempty"`
	LicensingInfo       string `json:"licensing_info,omitempty"`
}

// ListenerStatus is a listener's configuration and the traffic the kernel
// path relayed for it (STUNner's offload stats).
type ListenerStatus struct {
	config.Listener
	Stats DirStat `json:"stats"`
}

// ClusterStatus is a cluster's configuration and the traffic the kernel path
// relayed to and from it.
type ClusterStatus struct {
	config.Cluster
	Stats DirStat `json:"stats"`
}

// DirStat is STUNner's OffloadDirStat.
type DirStat struct {
	Rx StatInfo `json:"rx"`
	Tx StatInfo `json:"tx"`
}

// StatInfo is STUNner's OffloadStatInfo (the timestamp is not tracked: 0).
type StatInfo struct {
	Pkts          uint64 `json:"pkts"`
	Bytes         uint64 `json:"bytes"`
	TimestampLast uint64 `json:"timestamp"`
}

// XDP is the fast path's state.
type XDP struct {
	// Channels are the channel bindings pion/turn holds, Offloaded those
	// installed in the XDP maps.
	Channels  int `json:"channels"`
	Offloaded int `json:"offloaded"`
	// Attached is the XDP mode of each interface the program runs on.
	Attached map[string]string `json:"attached"`
	Draining bool              `json:"draining"`
	// Packets relayed since start, by path (both directions).
	XDPPackets       uint64 `json:"xdpPackets"`
	UserspacePackets uint64 `json:"userspacePackets"`
	// Steering holds the node-wide listener steering verdicts when two
	// daemons may share the ports (nil without --steering-dir).
	Steering *steering.Stats `json:"steering,omitempty"`
	// Kernel is what the node's kernel gives the kernel path, and where
	// bound channels are relayed now (path, and why not in the kernel).
	Kernel metrics.Kernel `json:"kernel"`
}

// Input is what a status is built from.
type Input struct {
	// Version is the daemon's STUNner config API version ("v1").
	Version string
	// Source is the STUNner configuration in force.
	Source *config.Stunner
	// Offload is the admin.offload string: engine[interfaces].
	Offload     string
	Allocations int
	Draining    bool
	Traffic     metrics.Totals
	XDP         XDP
}

// redacted stands for secret credentials: the health port is reachable by
// whoever reaches the node, and stunnerctl shows only the auth type and realm.
const redacted = "<redacted>"

// New builds the status.
func New(in Input) Status {
	st := Status{Version: in.Version, AllocationCount: in.Allocations, Status: Ready, XDP: in.XDP}
	if in.Draining {
		st.Status = Terminating
	}
	src := in.Source
	st.Admin = &AdminStatus{
		Name: src.Admin.Name, LogLevel: src.Admin.LogLevel, MetricsEndpoint: src.Admin.MetricsEndpoint,
		UserQuota: fmt.Sprint(src.Admin.UserQuota), OffloadStatus: in.Offload, LicensingInfo: "{tier:free}",
	}
	if src.Admin.HealthCheckEndpoint != nil {
		st.Admin.HealthCheckEndpoint = *src.Admin.HealthCheckEndpoint
	}
	auth := src.Auth
	auth.Credentials = map[string]string{}
	for _, k := range slices.Sorted(maps.Keys(src.Auth.Credentials)) {
		v := redacted
		if k == "username" {
			v = src.Auth.Credentials[k]
		}
		auth.Credentials[k] = v
	}
	st.Auth = &auth
	st.Listeners = []*ListenerStatus{}
	for _, l := range src.Listeners {
		l.Key = "" // the TLS key is a secret; the cert is public
		st.Listeners = append(st.Listeners, &ListenerStatus{Listener: l, Stats: dirStat(in.Traffic.KernelListeners[l.Name])})
	}
	st.Clusters = []*ClusterStatus{}
	for _, c := range src.Clusters {
		st.Clusters = append(st.Clusters, &ClusterStatus{Cluster: c, Stats: dirStat(in.Traffic.KernelClusters[c.Name])})
	}
	return st
}

func dirStat(s metrics.Stats) DirStat {
	return DirStat{
		Rx: StatInfo{Pkts: s.Rx.Packets, Bytes: s.Rx.Bytes},
		Tx: StatInfo{Pkts: s.Tx.Packets, Bytes: s.Tx.Bytes},
	}
}

// OffloadString is admin.offload as stunnerd writes it: ENGINE[interfaces].
func OffloadString(engine string, ifaces []string) string {
	list := "all"
	if len(ifaces) > 0 {
		list = strings.Join(ifaces, ",")
	}
	return fmt.Sprintf("%s[%s]", engine, list)
}

// Waiting is /status before the first config: what stunnerd reports while it
// runs its zero config (client.ZeroConfig: the gateway's name, static dummy
// credentials, no listeners or clusters), NOT-READY.
func Waiting(name string) Status {
	health := config.DefaultHealthEndpoint
	st := New(Input{Version: "v1", Source: &config.Stunner{
		APIVersion: "v1",
		Admin:      config.Admin{Name: name, LogLevel: "all:INFO", HealthCheckEndpoint: &health},
		Auth:       config.Auth{Type: "static", Realm: config.DefaultRealm, Credentials: map[string]string{}},
	}, Offload: OffloadString("None", nil)})
	st.Status = NotReady
	return st
}
