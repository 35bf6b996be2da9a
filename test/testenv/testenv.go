// Package testenv holds helpers for privileged tests: the one privilege check
// (Require), which skips outside CI and fails under CI=true, and a worker goroutine that runs
// closures on an OS thread locked inside a fresh network namespace.
package testenv

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"testing"
	"time"

	"github.com/vishvananda/netns"
)

// RequireRoot skips the test unless it runs as root; under CI=true it fails
// instead, so that CI cannot pass by skipping the privileged tests.
func RequireRoot(t testing.TB) { Require(t) }

// Require is the one privilege check of the tests: root, and each of tools
// in PATH (with "ip", a working `ip netns`). Without them the test is skipped
// and says why; under CI=true it fails instead, so that CI cannot pass by
// skipping.
func Require(t testing.TB, tools ...string) {
	t.Helper()
	reason := privilegeProblem(tools)
	if reason == "" {
		return
	}
	if os.Getenv("CI") == "true" {
		t.Fatalf("this test cannot run with CI=true: %s", reason)
	}
	t.Skipf("skipped: %s (run as root, or under CI=true to fail instead)", reason)
}

func privilegeProblem(tools []string) string {
	if os.Geteuid() != 0 {
		return "not running as root (CAP_BPF, CAP_NET_ADMIN)"
	}
	for _, tool := range tools {
		if _, err := exec.LookPath(tool); err != nil {
			return fmt.Sprintf("%s not found in PATH", tool)
		}
	}
	if slices.Contains(tools, "ip") {
		ctx, cancel := context.WithTimeout(context.Background(), Timeout(30*time.Second))
		defer cancel()
		if out, err := exec.CommandContext(ctx, "ip", "netns", "list").CombinedOutput(); err != nil {
			return fmt.Sprintf("`ip netns list` failed: %v: %s", err, out)
		}
	}
	return ""
}

// NSWorker runs functions on one OS thread locked in its own network namespace.
// Goroutines started from those functions do not inherit the namespace.
type NSWorker struct {
	work chan func()
	done chan struct{}
	NS   netns.NsHandle
}

// NewNSWorker creates a network namespace and a thread locked inside it; the
// namespace and the thread go away at cleanup.
func NewNSWorker(t testing.TB) *NSWorker {
	t.Helper()
	w := &NSWorker{work: make(chan func()), done: make(chan struct{})}
	ready := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		// Never unlocked: the thread dies with the goroutine rather than go
		// back to the pool inside a foreign namespace.
		origin, err := netns.Get()
		if err != nil {
			ready <- fmt.Errorf("get current netns: %w", err)
			return
		}
		defer origin.Close()
		ns, err := netns.New()
		if err != nil {
			ready <- fmt.Errorf("create netns: %w", err)
			return
		}
		w.NS = ns
		ready <- nil
		for f := range w.work {
			f()
		}
		_ = netns.Set(origin)
		ns.Close()
		close(w.done)
	}()
	if err := <-ready; err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		close(w.work)
		<-w.done
	})
	return w
}

// Do runs f inside the namespace and returns its error.
func (w *NSWorker) Do(f func() error) error {
	errc := make(chan error, 1)
	w.work <- func() { errc <- f() }
	return <-errc
}
