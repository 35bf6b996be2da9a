package steering

import (
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// newClientsGoTo sends from ten new clients and fails unless each lands on
// servers[want].
func newClientsGoTo(t *testing.T, g Group, want int, servers ...*net.UDPConn) {
	t.Helper()
	for i := range 10 {
		c := listenUDP(t, "udp4", "127.0.0.1:0")
		if got := receiver(t, c, g.Addr, servers...); got != want {
			t.Fatalf("new client %d went to socket %d, want %d", i, got, want)
		}
	}
}

// TestAssertRetakes: the old pod's container restarts during the overlap, so
// a process of the old pod is newer than the new pod's and takes the new
// flows; when it retires (the old pod is deleted), the new pod's periodic
// Assert takes them back instead of leaving them to the kernel's hash, which
// would send half the new clients to the draining process.
func TestAssertRetakes(t *testing.T) {
	dir := testDir(t)
	nu := mustOpen(t, dir)
	b := listenUDP(t, "udp4", "127.0.0.1:0")
	g := Group{Protocol: UDP, Addr: addrPort(b.LocalAddr())}
	register(t, nu, b, g)
	restarted := mustOpen(t, dir)
	a := listenUDP(t, "udp4", g.Addr.String())
	register(t, restarted, a, g)
	newClientsGoTo(t, g, 1, b, a)
	if err := restarted.Retire(); err != nil {
		t.Fatal(err)
	}
	if err := nu.Assert(); err != nil {
		t.Fatal(err)
	}
	newClientsGoTo(t, g, 0, b, a)
	// Asserting again changes nothing, and the retired process asserts
	// nothing.
	if err := restarted.Assert(); err != nil {
		t.Fatal(err)
	}
	newClientsGoTo(t, g, 0, b, a)
}

// TestGenerationAboveRegistered: a process whose clock ran ahead (or a clock
// stepped back since) registered a generation above our start time; a process
// opened later is still newer and takes the new flows at Register.
func TestGenerationAboveRegistered(t *testing.T) {
	dir := testDir(t)
	old := mustOpen(t, dir)
	old.gen = uint64(time.Now().Add(time.Hour).UnixNano())
	a := listenUDP(t, "udp4", "127.0.0.1:0")
	g := Group{Protocol: UDP, Addr: addrPort(a.LocalAddr())}
	register(t, old, a, g)
	nu := mustOpen(t, dir)
	if nu.gen <= old.gen {
		t.Fatalf("generation %d opened after %d is not newer", nu.gen, old.gen)
	}
	b := listenUDP(t, "udp4", g.Addr.String())
	register(t, nu, b, g)
	newClientsGoTo(t, g, 1, a, b)
}

// TestStandIn: the old process drains for a successor that is then killed
// (its socket closes, nothing else of it runs): the old process sees no
// successor, unretires and takes the new flows; a newer process that
// registers later is its successor again.
func TestStandIn(t *testing.T) {
	s := newOldAndClient(t)
	if err := s.old.Retire(); err != nil {
		t.Fatal(err)
	}
	b := listenUDP(t, "udp4", s.g.Addr.String())
	register(t, s.nu, b, s.g)
	if ok, err := s.old.Successor(); err != nil || !ok {
		t.Fatalf("no successor (%v)", err)
	}
	// The successor drains too (a node drain): it takes no new flows but
	// lives.
	if err := s.nu.Retire(); err != nil {
		t.Fatal(err)
	}
	if ok, err := s.old.Successor(); err != nil || ok {
		t.Errorf("a retired successor takes the new flows (%v)", err)
	}
	if newer, err := s.old.Newer(); err != nil || !newer {
		t.Errorf("a retired successor does not count as alive (%v)", err)
	}
	if newer, err := s.nu.Newer(); err != nil || newer {
		t.Errorf("the successor sees a newer process (%v)", err)
	}
	b.Close() // kill -9: no Unregister, no Close
	if newer, err := s.old.Newer(); err != nil || newer {
		t.Fatalf("a killed successor still counts (%v)", err)
	}
	if err := s.old.Unretire(); err != nil {
		t.Fatal(err)
	}
	before := stats(t, s.old)
	newClientsGoTo(t, s.g, 0, s.a)
	if after := stats(t, s.old); after.Active-before.Active != 10 {
		t.Errorf("verdicts %+v -> %+v, want 10 active: the old process holds the entry again", before, after)
	}
	next := mustOpen(t, s.old.Dir())
	c := listenUDP(t, "udp4", s.g.Addr.String())
	register(t, next, c, s.g)
	if ok, err := s.old.Successor(); err != nil || !ok {
		t.Errorf("no successor after a newer process registered (%v)", err)
	}
	newClientsGoTo(t, s.g, 1, s.a, c)
}

// TestLockTimeout: a process that holds a steering lock forever makes the
// others fail after the deadline instead of hanging.
func TestLockTimeout(t *testing.T) {
	hold := func(t *testing.T, path string) {
		t.Helper()
		f, err := os.Open(path)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { f.Close() })
		if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
			t.Fatal(err)
		}
	}
	t.Run("pin directory", func(t *testing.T) {
		dir := testDir(t)
		if err := os.MkdirAll(filepath.Join(dir, "registry"), 0o700); err != nil {
			t.Fatal(err)
		}
		hold(t, dir) // as the last process out does while it removes the pins
		start := time.Now()
		_, err := openWith(dir, 200*time.Millisecond)
		if !errors.Is(err, ErrLockTimeout) {
			t.Fatalf("open under a held lock: %v, want ErrLockTimeout", err)
		}
		if d := time.Since(start); d > 2*time.Second {
			t.Errorf("gave up after %v", d)
		}
	})
	t.Run("registry", func(t *testing.T) {
		dir := testDir(t)
		s, err := openWith(dir, 200*time.Millisecond)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { s.Close() })
		hold(t, filepath.Join(dir, "registry"))
		a := listenUDP(t, "udp4", "127.0.0.1:0")
		rc, err := a.SyscallConn()
		if err != nil {
			t.Fatal(err)
		}
		if _, err := s.Register(rc, Group{Protocol: UDP, Addr: addrPort(a.LocalAddr())}); !errors.Is(err, ErrLockTimeout) {
			t.Errorf("register under a held lock: %v, want ErrLockTimeout", err)
		}
		if err := s.Assert(); err != nil {
			t.Errorf("assert with nothing registered: %v", err)
		}
	})
}

// TestOpenRefusesUnsafeDir: a pin directory another user could write to (and
// so replace the maps that steer the node's TURN traffic) is refused.
func TestOpenRefusesUnsafeDir(t *testing.T) {
	for _, c := range []struct {
		name    string
		prepare func(t *testing.T, dir string)
	}{
		{"world-writable", func(t *testing.T, dir string) { chmod(t, dir, 0o777) }},
		{"group-writable registry", func(t *testing.T, dir string) { chmod(t, filepath.Join(dir, "registry"), 0o770) }},
		{"another user's", func(t *testing.T, dir string) {
			if err := os.Chown(dir, 4242, 4242); err != nil {
				t.Fatal(err)
			}
		}},
		{"parent writable by others without the sticky bit", func(t *testing.T, dir string) { chmod(t, filepath.Dir(dir), 0o777) }},
		{"symlink", func(t *testing.T, dir string) {
			// bpffs takes no dots in names nor directory renames: make the
			// target beside it.
			target := dir + "-real"
			if err := os.MkdirAll(filepath.Join(target, "registry"), 0o700); err != nil {
				t.Fatal(err)
			}
			if err := os.RemoveAll(dir); err != nil {
				t.Fatal(err)
			}
			if err := os.Symlink(target, dir); err != nil {
				t.Fatal(err)
			}
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			dir := filepath.Join(testDir(t), "netns-1")
			if err := os.MkdirAll(filepath.Join(dir, "registry"), 0o700); err != nil {
				t.Fatal(err)
			}
			c.prepare(t, dir)
			if s, err := Open(dir); !errors.Is(err, ErrUnsafeDir) {
				if err == nil {
					s.Close()
				}
				t.Fatalf("open: %v, want ErrUnsafeDir", err)
			}
		})
	}
	// A bpffs root is 1777, as systemd mounts it: a shared parent with the
	// sticky bit is fine.
	t.Run("sticky parent", func(t *testing.T) {
		testenv.RequireRoot(t)
		dir := testDir(t)
		chmod(t, filepath.Dir(dir), 0o1777)
		mustOpen(t, dir)
	})
}

func chmod(t *testing.T, path string, mode os.FileMode) {
	t.Helper()
	// os.Chmod maps the sticky bit itself; unix.Chmod takes the raw mode.
	if err := unix.Chmod(path, uint32(mode)); err != nil {
		t.Fatal(err)
	}
}

// TestBindMountedSubdir: the DaemonSet mounts only the node's
// /sys/fs/bpf/stunnerd-xdp (made by the kubelet, 0755) into each pod, at a
// path of its own. A bind mount of a bpffs directory is bpffs: the pins work
// there, and two pods see the same maps.
func TestBindMountedSubdir(t *testing.T) {
	sub := filepath.Join(testenv.BPFFS(t), "stunnerd-xdp")
	if err := os.Mkdir(sub, 0o755); err != nil {
		t.Fatal(err)
	}
	var pods [2]*Steering
	for i := range pods {
		mnt := t.TempDir()
		if err := unix.Mount(sub, mnt, "", unix.MS_BIND, ""); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = unix.Unmount(mnt, unix.MNT_DETACH) })
		dir, err := DirFor(mnt)
		if err != nil {
			t.Fatal(err)
		}
		pods[i] = mustOpen(t, dir)
	}
	a := listenUDP(t, "udp4", "127.0.0.1:0")
	g := Group{Protocol: UDP, Addr: addrPort(a.LocalAddr())}
	register(t, pods[0], a, g)
	register(t, pods[1], listenUDP(t, "udp4", g.Addr.String()), g)
	if ok, err := pods[0].Successor(); err != nil || !ok {
		t.Errorf("the first pod does not see the second's registration (%v)", err)
	}
}

// TestHandoverNeedsReuseportSocket: where the kernel gives SO_REUSEPORT
// programs the listener socket (5.14+), Open loads the steering program;
// where it does not (5.10), Open says so with ErrHandoverUnsupported, which
// the daemon reports once, without loading anything.
func TestHandoverNeedsReuseportSocket(t *testing.T) {
	testenv.RequireRoot(t)
	var uts unix.Utsname
	if err := unix.Uname(&uts); err != nil {
		t.Fatal(err)
	}
	var major, minor int
	if _, err := fmt.Sscanf(unix.ByteSliceToString(uts.Release[:]), "%d.%d", &major, &minor); err != nil {
		t.Fatal(err)
	}
	s, err := Open(testDir(t))
	if major > 5 || major == 5 && minor >= 14 {
		if err != nil {
			t.Fatalf("open: %v", err)
		}
		s.Close()
		return
	}
	if !errors.Is(err, ErrHandoverUnsupported) {
		t.Fatalf("open on a kernel without sk_reuseport_md.sk: %v, want ErrHandoverUnsupported", err)
	}
}
