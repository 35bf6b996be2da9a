// Package netns is the test-fixture layer of the privileged tests, the benchmark and the demo:
// named namespaces that `ip netns` can see, Go code run inside them (Do, on a fresh locked
// goroutine), processes that die with the test, the client -- server -- peer rig (Build, or
// New in tests), rigs built like Kubernetes nodes, one per Shape (BuildNode, or NewNode in
// tests), and the probes tests wait on: Eventually, WaitUDPBound, GetOK, Scrape (the daemon's
// /metrics through expfmt). Binary builds the programs the tests run, Allocate makes pion/turn
// allocations from inside a namespace.
//
// Everything a fixture creates is removed through t.Cleanup (Rig.Close and NodeRig.Close outside
// tests), also when the test fails. A test binary killed from outside (or by `go test -timeout`) skips
// cleanups; remove what it left with
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

	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// NamePrefix starts the name of every namespace this package creates.
const NamePrefix = "sxdp-"

// cmdTimeout bounds every command that Run and the fixtures run to completion.
var cmdTimeout = testenv.Timeout(30 * time.Second)

// RequirePrivileged skips the test unless it can create network namespaces (root and a working
// `ip netns`) and the given tools, plus ip which the rigs need, are in PATH. With
// CI=true a missing privilege or tool fails the test instead, so that CI cannot silently skip
// the end-to-end tests. Under `go test -short` the test is always skipped.
func RequirePrivileged(t testing.TB, tools ...string) {
	t.Helper()
	if testing.Short() {
		t.Skip("privileged test skipped in -short mode")
	}
	testenv.Require(t, append([]string{"ip"}, tools...)...)
}

// NS is a named network namespace, visible to `ip netns` as Name.
type NS struct {
	Name string
}

// NewNS creates a network namespace named NamePrefix + a random tag + "-" + role, with loopback
// up, and deletes it when the test ends. Deleting the namespace also removes every interface in it.
func NewNS(t testing.TB, role string) *NS {
	t.Helper()
	n, err := CreateNS(uniqueTag() + "-" + role)
	if err != nil {
		t.Fatal(err)
	}
	closeAtCleanup(t, n.Delete)
	return n
}

// closeAtCleanup runs undo when the test ends and reports its error.
func closeAtCleanup(t testing.TB, undo func() error) {
	t.Cleanup(func() {
		if err := undo(); err != nil {
			t.Error(err)
		}
	})
}

// CreateNS creates the network namespace NamePrefix + suffix with loopback up. The caller deletes
// it (Delete); NewNS and the rigs do that for tests.
func CreateNS(suffix string) (*NS, error) {
	n := &NS{Name: NamePrefix + suffix}
	if _, err := Exec("ip", "netns", "add", n.Name); err != nil {
		return nil, err
	}
	if _, err := Exec("ip", "-n", n.Name, "link", "set", "lo", "up"); err != nil {
		return nil, errors.Join(err, n.Delete())
	}
	return n, nil
}

// Delete deletes the namespace and with it every interface in it.
func (n *NS) Delete() error {
	_, err := Exec("ip", "netns", "del", n.Name)
	return err
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

// Exec runs a command in this process's namespace to completion (at most cmdTimeout: 30 s, scaled) and returns its
// combined output; the error carries the command line and the output.
func Exec(name string, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), cmdTimeout)
	defer cancel()
	out, err := exec.CommandContext(ctx, name, args...).CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("%s %s: %w\n%s", name, strings.Join(args, " "), err, out)
	}
	return string(out), nil
}

// Exec runs a command inside the namespace to completion (at most cmdTimeout: 30 s, scaled), as the package's Exec.
func (n *NS) Exec(name string, args ...string) (string, error) {
	out, err := Exec("ip", append([]string{"netns", "exec", n.Name, name}, args...)...)
	if err != nil {
		err = fmt.Errorf("netns %s: %w", n.Name, err)
	}
	return out, err
}

// Run is Exec that fails the test on error, showing the output.
func (n *NS) Run(t testing.TB, name string, args ...string) string {
	t.Helper()
	out, err := n.Exec(name, args...)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// IP runs `ip -n NAME args...` (cheaper than `ip netns exec NAME ip args...`) and fails the test
// on error.
func (n *NS) IP(t testing.TB, args ...string) string {
	t.Helper()
	out, err := Exec("ip", append([]string{"-n", n.Name}, args...)...)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// Do runs fn inside the namespace on a fresh goroutine locked to its OS thread, as cilium/ebpf's
// testutils.NetNS.Do does, and returns fn's error. The caller's goroutine and thread never change
// namespace. Sockets and bpf_links created in fn stay in the namespace after Do returns.
// Goroutines that fn starts run on other threads and do NOT inherit the namespace.
// /proc/self/net shows the namespace of the main thread: inside fn, read /proc/thread-self/net
// instead. /sys is not switched either (use Exec for /sys/class/net). fn runs on a goroutine of
// its own, so it must not call t.FailNow (Do reports that as an error); a panic in fn is
// re-raised in the caller.
func (n *NS) Do(fn func() error) error {
	type result struct {
		err      error
		panicked any
	}
	done := make(chan result, 1)
	go func() {
		runtime.LockOSThread()
		returned := false
		var res result
		defer func() {
			if !returned {
				if res.panicked = recover(); res.panicked == nil {
					res.err = fmt.Errorf("netns %s: the function run in Do exited without returning (t.FailNow?)", n.Name)
				}
			}
			done <- res
		}()
		back, err := n.enter()
		if err != nil {
			runtime.UnlockOSThread()
			res.err, returned = err, true
			return
		}
		// If switching back fails the thread stays locked: the runtime then discards it when the
		// goroutine exits instead of reusing a thread stuck in the wrong namespace. Only then: a
		// thread that exits kills the children it forked that set Pdeathsig (see Start).
		defer func() {
			if back() == nil {
				runtime.UnlockOSThread()
			}
		}()
		res.err = fn()
		returned = true
	}()
	res := <-done
	if res.panicked != nil {
		panic(res.panicked)
	}
	return res.err
}

// enter switches the calling (locked) thread into the namespace and returns the function that
// switches it back.
func (n *NS) enter() (back func() error, err error) {
	orig, err := os.Open("/proc/thread-self/ns/net")
	if err != nil {
		return nil, err
	}
	target, err := os.Open("/run/netns/" + n.Name)
	if err != nil {
		orig.Close()
		return nil, fmt.Errorf("opening netns %s: %w", n.Name, err)
	}
	defer target.Close()
	if err := unix.Setns(int(target.Fd()), unix.CLONE_NEWNET); err != nil {
		orig.Close()
		return nil, fmt.Errorf("entering netns %s: %w", n.Name, err)
	}
	return func() error {
		defer orig.Close()
		return unix.Setns(int(orig.Fd()), unix.CLONE_NEWNET)
	}, nil
}

// Snmp returns the counters of /proc/net/snmp inside the namespace, keyed "Proto.Counter", for
// example "Udp.InDatagrams", "Udp.RcvbufErrors", "Udp.NoPorts" or "Ip.ForwDatagrams".
func (n *NS) Snmp(t testing.TB) map[string]int64 {
	t.Helper()
	return n.counters(t, "snmp", parseSnmp)
}

// Netstat returns the counters of /proc/net/netstat inside the namespace, keyed as Snmp keys
// them, for example "TcpExt.IPReversePathFilter" (the packets the reverse-path filter dropped).
func (n *NS) Netstat(t testing.TB) map[string]int64 {
	t.Helper()
	return n.counters(t, "netstat", parseSnmp)
}

// Snmp6 returns the IPv6 counters of /proc/net/snmp6 inside the namespace, keyed as the file
// names them, for example "Udp6InDatagrams", "Udp6RcvbufErrors", "Icmp6OutMsgs" or
// "Ip6OutMcastPkts". In a namespace where IPv6 is disabled they stay 0.
func (n *NS) Snmp6(t testing.TB) map[string]int64 {
	t.Helper()
	return n.counters(t, "snmp6", parseSnmp6)
}

// counters parses /proc/net/FILE of the namespace.
func (n *NS) counters(t testing.TB, file string, parse func(string) (map[string]int64, error)) map[string]int64 {
	t.Helper()
	var counters map[string]int64
	err := n.Do(func() error {
		b, err := os.ReadFile("/proc/thread-self/net/" + file)
		if err == nil {
			counters, err = parse(string(b))
		}
		return err
	})
	if err != nil {
		t.Fatalf("netns %s: reading /proc/net/%s: %v", n.Name, file, err)
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
func parseSnmp(s string) (map[string]int64, error) {
	counters := map[string]int64{}
	sc := bufio.NewScanner(strings.NewReader(s))
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

// HTTPGet fetches url from inside the namespace and returns the status code and body. The
// connection is dialled in Do, so its socket lives in the namespace.
func (n *NS) HTTPGet(url string) (int, string, error) {
	return httpGet(url, n.DialContext)
}

// DialContext dials addr from inside the namespace (the socket lives there, the connection serves
// this process): for a client in the test process of a server in the namespace.
func (n *NS) DialContext(ctx context.Context, network, addr string) (c net.Conn, err error) {
	err = n.Do(func() error {
		c, err = (&net.Dialer{Timeout: testenv.Timeout(2 * time.Second)}).DialContext(ctx, network, addr)
		return err
	})
	return c, err
}

// UnixGet fetches url (its host part is ignored) through the unix socket at path, such as the
// daemon's --health-socket.
func UnixGet(path, url string) (int, string, error) {
	return httpGet(url, func(ctx context.Context, _, _ string) (net.Conn, error) {
		return (&net.Dialer{Timeout: testenv.Timeout(2 * time.Second)}).DialContext(ctx, "unix", path)
	})
}

func httpGet(url string, dial func(ctx context.Context, network, addr string) (net.Conn, error)) (int, string, error) {
	client := &http.Client{Timeout: testenv.Timeout(5 * time.Second), Transport: &http.Transport{DialContext: dial, DisableKeepAlives: true}}
	resp, err := client.Get(url)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), err
}

// UDPBound reports whether a UDP socket in the namespace is bound to port: the probe that a
// server (the relay, an iperf or echo peer, turncat) listens.
func (n *NS) UDPBound(port int) (bool, error) {
	var bound bool
	err := n.Do(func() error {
		// udp6 too: Go servers listening on a wildcard get a dual-stack socket.
		for _, file := range []string{"/proc/thread-self/net/udp", "/proc/thread-self/net/udp6"} {
			b, err := os.ReadFile(file)
			if err != nil {
				return err
			}
			want := fmt.Sprintf(":%04X", port)
			for _, line := range strings.Split(string(b), "\n") {
				if f := strings.Fields(line); len(f) > 1 && strings.HasSuffix(f[1], want) {
					bound = true
				}
			}
		}
		return nil
	})
	return bound, err
}

// WaitUDPBound waits at most timeout until a UDP socket in the namespace is bound to port. If
// the server that should bind it is given and exits first, it returns at once.
func (n *NS) WaitUDPBound(port int, timeout time.Duration, server *Proc) error {
	return Eventually(timeout, 20*time.Millisecond, func() error {
		if server != nil && server.Exited() {
			return Abort(fmt.Errorf("netns %s: the server exited before binding UDP port %d: %w\n%s", n.Name, port, server.err, server.Stderr()))
		}
		if bound, err := n.UDPBound(port); err != nil || bound {
			return err
		}
		return fmt.Errorf("netns %s: nothing bound to UDP port %d", n.Name, port)
	})
}

// GetOK fetches url from inside the namespace and returns an error unless it answers 200 OK:
// a probe such as the daemon's /live or /ready.
func (n *NS) GetOK(url string) error {
	code, body, err := n.HTTPGet(url)
	if err == nil && code != http.StatusOK {
		err = fmt.Errorf("GET %s: status %d: %.200s", url, code, body)
	}
	return err
}
