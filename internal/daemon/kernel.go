package daemon

import (
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/l7mp/stunnerd-xdp/internal/loader"
	"github.com/l7mp/stunnerd-xdp/internal/metrics"
	"github.com/l7mp/stunnerd-xdp/internal/offload"
)

// kernelFacts are the kernel's answers that do not change while the daemon
// runs, read once at start.
type kernelFacts struct {
	release     string
	xdpFeatures bool
}

func readKernelFacts() kernelFacts {
	var k kernelFacts
	var u unix.Utsname
	if err := unix.Uname(&u); err == nil {
		k.release = unix.ByteSliceToString(u.Release[:])
	}
	k.xdpFeatures = loader.XDPFeatures()
	return k
}

// Kernel returns what the node's kernel gives the kernel path and where
// bound channels are relayed now (metrics.Kernel): the Prometheus
// stunnerd_xdp_kernel_info and /status's xdp.kernel.
func (d *Daemon) Kernel() metrics.Kernel {
	k := metrics.Kernel{Release: d.kernel.release, XDPFeatures: d.kernel.xdpFeatures,
		Program: metrics.ProgramNotLoaded, TCEngine: "none", Handover: "off"}
	if err := d.xdp.Refused(); err != nil {
		k.Program, k.Refused = metrics.ProgramRefused, offload.RefusalReason(err)
	} else if d.xdp.Loaded() {
		k.Program = metrics.ProgramLoaded
	}
	if loaded, attach := d.xdp.TCEngine(); loaded {
		k.TCEngine = "loaded"
		if attach != "" {
			k.TCEngine = attach
		}
	}
	switch {
	case d.steer != nil:
		k.Handover = "on"
	case d.config().SteeringDir != "":
		k.Handover = "unavailable"
	}
	k.Path = pathOf(d.xdp.Attached())
	if k.Path == "userspace" {
		k.Userspace = d.xdp.Unavailable()
	}
	return k
}

// pathOf is where bound channels are relayed, given the attachments: xdp
// when the XDP program runs anywhere, tc when only the TC engine does.
func pathOf(attached map[string]loader.Mode) string {
	path := "userspace"
	for _, m := range attached {
		if m != loader.ModeTC {
			return "xdp"
		}
		path = "tc"
	}
	return path
}

// logKernel says in one line what the kernel gives and where bound channels
// go: never xdp when nothing is attached.
func (d *Daemon) logKernel() {
	k := d.Kernel()
	attached := d.xdp.Attached()
	var on []string
	for _, iface := range slices.Sorted(maps.Keys(attached)) {
		on = append(on, fmt.Sprintf("%s:%s", iface, attached[iface]))
	}
	args := []any{"release", k.Release, "xdp-features", k.XDPFeatures, "program", k.Program, "tc-engine", k.TCEngine,
		"handover", k.Handover, "path", k.Path, "attached", strings.Join(on, ",")}
	if k.Userspace != "" {
		args = append(args, "userspace-reason", k.Userspace)
	}
	if k.Refused != "" {
		args = append(args, "refused", k.Refused)
	}
	d.log.Info("kernel", args...)
}

// startErr logs why XDP is not attached at start, unless the manager said
// it already (a refusal: one WARN, not retried).
func startErr(err error) bool { return err != nil && !errors.Is(err, offload.ErrRefused) }
