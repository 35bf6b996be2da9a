package netns

import (
	"context"
	"errors"
	"fmt"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// stopGrace is how long Stop waits after SIGTERM before it sends SIGKILL (scaled:
// testenv.Timeout).
const stopGrace = 5 * time.Second

// Proc is a process started in a namespace by NS.Start. It runs in its own process group, which
// Stop and Kill signal as a whole, and is stopped when the test ends if still running.
type Proc struct {
	cmd            *exec.Cmd
	stdout, stderr testenv.LockedBuffer
	done           chan struct{} // closed when the process has exited and err is set
	err            error
}

// Start starts a command inside the namespace and returns without waiting for it. Its output is
// captured for Stdout and Stderr. The process gets SIGKILL if the test binary dies, and is
// stopped (SIGTERM, then SIGKILL) by t.Cleanup.
func (n *NS) Start(t testing.TB, name string, args ...string) *Proc {
	t.Helper()
	p, err := n.Launch(name, args...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := p.Stop(); err != nil && !isSignalExit(err) {
			t.Logf("netns %s: %s exited: %v\nstdout:\n%s\nstderr:\n%s", n.Name, name, err, p.Stdout(), p.Stderr())
		}
	})
	return p
}

// Launch is Start for code without a test (the demo): the caller stops the process.
func (n *NS) Launch(name string, args ...string) (*Proc, error) {
	p, err := LaunchCmd(n.Cmd(context.Background(), name, args...))
	if err != nil {
		return nil, fmt.Errorf("netns %s: %w", n.Name, err)
	}
	return p, nil
}

// LaunchCmd starts cmd as Launch starts a command in a namespace (a process group of its own,
// output captured, SIGKILL if the test binary dies), wherever cmd runs: for a server that lives in
// the test process's own namespace. The caller stops the process.
func LaunchCmd(cmd *exec.Cmd) (*Proc, error) {
	p := &Proc{done: make(chan struct{}), cmd: cmd}
	p.cmd.Stdout, p.cmd.Stderr = &p.stdout, &p.stderr
	// Setpgid puts the process and its children in a group of their own that Stop can signal
	// without touching anything else. Pdeathsig covers a test binary that dies without cleanups
	// (e.g. `go test -timeout`); it follows the forking thread, but Go threads live as long as
	// the process unless one exits locked (see NS.Do).
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	// A child that inherited the output pipes could otherwise keep Wait from returning.
	p.cmd.WaitDelay = testenv.Timeout(stopGrace)
	if err := p.cmd.Start(); err != nil {
		return nil, fmt.Errorf("starting %s: %w", cmd, err)
	}
	go func() {
		p.err = p.cmd.Wait()
		close(p.done)
	}()
	return p, nil
}

// PID returns the process ID, which is also the ID of its process group.
func (p *Proc) PID() int { return p.cmd.Process.Pid }

// Stdout returns what the process has written to stdout so far.
func (p *Proc) Stdout() string { return p.stdout.String() }

// Stderr returns what the process has written to stderr so far.
func (p *Proc) Stderr() string { return p.stderr.String() }

// Exited reports whether the process has exited.
func (p *Proc) Exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// Wait waits at most timeout (scaled: testenv.Timeout) for the process to exit by itself and
// returns its exit error.
func (p *Proc) Wait(timeout time.Duration) error {
	timeout = testenv.Timeout(timeout)
	select {
	case <-p.done:
		return p.err
	case <-time.After(timeout):
		return fmt.Errorf("pid %d still running after %v", p.PID(), timeout)
	}
}

// Stop sends SIGTERM to the process group, then SIGKILL if it is still running after stopGrace, and
// returns the exit error (an *exec.ExitError for the signal when it had to be stopped).
func (p *Proc) Stop() error {
	if p.Exited() {
		return p.err
	}
	_ = syscall.Kill(-p.PID(), syscall.SIGTERM)
	select {
	case <-p.done:
		return p.err
	case <-time.After(testenv.Timeout(stopGrace)):
		return p.Kill()
	}
}

// Kill sends SIGKILL to the process group and waits for the process to exit.
func (p *Proc) Kill() error {
	if !p.Exited() {
		_ = syscall.Kill(-p.PID(), syscall.SIGKILL)
	}
	return p.Wait(stopGrace)
}

// WaitOutput waits at most timeout until substr appears on stdout or stderr: for a report the
// test checks (an error the process must log). Readiness is a probe's (WaitUDPBound, GetOK), not
// a log line's. It returns false if the process exited or the time ran out first.
func (p *Proc) WaitOutput(substr string, timeout time.Duration) bool {
	return Eventually(timeout, 20*time.Millisecond, func() error {
		switch {
		case strings.Contains(p.Stdout(), substr) || strings.Contains(p.Stderr(), substr):
			return nil
		case p.Exited():
			return Abort(errors.New("exited"))
		}
		return errors.New("not yet")
	}) == nil
}

func isSignalExit(err error) bool {
	var exitErr *exec.ExitError
	if !errors.As(err, &exitErr) {
		return false
	}
	status, ok := exitErr.Sys().(syscall.WaitStatus)
	return ok && status.Signaled()
}
