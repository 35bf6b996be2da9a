package quota

import (
	"os"
	"path/filepath"
	"testing"
)

func TestDefaultTotal(t *testing.T) {
	for _, c := range []struct {
		ports  int
		memory uint64
		want   int
	}{
		{16384, 24 << 30, 16384}, // a big node: the port range bounds
		{16384, 256 << 20, 256 << 20 / MemoryShare / AllocationBytes}, // a 256 MiB pod: memory bounds
		{200, 0, 200}, // memory unknown: the ports
		{100, 1, 1},   // never 0 (that is "no limit")
	} {
		if got := DefaultTotal(c.ports, c.memory); got != c.want {
			t.Errorf("DefaultTotal(%d, %d) = %d, want %d", c.ports, c.memory, got, c.want)
		}
	}
}

// The memory limit is the smallest of MemTotal and the process's cgroup
// limit, v2 or v1, with or without a cgroup namespace; "max" and v1's
// "unlimited" (a huge number) leave MemTotal.
func TestMemoryLimit(t *testing.T) {
	for _, c := range []struct {
		name  string
		files map[string]string
		want  uint64
	}{
		{"no cgroup limit", map[string]string{"sys/fs/cgroup/memory.max": "max\n"}, 8 << 30},
		{"v2 namespaced", map[string]string{"sys/fs/cgroup/memory.max": "268435456\n"}, 256 << 20},
		{"v2 by path", map[string]string{"proc/self/cgroup": "0::/pods/p1\n", "sys/fs/cgroup/pods/p1/memory.max": "134217728\n"}, 128 << 20},
		{"v1 by path", map[string]string{"proc/self/cgroup": "4:memory:/docker/c1\n0::/\n",
			"sys/fs/cgroup/memory/docker/c1/memory.limit_in_bytes": "67108864\n"}, 64 << 20},
		{"v1 unlimited", map[string]string{"sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712\n"}, 8 << 30},
	} {
		t.Run(c.name, func(t *testing.T) {
			root := t.TempDir()
			files := map[string]string{"proc/meminfo": "MemTotal:        8388608 kB\nMemFree: 1 kB\n"}
			for k, v := range c.files {
				files[k] = v
			}
			for p, content := range files {
				if err := os.MkdirAll(filepath.Dir(filepath.Join(root, p)), 0o755); err != nil {
					t.Fatal(err)
				}
				if err := os.WriteFile(filepath.Join(root, p), []byte(content), 0o644); err != nil {
					t.Fatal(err)
				}
			}
			got, err := memoryLimit(root)
			if err != nil || got != c.want {
				t.Fatalf("memoryLimit = %d, %v; want %d", got, err, c.want)
			}
		})
	}
	if _, err := memoryLimit(t.TempDir()); err != ErrNoMemoryLimit {
		t.Fatalf("nothing readable: %v, want ErrNoMemoryLimit", err)
	}
}
