package testenv

import (
	"testing"

	"golang.org/x/sys/unix"
)

// BPFFS mounts a private bpf filesystem for the test's pinned maps and
// unmounts it at cleanup, so that tests never pin into the host's /sys/fs/bpf.
func BPFFS(t testing.TB) string {
	t.Helper()
	RequireRoot(t)
	dir := t.TempDir()
	if err := unix.Mount("bpffs", dir, "bpf", 0, "mode=0700"); err != nil {
		t.Fatalf("mount bpffs on %s: %v", dir, err)
	}
	t.Cleanup(func() {
		if err := unix.Unmount(dir, unix.MNT_DETACH); err != nil {
			t.Errorf("unmount %s: %v", dir, err)
		}
	})
	return dir
}
