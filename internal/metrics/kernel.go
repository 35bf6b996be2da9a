package metrics

// Kernel is what this node's kernel gives the kernel path, as the daemon
// logs it at start and exports it (stunnerd_xdp_kernel_info, /status's
// xdp.kernel): enough to tell from outside why a node relays in userspace.
type Kernel struct {
	// Release is uname's release ("6.1.0-31-amd64").
	Release string `json:"release"`
	// XDPFeatures: the kernel reports which devices transmit XDP frames
	// (6.3+); false: the daemon decides per device (veth peers, known
	// drivers).
	XDPFeatures bool `json:"xdpFeatures"`
	// Program is the XDP program's state: loaded, refused (the kernel
	// refused it: Refused says why; not loaded again), not_loaded (not
	// wanted yet, or its load failed and is retried).
	Program string `json:"program"`
	Refused string `json:"refused,omitempty"`
	// TCEngine is how the TC engine attaches: tcx (6.6+), clsact (a cls_bpf
	// filter, older kernels), loaded (it does not say), none (not loaded).
	TCEngine string `json:"tcEngine"`
	// Handover is the listener handover between two daemons on the node:
	// on, off (no --steering-dir), unavailable (the kernel refused it).
	Handover string `json:"handover"`
	// Path is where bound channels are relayed now: xdp (the XDP program on
	// at least one interface), tc (the TC engine alone), userspace.
	Path string `json:"path"`
	// Userspace is why no program carries bindings (Path userspace): off,
	// program_refused, no_kernel_path; empty otherwise.
	Userspace string `json:"userspaceReason,omitempty"`
}

// Program states.
const (
	ProgramLoaded    = "loaded"
	ProgramRefused   = "refused"
	ProgramNotLoaded = "not_loaded"
)
