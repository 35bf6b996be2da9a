package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"time"
)

const probeUsage = `Usage: stunnerd-xdp probe [--health-socket PATH] [--timeout D] live|ready|status

Asks the daemon listening on the health socket for /live, /ready or /status and
exits 0 when it answers 200, 1 otherwise: a Kubernetes exec probe that reaches
this pod's daemon even while another daemon on the node holds the health port.

Flags:
`

func probe(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("stunnerd-xdp probe", flag.ContinueOnError)
	fs.SetOutput(stderr)
	sock := fs.String("health-socket", "/run/stunnerd-xdp/health.sock", "`PATH` of the daemon's --health-socket")
	timeout := fs.Duration("timeout", 2*time.Second, "give up after this long")
	fs.Usage = func() {
		fmt.Fprint(stderr, probeUsage)
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	if fs.NArg() != 1 || fs.Arg(0) != "live" && fs.Arg(0) != "ready" && fs.Arg(0) != "status" {
		fmt.Fprintln(stderr, "stunnerd-xdp probe: want one of live, ready or status (see --help)")
		return 2
	}
	c := &http.Client{Timeout: *timeout, Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", *sock)
		},
	}}
	resp, err := c.Get("http://stunnerd-xdp/" + fs.Arg(0))
	if err != nil {
		fmt.Fprintf(stderr, "stunnerd-xdp probe: %v\n", err)
		return 1
	}
	defer resp.Body.Close()
	_, _ = io.Copy(stdout, resp.Body)
	if resp.StatusCode != http.StatusOK {
		fmt.Fprintf(stderr, "stunnerd-xdp probe: %s answered %s\n", fs.Arg(0), resp.Status)
		return 1
	}
	return 0
}
