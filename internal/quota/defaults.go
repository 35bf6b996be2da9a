package quota

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
)

// The default limits, for a daemon whose operator set none: one credential
// holder must not be able to take the node (issue 24: every limit defaulted
// to none, and one user took 3,000 allocations in 3 s, then the whole relay
// port range).
const (
	// DefaultPerUser is the allocations one user-id holds by default: far
	// more than a browser needs (one per peer connection and transport),
	// a small share of a node's relay ports.
	DefaultPerUser = 128
	// AllocationBytes is the memory budgeted per allocation. Measured on
	// loopback (2,000 idle allocations, static credentials, off mode): 15 KiB
	// of Go heap and stacks each (pion/turn's allocation, its relay socket's
	// read loop, the daemon's entries). The rest is room for the datagrams a
	// relay socket queues while its read loop catches up: the kernel charges
	// socket buffers to the process's memory cgroup.
	AllocationBytes = 128 << 10
	// MemoryShare is the share of the memory limit allocations may take by
	// default; the rest is the daemon's, the Go runtime's and the TCP and
	// TLS connections' (connlimit).
	MemoryShare = 2
)

// DefaultTotal is the default total quota for a relay port range of
// relayPorts ports and a memory limit of memory bytes: every allocation
// takes a relay port, and past memory/MemoryShare/AllocationBytes the
// process risks its memory limit (an OOM kill takes every session with it).
func DefaultTotal(relayPorts int, memory uint64) int {
	n := relayPorts
	if memory > 0 {
		if m := memory / MemoryShare / AllocationBytes; m < uint64(n) {
			n = int(m)
		}
	}
	return max(n, 1)
}

// ErrNoMemoryLimit: neither a cgroup memory limit nor the machine's memory
// could be read.
var ErrNoMemoryLimit = errors.New("cannot tell the memory limit")

// MemoryLimit is the memory the process may use: the smallest of its cgroup's
// memory limit (v2 memory.max, v1 memory.limit_in_bytes) and the machine's
// memory (MemTotal).
func MemoryLimit() (uint64, error) { return memoryLimit("/") }

// memoryLimit reads the limits under root (a test's fake /proc and /sys).
func memoryLimit(root string) (uint64, error) {
	var limit uint64
	take := func(v uint64) {
		if v > 0 && (limit == 0 || v < limit) {
			limit = v
		}
	}
	if v, err := memTotal(filepath.Join(root, "proc/meminfo")); err == nil {
		take(v)
	}
	// The cgroup's own files: with a cgroup namespace (a container) its
	// root is mounted; without one, the path /proc/self/cgroup names.
	files := []string{"sys/fs/cgroup/memory.max", "sys/fs/cgroup/memory/memory.limit_in_bytes"}
	if b, err := os.ReadFile(filepath.Join(root, "proc/self/cgroup")); err == nil {
		for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
			parts := strings.SplitN(line, ":", 3)
			if len(parts) != 3 || parts[2] == "/" {
				continue
			}
			switch {
			case parts[0] == "0" && parts[1] == "":
				files = append(files, filepath.Join("sys/fs/cgroup", parts[2], "memory.max"))
			case slices.Contains(strings.Split(parts[1], ","), "memory"):
				files = append(files, filepath.Join("sys/fs/cgroup/memory", parts[2], "memory.limit_in_bytes"))
			}
		}
	}
	for _, f := range files {
		b, err := os.ReadFile(filepath.Join(root, f))
		if err != nil {
			continue
		}
		s := strings.TrimSpace(string(b))
		if s == "max" {
			continue
		}
		if v, err := strconv.ParseUint(s, 10, 64); err == nil {
			take(v)
		}
	}
	if limit == 0 {
		return 0, ErrNoMemoryLimit
	}
	return limit, nil
}

func memTotal(path string) (uint64, error) {
	f, err := os.Open(path)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) >= 2 && fields[0] == "MemTotal:" {
			kb, err := strconv.ParseUint(fields[1], 10, 64)
			if err != nil {
				return 0, fmt.Errorf("%s: %w", path, err)
			}
			return kb << 10, nil
		}
	}
	return 0, fmt.Errorf("%s: no MemTotal", path)
}
