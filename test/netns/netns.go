// Package netns provides network-namespace fixtures for privileged end-to-end tests: named namespaces
// that `ip netns` can see, commands and Go code run inside them, processes that die with the test,
// and two ready-made rigs (NewRouted, NewBridged) for exercising an XDP relay.
//
// Everything a fixture creates is removed through t.Cleanup, also when the test fails. A test
// binary killed from outside (or by `go test -timeout`) skips cleanups; remove what it left with
//
//	for n in $(ip netns list | grep -o '^sxdp-[^ ]*'); do ip netns del "$n"; done
//
// Test traffic must stay inside the namespaces a test creates.
package netns

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// NamePrefix starts the name of every namespace this package creates.
const NamePrefix = "sxdp-"

// cmdTimeout bounds every command that Run and the fixtures run to completion.
const cmdTimeout = 30 * time.Second

// RequirePrivileged skips the test unless it can create network namespaces (root and a working
// `ip netns`) and the given tools, plus ip which the rigs need, are in PATH. With
// CI=true a missing privilege or tool fails the test instead, so that CI cannot silently skip
// the end-to-end tests. Under `go test -short` the test is always skipped.
func RequirePrivileged(t testing.TB, tools ...string) {
	t.Helper()
	if testing.Short() {
		t.Skip("privileged test skipped in -short mode")
	}
	if reason := privilegeProblem(append([]string{"ip"}, tools...)); reason != "" {
		if os.Getenv("CI") == "true" {
			t.Fatalf("privileged test cannot run with CI=true: %s", reason)
		}
		t.Skipf("privileged test skipped: %s", reason)
	}
}

func privilegeProblem(tools []string) string {
	if os.Geteuid() != 0 {
		return "not running as root"
	}
	for _, tool := range tools {
		if _, err := exec.LookPath(tool); err != nil {
			return fmt.Sprintf("%s not found in PATH", tool)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), cmdTimeout)
	defer cancel()
	if out, err := exec.CommandContext(ctx, "ip", "netns", "list").CombinedOutput(); err != nil {
		return fmt.Sprintf("`ip netns list` failed: %v: %s", err, out)
	}
	return ""
}

// NS is a named network namespace, visible to `ip netns` as Name.
type NS struct {
	Name string
}

// NewNS creates a network namespace named NamePrefix + a random tag + "-" + role, with loopback
// up, and deletes it when the test ends. Deleting the namespace also removes every interface in it.
func NewNS(t testing.TB, role string) *NS {
	t.Helper()
	return newNS(t, uniqueTag()+"-"+role)
}

func newNS(t testing.TB, suffix string) *NS {
	t.Helper()
	n := &NS{Name: NamePrefix + suffix}
	runCmd(t, "ip", "netns", "add", n.Name)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), cmdTimeout)
		defer cancel()
		if out, err := run(exec.CommandContext(ctx, "ip", "netns", "del", n.Name)); err != nil {
			t.Errorf("deleting netns %s: %v: %s", n.Name, err, out)
		}
	})
	n.IP(t, "link", "set", "lo", "up")
	return n
}

// uniqueTag returns a short random tag that keeps the namespaces of concurrently running test
// binaries apart.
func uniqueTag() string {
	return fmt.Sprintf("%06x", rand.Uint32()&0xffffff)
}

// Cmd returns a command that runs name inside the namespace through `ip netns exec`. `ip netns
// exec` execs the command, so the process ID is the command's own.
func (n *NS) Cmd(ctx context.Context, name string, args ...string) *exec.Cmd {
	return exec.CommandContext(ctx, "ip", append([]string{"netns", "exec", n.Name, name}, args...)...)
}

// Run runs a command inside the namespace to completion (at most 30s) and returns its combined
// output; any failure fails the test, showing the output.
func (n *NS) Run(t testing.TB, name string, args ...string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), cmdTimeout)
	defer cancel()
	out, err := run(n.Cmd(ctx, name, args...))
	if err != nil {
		t.Fatalf("netns %s: %s %s: %v\n%s", n.Name, name, strings.Join(args, " "), err, out)
	}
	return out
}

// IP runs `ip -n NAME args...` (cheaper than `ip netns exec NAME ip args...`) and fails the test
// on error.
func (n *NS) IP(t testing.TB, args ...string) string {
	t.Helper()
	return runCmd(t, "ip", append([]string{"-n", n.Name}, args...)...)
}

// Do runs fn on the calling goroutine, locked to its OS thread, with the thread switched into the
// namespace, and switches it back afterwards. Sockets and bpf_links created in fn stay in the
// namespace after Do returns. Goroutines that fn starts run on other threads and do NOT inherit
// the namespace. /proc/self/net shows the namespace of the main thread: inside fn, read
// /proc/thread-self/net instead. /sys is not switched either (use Run for /sys/class/net).
func (n *NS) Do(fn func() error) error {
	runtime.LockOSThread()
	orig, err := os.Open("/proc/thread-self/ns/net")
	if err != nil {
		runtime.UnlockOSThread()
		return err
	}
	defer orig.Close()
	target, err := os.Open("/run/netns/" + n.Name)
	if err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("opening netns %s: %w", n.Name, err)
	}
	defer target.Close()
	if err := unix.Setns(int(target.Fd()), unix.CLONE_NEWNET); err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("entering netns %s: %w", n.Name, err)
	}
	// Deferred so that it also runs when fn calls t.FailNow. If switching back fails the thread
	// stays locked: the runtime then discards it when the goroutine exits instead of reusing a
	// thread stuck in the wrong namespace.
	defer func() {
		if err := unix.Setns(int(orig.Fd()), unix.CLONE_NEWNET); err != nil {
			panic(fmt.Sprintf("netns %s: cannot switch thread back to its namespace: %v", n.Name, err))
		}
		runtime.UnlockOSThread()
	}()
	return fn()
}

// Snmp returns the counters of /proc/net/snmp inside the namespace, keyed "Proto.Counter", for
// example "Udp.InDatagrams", "Udp.RcvbufErrors", "Udp.NoPorts" or "Ip.ForwDatagrams".
func (n *NS) Snmp(t testing.TB) map[string]int64 {
	t.Helper()
	var counters map[string]int64
	err := n.Do(func() error {
		f, err := os.Open("/proc/thread-self/net/snmp")
		if err != nil {
			return err
		}
		defer f.Close()
		counters, err = parseSnmp(f)
		return err
	})
	if err != nil {
		t.Fatalf("netns %s: reading /proc/net/snmp: %v", n.Name, err)
	}
	return counters
}

// Snmp6 returns the IPv6 counters of /proc/net/snmp6 inside the namespace, keyed as the file
// names them, for example "Udp6InDatagrams", "Udp6RcvbufErrors", "Icmp6OutMsgs" or
// "Ip6OutMcastPkts". In a namespace where IPv6 is disabled they stay 0.
func (n *NS) Snmp6(t testing.TB) map[string]int64 {
	t.Helper()
	var counters map[string]int64
	err := n.Do(func() error {
		b, err := os.ReadFile("/proc/thread-self/net/snmp6")
		if err != nil {
			return err
		}
		counters, err = parseSnmp6(string(b))
		return err
	})
	if err != nil {
		t.Fatalf("netns %s: reading /proc/net/snmp6: %v", n.Name, err)
	}
	return counters
}

// parseSnmp6 parses the /proc/net/snmp6 format: one "Name value" pair per line.
func parseSnmp6(s string) (map[string]int64, error) {
	counters := map[string]int64{}
	for _, line := range strings.Split(s, "\n") {
		f := strings.Fields(line)
		if len(f) == 0 {
			continue
		}
		if len(f) != 2 {
			return nil, fmt.Errorf("snmp6: bad line %q", line)
		}
		v, err := strconv.ParseInt(f[1], 10, 64)
		if err != nil {
			return nil, fmt.Errorf("snmp6: %s: %w", f[0], err)
		}
		counters[f[0]] = v
	}
	return counters, nil
}

// parseSnmp parses the /proc/net/snmp format: per protocol a line of counter names followed by a
// line of values, both prefixed with "Proto:".
func parseSnmp(f *os.File) (map[string]int64, error) {
	counters := map[string]int64{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		names := strings.Fields(sc.Text())
		if !sc.Scan() {
			return nil, errors.New("snmp: header line without values")
		}
		values := strings.Fields(sc.Text())
		if len(names) == 0 || len(names) != len(values) || names[0] != values[0] {
			return nil, fmt.Errorf("snmp: mismatched lines %q and %q", names, values)
		}
		proto := strings.TrimSuffix(names[0], ":")
		for i := 1; i < len(names); i++ {
			v, err := strconv.ParseInt(values[i], 10, 64)
			if err != nil {
				return nil, fmt.Errorf("snmp: %s.%s: %w", proto, names[i], err)
			}
			counters[proto+"."+names[i]] = v
		}
	}
	return counters, sc.Err()
}

// runCmd runs a command in the test's own namespace, bounded by cmdTimeout; failure fails the test.
func runCmd(t testing.TB, name string, args ...string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), cmdTimeout)
	defer cancel()
	out, err := run(exec.CommandContext(ctx, name, args...))
	if err != nil {
		t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
	return out
}

func run(cmd *exec.Cmd) (string, error) {
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// HTTPGet fetches url from inside the namespace and returns the status code
// and body. The connection is dialled in Do, so its socket lives in the
// namespace (net/http's transport would dial from another thread).
func (n *NS) HTTPGet(url string) (int, string, error) {
	var (
		code int
		body string
	)
	err := n.Do(func() error {
		req, err := http.NewRequest(http.MethodGet, url, nil)
		if err != nil {
			return err
		}
		c, err := net.DialTimeout("tcp", req.URL.Host, 2*time.Second)
		if err != nil {
			return err
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(5 * time.Second))
		req.Close = true
		if err := req.Write(c); err != nil {
			return err
		}
		resp, err := http.ReadResponse(bufio.NewReader(c), req)
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		code, body = resp.StatusCode, string(b)
		return err
	})
	return code, body, err
}
