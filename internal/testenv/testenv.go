// Package testenv holds helpers for privileged tests: the root requirement that
// skips outside CI and fails under CI=true, and a worker goroutine that runs
// closures on an OS thread locked inside a fresh network namespace.
package testenv

import (
	"fmt"
	"os"
	"runtime"
	"testing"

	"github.com/vishvananda/netns"
)

// RequireRoot skips the test unless it runs as root; under CI=true it fails
// instead, so that CI cannot pass by skipping the privileged tests.
func RequireRoot(t testing.TB) {
	t.Helper()
	if os.Geteuid() == 0 {
		return
	}
	if os.Getenv("CI") == "true" {
		t.Fatal("this test needs root (CAP_BPF, CAP_NET_ADMIN) and CI=true forbids skipping it")
	}
	t.Skip("needs root; run as root or under CI=true")
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
