// Command demo is `make demo`: it builds a three-namespace rig (client --
// server -- peer), runs stunnerd-xdp in the server namespace with XDP native on
// both server veths, sends iperf through STUNner's turncat, prints the delivered
// rate, the loss and what each path relayed, and tears the rig down. Root only.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"

	"github.com/l7mp/stunnerd-xdp/test/netns"
)

const (
	clientIP, serverClientIP = "10.100.0.2", "10.100.0.1"
	serverPeerIP, peerIP     = "10.200.0.1", "10.200.0.2"
	turnUser, turnPass       = "user1", "passwd1"
	// turncat cannot size its sockets; see test/e2e for why 4 MiB.
	demoRmemDefault = "4194304"
)

var macs = map[string]string{
	"cl0": "02:00:0a:64:00:02", "srv0": "02:00:0a:64:00:01",
	"srv1": "02:00:0a:c8:00:01", "peer0": "02:00:0a:c8:00:02",
}

type rig struct {
	cl, srv, peer string
	links         []link.Link
	procs         []*exec.Cmd
	mu            sync.Mutex
}

func main() {
	daemon := flag.String("daemon", "bin/stunnerd-xdp", "stunnerd-xdp binary")
	turncat := flag.String("turncat", "bin/turncat", "STUNner turncat v1.1.0 binary")
	rate := flag.Int("rate", 20000, "iperf datagrams per second")
	size := flag.Int("size", 100, "iperf datagram size in bytes")
	seconds := flag.Int("seconds", 10, "iperf run time")
	mode := flag.String("xdp-mode", "native", "stunnerd-xdp --xdp-mode")
	flag.Parse()
	if err := run(*daemon, *turncat, *mode, *rate, *size, *seconds); err != nil {
		fmt.Fprintln(os.Stderr, "demo:", err)
		os.Exit(1)
	}
}

func run(daemon, turncat, mode string, rate, size, seconds int) error {
	if os.Geteuid() != 0 {
		return errors.New("the demo builds network namespaces and attaches XDP: run it as root")
	}
	for _, tool := range []string{"ip", "iperf", daemon, turncat} {
		if _, err := exec.LookPath(tool); err != nil {
			return fmt.Errorf("%s is missing (make tools builds turncat; apt-get install iperf iproute2): %w", tool, err)
		}
	}
	id := fmt.Sprintf("%04x", rand.Uint32()&0xffff)
	r := &rig{cl: "sxdp-demo-" + id + "-cl", srv: "sxdp-demo-" + id + "-srv", peer: "sxdp-demo-" + id + "-peer"}
	defer r.teardown()
	// Ctrl-C tears down too.
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, os.Interrupt, syscall.SIGTERM)
	go func() {
		<-sigs
		r.teardown()
		os.Exit(130)
	}()
	if restore, err := setSysctl("/proc/sys/net/core/rmem_default", demoRmemDefault); err == nil {
		defer restore()
		fmt.Println("net.core.rmem_default set to", demoRmemDefault, "for the run (turncat cannot size its sockets); restored at the end")
	}

	fmt.Printf("rig: %s (%s) -- %s (%s | %s) -- %s (%s)\n", r.cl, clientIP, r.srv, serverClientIP, serverPeerIP, r.peer, peerIP)
	if err := r.build(); err != nil {
		return err
	}

	// The listener steering pins its maps; a private bpffs keeps the demo
	// out of the host's /sys/fs/bpf.
	pins, err := os.MkdirTemp("", "stunnerd-xdp-demo-bpffs-")
	if err != nil {
		return err
	}
	defer os.Remove(pins)
	if err := unix.Mount("bpffs", pins, "bpf", 0, "mode=0700"); err != nil {
		return fmt.Errorf("mount bpffs: %w", err)
	}
	defer func() { _ = unix.Unmount(pins, unix.MNT_DETACH) }()

	logf, err := os.CreateTemp("", "stunnerd-xdp-demo-*.log")
	if err != nil {
		return err
	}
	defer logf.Close()
	if _, err := r.start(r.srv, logf, daemon, "--xdp-mode="+mode, "--relay-address="+serverPeerIP, "--handover-dir="+pins,
		"--metrics-addr="+serverClientIP+":8080", "--health-addr="+serverClientIP+":8086", "--log=all:INFO",
		fmt.Sprintf("turn://%s:%s@%s:3478", turnUser, turnPass, serverClientIP)); err != nil {
		return err
	}
	if err := r.waitReady(); err != nil {
		return fmt.Errorf("%w; daemon log: %s", err, logf.Name())
	}
	before, err := r.metrics()
	if err != nil {
		return err
	}
	for _, l := range matching(before, "stunnerd_xdp_attached") {
		fmt.Println("  ", l)
	}

	var iperfSrv strings.Builder
	if _, err := r.start(r.peer, &lockedWriter{w: &iperfSrv}, "iperf", "-s", "-u", "-p", "5001", "-e", "-w", "4M"); err != nil {
		return err
	}
	if _, err := r.start(r.cl, io.Discard, turncat, "--log=all:WARN", "udp://127.0.0.1:5000",
		fmt.Sprintf("turn://%s:%s@%s:3478", turnUser, turnPass, serverClientIP), "udp://"+peerIP+":5001"); err != nil {
		return err
	}
	time.Sleep(700 * time.Millisecond)
	fmt.Printf("iperf: %d-byte datagrams at %d/s for %d s -> turncat (udp://127.0.0.1:5000) -> turn://%s:3478 -> %s:5001\n",
		size, rate, seconds, serverClientIP, peerIP)
	out, err := r.exec(r.cl, "iperf", "-c", "127.0.0.1", "-p", "5000", "-u", "-l", strconv.Itoa(size),
		"-b", fmt.Sprintf("%dpps", rate), "-t", strconv.Itoa(seconds))
	if err != nil {
		return fmt.Errorf("iperf client: %w\n%s", err, out)
	}
	var res netns.IperfResult
	deadline := time.Now().Add(5 * time.Second)
	for {
		if res, err = netns.ParseIperfServer(iperfSrv.String()); err == nil || time.Now().After(deadline) {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if err != nil {
		return fmt.Errorf("iperf server report: %w\n%s", err, iperfSrv.String())
	}
	after, err := r.metrics()
	if err != nil {
		return err
	}
	report(res, size, before, after)
	fmt.Println("daemon log:", logf.Name())
	return nil
}

func report(res netns.IperfResult, size int, before, after map[string]float64) {
	d := func(name string) float64 { return after[name] - before[name] }
	secs := res.Duration.Seconds()
	fmt.Println()
	fmt.Printf("delivered: %d of %d datagrams in %.2f s = %.0f pps, %.2f Mbit/s of payload\n",
		res.Received, res.Total, secs, float64(res.Received)/secs, float64(res.Received*int64(size)*8)/secs/1e6)
	fmt.Printf("loss:      %d datagrams (%.3f %%), %d out of order\n", res.Lost, res.LossPercent, res.OutOfOrder)
	for _, dir := range []string{"client_to_peer", "peer_to_client"} {
		x := d(`stunnerd_xdp_packets_total{direction="` + dir + `",path="xdp"}`)
		u := d(`stunnerd_xdp_packets_total{direction="` + dir + `",path="userspace"}`)
		share := 0.0
		if x+u > 0 {
			share = 100 * x / (x + u)
		}
		fmt.Printf("relayed %-15s XDP %9.0f  userspace %7.0f  (%.2f %% in the kernel)\n", dir+":", x, u, share)
	}
	fmt.Println("XDP verdicts during the run:")
	var lines []string
	for k := range after {
		if strings.HasPrefix(k, "stunnerd_xdp_verdicts_total") && d(k) > 0 {
			lines = append(lines, fmt.Sprintf("  %-70s %9.0f", k, d(k)))
		}
	}
	sort.Strings(lines)
	fmt.Println(strings.Join(lines, "\n"))
}

func (r *rig) build() error {
	for _, ns := range []string{r.cl, r.srv, r.peer} {
		if err := ipCmd("netns", "add", ns); err != nil {
			return err
		}
		if err := ipCmd("-n", ns, "link", "set", "lo", "up"); err != nil {
			return err
		}
		if _, err := r.exec(ns, "sysctl", "-qw", "net.ipv4.ip_forward=0", "net.ipv6.conf.all.disable_ipv6=1"); err != nil {
			return err
		}
	}
	steps := [][]string{
		{"link", "add", "cl0", "netns", r.cl, "address", macs["cl0"], "type", "veth", "peer", "name", "srv0", "netns", r.srv, "address", macs["srv0"]},
		{"link", "add", "peer0", "netns", r.peer, "address", macs["peer0"], "type", "veth", "peer", "name", "srv1", "netns", r.srv, "address", macs["srv1"]},
		{"-n", r.cl, "addr", "add", clientIP + "/24", "dev", "cl0"},
		{"-n", r.srv, "addr", "add", serverClientIP + "/24", "dev", "srv0"},
		{"-n", r.srv, "addr", "add", serverPeerIP + "/24", "dev", "srv1"},
		{"-n", r.peer, "addr", "add", peerIP + "/24", "dev", "peer0"},
		{"-n", r.cl, "link", "set", "cl0", "up"},
		{"-n", r.srv, "link", "set", "srv0", "up"},
		{"-n", r.srv, "link", "set", "srv1", "up"},
		{"-n", r.peer, "link", "set", "peer0", "up"},
		{"-n", r.cl, "neigh", "replace", serverClientIP, "lladdr", macs["srv0"], "dev", "cl0", "nud", "permanent"},
		{"-n", r.srv, "neigh", "replace", clientIP, "lladdr", macs["cl0"], "dev", "srv0", "nud", "permanent"},
		{"-n", r.srv, "neigh", "replace", peerIP, "lladdr", macs["peer0"], "dev", "srv1", "nud", "permanent"},
		{"-n", r.peer, "neigh", "replace", serverPeerIP, "lladdr", macs["srv1"], "dev", "peer0", "nud", "permanent"},
	}
	for _, s := range steps {
		if err := ipCmd(s...); err != nil {
			return err
		}
	}
	// bpf_fib_lookup needs forwarding on the ingress devices; the client still
	// has no route to the peer, only the relay joins them.
	if _, err := r.exec(r.srv, "sysctl", "-qw", "net.ipv4.conf.srv0.forwarding=1", "net.ipv4.conf.srv1.forwarding=1"); err != nil {
		return err
	}
	// Like a node, the server has a default route; the veths keep their default offloads (tx
	// checksum offload on, as in containers), so the relay sees CHECKSUM_PARTIAL frames.
	if err := ipCmd("-n", r.srv, "route", "add", "default", "via", peerIP, "dev", "srv1"); err != nil {
		return err
	}
	for ns, dev := range map[string]string{r.cl: "cl0", r.peer: "peer0"} {
		// veth delivers redirected XDP frames only to a peer that runs XDP itself.
		if err := r.attachPass(ns, dev); err != nil {
			return err
		}
	}
	return nil
}

func (r *rig) attachPass(ns, dev string) error {
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{Type: ebpf.XDP, License: "GPL",
		Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, 2), asm.Return()}})
	if err != nil {
		return fmt.Errorf("load XDP_PASS program: %w", err)
	}
	defer prog.Close()
	return (&netns.NS{Name: ns}).Do(func() error {
		ifc, err := net.InterfaceByName(dev)
		if err != nil {
			return err
		}
		l, err := link.AttachXDP(link.XDPOptions{Program: prog, Interface: ifc.Index, Flags: link.XDPDriverMode})
		if err != nil {
			return fmt.Errorf("attach XDP_PASS to %s: %w", dev, err)
		}
		r.links = append(r.links, l)
		return nil
	})
}

func (r *rig) start(ns string, out io.Writer, name string, args ...string) (*exec.Cmd, error) {
	cmd := exec.Command("ip", append([]string{"netns", "exec", ns, name}, args...)...)
	cmd.Stdout, cmd.Stderr = out, out
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	r.mu.Lock()
	r.procs = append(r.procs, cmd)
	r.mu.Unlock()
	return cmd, nil
}

func (r *rig) exec(ns, name string, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, "ip", append([]string{"netns", "exec", ns, name}, args...)...).CombinedOutput()
	return string(out), err
}

func ipCmd(args ...string) error {
	if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
		return fmt.Errorf("ip %s: %w: %s", strings.Join(args, " "), err, out)
	}
	return nil
}

func (r *rig) waitReady() error {
	deadline := time.Now().Add(15 * time.Second)
	for time.Now().Before(deadline) {
		if _, err := r.get("http://" + serverClientIP + ":8086/ready"); err == nil {
			return nil
		}
		time.Sleep(200 * time.Millisecond)
	}
	return errors.New("stunnerd-xdp did not become ready in 15 s")
}

func (r *rig) metrics() (map[string]float64, error) {
	body, err := r.get("http://" + serverClientIP + ":8080/metrics")
	if err != nil {
		return nil, err
	}
	m := map[string]float64{}
	for _, line := range strings.Split(body, "\n") {
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		if v, err := strconv.ParseFloat(line[i+1:], 64); err == nil {
			m[line[:i]] = v
		}
	}
	return m, nil
}

func matching(m map[string]float64, prefix string) []string {
	var out []string
	for k, v := range m {
		if strings.HasPrefix(k, prefix) {
			out = append(out, fmt.Sprintf("%s %g", k, v))
		}
	}
	sort.Strings(out)
	return out
}

// get fetches a URL from inside the server namespace.
func (r *rig) get(url string) (string, error) {
	code, body, err := (&netns.NS{Name: r.srv}).HTTPGet(url)
	if err == nil && code != http.StatusOK {
		err = fmt.Errorf("%s: status %d", url, code)
	}
	return body, err
}

func (r *rig) teardown() {
	r.mu.Lock()
	procs := r.procs
	r.procs = nil
	r.mu.Unlock()
	for _, p := range procs {
		_ = syscall.Kill(-p.Process.Pid, syscall.SIGTERM)
	}
	for _, p := range procs {
		done := make(chan struct{})
		go func() { _ = p.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			_ = syscall.Kill(-p.Process.Pid, syscall.SIGKILL)
			<-done
		}
	}
	for _, l := range r.links {
		_ = l.Close()
	}
	r.links = nil
	for _, ns := range []string{r.cl, r.srv, r.peer} {
		_ = exec.Command("ip", "netns", "del", ns).Run()
	}
}

func setSysctl(path, value string) (func(), error) {
	old, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	if err := os.WriteFile(path, []byte(value), 0); err != nil {
		return nil, err
	}
	return func() { _ = os.WriteFile(path, old, 0) }, nil
}

type lockedWriter struct {
	mu sync.Mutex
	w  *strings.Builder
}

func (l *lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}
