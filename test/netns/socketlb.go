package netns

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"
)

// SocketLB translates a Service address to its backend for the UDP sockets of one process, where
// Cilium's socket load balancer (kube-proxy replacement) does it: in the cgroup/sendmsg4 and
// cgroup/recvmsg4 hooks. A datagram the process sends to service goes to backend; one it receives
// from backend shows service as its source. No netfilter rule and no conntrack entry is involved,
// so the node's stack never shows the translation.
//
// The process moves to a cgroup v2 of its own; the sockets it opens from then on are translated.
// When the test ends the process (if still running) moves back and the cgroup is removed.
func SocketLB(t testing.TB, pid int, service, backend netip.AddrPort) {
	t.Helper()
	root, err := cgroup2Root()
	if err != nil {
		t.Fatalf("socket LB: %v", err)
	}
	home, err := processCgroup(pid)
	if err != nil {
		t.Fatalf("socket LB: %v", err)
	}
	dir := filepath.Join(root, NamePrefix+uniqueTag()+"-socketlb")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatalf("socket LB: %v", err)
	}
	t.Cleanup(func() {
		// Back home first: a cgroup with a process in it cannot be removed.
		_ = os.WriteFile(filepath.Join(root, home, "cgroup.procs"), []byte(strconv.Itoa(pid)), 0)
		if err := os.Remove(dir); err != nil {
			t.Errorf("socket LB: removing cgroup %s: %v", dir, err)
		}
	})
	for _, hook := range []struct {
		attach   ebpf.AttachType
		from, to netip.AddrPort
	}{
		{ebpf.AttachCGroupUDP4Sendmsg, service, backend},
		{ebpf.AttachCGroupUDP4Recvmsg, backend, service},
	} {
		prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{
			Type:         ebpf.CGroupSockAddr,
			AttachType:   hook.attach,
			License:      "MIT",
			Instructions: rewriteAddr(hook.from, hook.to),
		})
		if err != nil {
			t.Fatalf("socket LB: loading the %v program: %v", hook.attach, err)
		}
		t.Cleanup(func() { prog.Close() })
		l, err := link.AttachCgroup(link.CgroupOptions{Path: dir, Attach: hook.attach, Program: prog})
		if err != nil {
			t.Fatalf("socket LB: attaching %v to %s: %v", hook.attach, dir, err)
		}
		t.Cleanup(func() { l.Close() })
	}
	if err := os.WriteFile(filepath.Join(dir, "cgroup.procs"), []byte(strconv.Itoa(pid)), 0); err != nil {
		t.Fatalf("socket LB: moving pid %d to %s: %v", pid, dir, err)
	}
}

// Offsets in struct bpf_sock_addr, the context of cgroup sock_addr programs.
const (
	sockAddrUserIP4  = 4
	sockAddrUserPort = 24
)

// rewriteAddr sets the user address of a bpf_sock_addr context to `to` where it is `from`, and
// always allows the call (recvmsg hooks must return 1). The address and port are in network order,
// as the context holds them; 32-bit jumps and moves, so that no immediate is sign-extended.
func rewriteAddr(from, to netip.AddrPort) asm.Instructions {
	return asm.Instructions{
		asm.LoadMem(asm.R2, asm.R1, sockAddrUserIP4, asm.Word),
		asm.JNE.Imm32(asm.R2, wireU32(from.Addr()), "out"),
		asm.LoadMem(asm.R2, asm.R1, sockAddrUserPort, asm.Word),
		asm.JNE.Imm32(asm.R2, wirePort(from.Port()), "out"),
		asm.Mov.Imm32(asm.R2, wireU32(to.Addr())),
		asm.StoreMem(asm.R1, sockAddrUserIP4, asm.R2, asm.Word),
		asm.Mov.Imm32(asm.R2, wirePort(to.Port())),
		asm.StoreMem(asm.R1, sockAddrUserPort, asm.R2, asm.Word),
		asm.Mov.Imm(asm.R0, 1).WithSymbol("out"),
		asm.Return(),
	}
}

// wireU32 is an IPv4 address as a native-endian load of its network-order bytes reads it.
func wireU32(a netip.Addr) int32 {
	b := a.As4()
	return int32(binary.NativeEndian.Uint32(b[:]))
}

// wirePort is a port as a native-endian load of its network-order bytes, zero-extended, reads it.
func wirePort(p uint16) int32 {
	var b [2]byte
	binary.BigEndian.PutUint16(b[:], p)
	return int32(binary.NativeEndian.Uint16(b[:]))
}

// cgroup2Root is where the cgroup v2 hierarchy is mounted (/sys/fs/cgroup, or
// /sys/fs/cgroup/unified on a hybrid host).
func cgroup2Root() (string, error) {
	f, err := os.Open("/proc/self/mounts")
	if err != nil {
		return "", err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if fields := strings.Fields(sc.Text()); len(fields) > 2 && fields[2] == "cgroup2" {
			return fields[1], nil
		}
	}
	if err := sc.Err(); err != nil {
		return "", err
	}
	return "", errors.New("no cgroup2 hierarchy mounted")
}

// processCgroup is the process's cgroup v2 path relative to the hierarchy's root.
func processCgroup(pid int) (string, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
	if err != nil {
		return "", err
	}
	for _, line := range strings.Split(string(b), "\n") {
		if path, ok := strings.CutPrefix(line, "0::"); ok {
			return path, nil
		}
	}
	return "", fmt.Errorf("pid %d has no cgroup v2 path", pid)
}
