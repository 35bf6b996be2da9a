package offload

import (
	"errors"
	"strings"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"
)

// ErrRefused: the kernel refused the program: its verifier, or a helper,
// kfunc, map or attach type it lacks. The answer does not change while the
// program and the kernel stay the same, so the load is not tried again until
// the load-time configuration changes (Reconfigure); bindings are served from
// userspace meanwhile (mirror.ReasonRefused). The error wraps the kernel's.
var ErrRefused = errors.New("the kernel refused the XDP program")

// enotsupp is the kernel's internal ENOTSUPP (524), which BPF_PROG_LOAD and
// BPF_LINK_CREATE return for what the kernel does not implement; Go's unix
// package names only EOPNOTSUPP (95).
const enotsupp = unix.Errno(524)

// refusedByKernel says whether a load error is the kernel's lasting answer to
// this program rather than something that can pass: a verifier log, a
// feature the kernel lacks (cilium/ebpf's ErrNotSupported: a missing kfunc,
// map or program type), ENOTSUPP, EOPNOTSUPP or EINVAL (a helper or attach
// type the kernel does not know). EPERM (no capability yet), ENOMEM (memlock
// before 5.11, memory pressure) and EBUSY are retried.
func refusedByKernel(err error) bool {
	var ve *ebpf.VerifierError
	switch {
	case errors.As(err, &ve), errors.Is(err, ebpf.ErrNotSupported):
		return true
	case errors.Is(err, enotsupp), errors.Is(err, unix.EOPNOTSUPP), errors.Is(err, unix.EINVAL):
		return true
	}
	return false
}

// RefusalReason is the kernel's reason in one line: the verifier's last lines
// (cilium/ebpf's summary), not its whole log, which the loader's error carries.
func RefusalReason(err error) string {
	var ve *ebpf.VerifierError
	if errors.As(err, &ve) {
		return ve.Error()
	}
	s, _, _ := strings.Cut(err.Error(), "\n")
	return s
}
