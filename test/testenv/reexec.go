package testenv

import (
	"context"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"
)

// envNetns names the network namespace a re-executed test runs in.
const envNetns = "STUNNERD_XDP_TEST_NETNS"

// InNetns reports whether this test process was re-executed inside a network
// namespace by RunInNetns.
func InNetns() bool { return os.Getenv(envNetns) != "" }

// RunInNetns re-executes the current test (t.Name()) with `ip netns exec ns`,
// so that every thread of the child, and every socket pion/turn opens from its
// goroutines, lives in that namespace. env adds KEY=VALUE pairs for the child.
// The child's output is logged; its failure fails t. The child is bounded by
// timeout (scaled: Timeout) and killed by PID (its process group) when it runs over.
func RunInNetns(t *testing.T, ns string, timeout time.Duration, env ...string) {
	t.Helper()
	timeout = Timeout(timeout)
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	args := []string{"netns", "exec", ns, os.Args[0], "-test.run", "^" + strings.ReplaceAll(t.Name(), "/", "$/^") + "$", "-test.v", "-test.count=1"}
	cmd := exec.CommandContext(ctx, "ip", args...)
	cmd.Env = append(append(os.Environ(), envNetns+"="+ns), env...)
	out, err := cmd.CombinedOutput()
	t.Logf("child in netns %s:\n%s", ns, out)
	if ctx.Err() != nil {
		t.Fatalf("child in netns %s ran over %v", ns, timeout)
	}
	if err != nil {
		t.Fatalf("child in netns %s failed: %v", ns, err)
	}
	if !strings.Contains(string(out), "--- PASS: "+t.Name()) {
		t.Fatalf("child in netns %s did not run %s", ns, t.Name())
	}
}
