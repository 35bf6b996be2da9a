// Command demo is `make demo`: it builds a three-namespace rig (client --
// server -- peer, test/netns), runs stunnerd-xdp in the server namespace with
// XDP native on both server veths, sends iperf through STUNner's turncat,
// prints the delivered rate, the loss and what each path relayed, and tears the
// rig down. Root only.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/l7mp/stunnerd-xdp/test/netns"
)

const (
	turnUser, turnPass = "user1", "passwd1"
)

func main() {
	daemon := flag.String("daemon", "bin/stunnerd-xdp", "stunnerd-xdp binary")
	turncat := flag.String("turncat", "bin/turncat", "STUNner turncat v1.1.0 binary")
	rate := flag.Int("rate", 20000, "iperf datagrams per second")
	size := flag.Int("size", 100, "iperf datagram size in bytes")
	seconds := flag.Int("seconds", 10, "iperf run time")
	mode := flag.String("xdp-mode", "native", "stunnerd-xdp --xdp-mode")
	minShare := flag.Float64("min-kernel-share", 0, "fail unless at least this `percent` of client->peer was relayed in the kernel (make test-kernels: 99)")
	flag.Parse()
	if err := run(*daemon, *turncat, *mode, *rate, *size, *seconds, *minShare); err != nil {
		fmt.Fprintln(os.Stderr, "demo:", err)
		os.Exit(1)
	}
}

// demo is the rig and what runs in it, torn down once (at the end or on Ctrl-C).
type demo struct {
	rig      *netns.Rig
	procs    []*netns.Proc
	teardown sync.Once
}

func (d *demo) start(ns *netns.NS, name string, args ...string) (*netns.Proc, error) {
	p, err := ns.Launch(name, args...)
	if err == nil {
		d.procs = append(d.procs, p)
	}
	return p, err
}

func (d *demo) close() {
	d.teardown.Do(func() {
		for _, p := range d.procs {
			_ = p.Stop()
		}
		_ = d.rig.Close()
	})
}

func run(daemon, turncat, mode string, rate, size, seconds int, minShare float64) error {
	if os.Geteuid() != 0 {
		return errors.New("the demo builds network namespaces and attaches XDP: run it as root")
	}
	for _, tool := range []string{"ip", "iperf", daemon, turncat} {
		if _, err := exec.LookPath(tool); err != nil {
			return fmt.Errorf("%s is missing (make tools builds turncat; apt-get install iperf iproute2): %w", tool, err)
		}
	}
	if _, restore, err := netns.RaiseRmemDefault(); err == nil {
		defer restore()
		fmt.Println("net.core.rmem_default set to", netns.TurncatRmem, "for the run (turncat cannot size its sockets); restored at the end")
	}
	r, err := netns.Build(netns.WithTag("demo"))
	if err != nil {
		return err
	}
	d := &demo{rig: r}
	defer d.close()
	// Ctrl-C tears down too.
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, os.Interrupt, syscall.SIGTERM)
	go func() {
		<-sigs
		d.close()
		os.Exit(130)
	}()
	server, peer := r.ServerClientIf.Addr.String(), r.PeerIf.Addr.String()
	fmt.Printf("rig: %s (%s) -- %s (%s | %s) -- %s (%s)\n", r.Client.Name, r.ClientIf.Addr, r.Server.Name, server, r.ServerPeerIf.Addr, r.Peer.Name, peer)

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
	turnURI := fmt.Sprintf("turn://%s:%s@%s:3478", turnUser, turnPass, server)
	// The peer is in a private network, which the daemon refuses unless
	// told: the demo opens its one peer, as an operator would.
	p, err := d.start(r.Server, daemon, "--xdp-mode="+mode, "--relay-address="+r.ServerPeerIf.Addr.String(), "--steering-dir="+pins, "--allow-peer="+peer+"/32",
		"--metrics-addr="+server+":8080", "--health-addr="+server+":8086", "--log=all:INFO", turnURI)
	if err != nil {
		return err
	}
	// The log goes to the file once the daemon has stopped, also when the demo fails.
	defer func() { d.close(); _, _ = logf.WriteString(p.Stdout() + p.Stderr()) }()
	if err := netns.Eventually(15*time.Second, 50*time.Millisecond, func() error { return r.Server.GetOK("http://" + server + ":8086/ready") }); err != nil {
		return fmt.Errorf("stunnerd-xdp did not become ready in 15 s: %w; daemon log: %s", err, logf.Name())
	}
	metrics := "http://" + server + ":8080/metrics"
	before, err := r.Server.Scrape(metrics)
	if err != nil {
		return err
	}
	for _, l := range matching(before.Samples(), "stunnerd_xdp_attached") {
		fmt.Println("  ", l)
	}

	iperfSrv, err := d.start(r.Peer, "iperf", "-s", "-u", "-p", "5001", "-e", "-w", "4M")
	if err == nil {
		err = r.Peer.WaitUDPBound(5001, 5*time.Second, iperfSrv)
	}
	if err != nil {
		return err
	}
	tc, err := d.start(r.Client, turncat, "--log=all:WARN", "udp://127.0.0.1:5000", turnURI, "udp://"+peer+":5001")
	if err == nil {
		err = r.Client.WaitUDPBound(5000, 5*time.Second, tc)
	}
	if err != nil {
		return err
	}
	fmt.Printf("iperf: %d-byte datagrams at %d/s for %d s -> turncat (udp://127.0.0.1:5000) -> turn://%s:3478 -> %s:5001\n",
		size, rate, seconds, server, peer)
	ctx, cancel := context.WithTimeout(context.Background(), time.Duration(seconds)*time.Second+time.Minute)
	defer cancel()
	out, err := r.Client.Cmd(ctx, "iperf", "-c", "127.0.0.1", "-p", "5000", "-u", "-l", strconv.Itoa(size),
		"-b", fmt.Sprintf("%dpps", rate), "-t", strconv.Itoa(seconds)).CombinedOutput()
	if err != nil {
		return fmt.Errorf("iperf client: %w\n%s", err, out)
	}
	var res netns.IperfResult
	if err := netns.Eventually(5*time.Second, 100*time.Millisecond, func() (err error) {
		res, err = netns.ParseIperfServer(iperfSrv.Stdout())
		return err
	}); err != nil {
		return fmt.Errorf("iperf server report: %w\n%s", err, iperfSrv.Stdout())
	}
	after, err := r.Server.Scrape(metrics)
	if err != nil {
		return err
	}
	c2p := report(res, size, before.Samples(), after.Samples())
	fmt.Println("daemon log:", logf.Name())
	if c2p < minShare {
		return fmt.Errorf("%.2f %% of client->peer relayed in the kernel, under --min-kernel-share %.2f %%", c2p, minShare)
	}
	return nil
}

// report prints what the run delivered and what each path relayed, and
// returns the kernel's share of client->peer in percent.
func report(res netns.IperfResult, size int, before, after map[string]float64) (c2pShare float64) {
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
		if dir == "client_to_peer" {
			c2pShare = share
		}
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
	return c2pShare
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
