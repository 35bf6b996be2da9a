package netns

import (
	"errors"
	"fmt"
	"math"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"
)

// IperfResult is the end-of-test report of an iperf2 UDP server.
type IperfResult struct {
	Duration    time.Duration // length of the reported interval
	Total       int64         // datagrams the client sent, by sequence number
	Lost        int64         // datagrams missing from the sequence (negative if duplicates arrived)
	Received    int64         // Total - Lost
	LossPercent float64
	OutOfOrder  int64 // from the "datagrams received out-of-order" line, 0 without one
}

var (
	// A report line, with or without -e, e.g.
	//  [  1] 0.0000-2.0011 sec  3.78 MBytes  15.9 Mbits/sec   0.001 ms 339/40000 (0.85%) 0.005/... ms ...
	//  [  4]  0.0- 1.0 sec  60.3 KBytes   494 Kbits/sec  12.208 ms    4/   42 (9.5%)
	iperfReport = regexp.MustCompile(`^\[\s*(\S+?)\s*\]\s+(\d+(?:\.\d+)?)\s*-\s*(\d+(?:\.\d+)?)\s+sec\s.*?\s(-?\d+)/\s*(\d+)\s+\(([^)%]*)%\)`)
	//  [  4]  0.0- 1.0 sec  4 datagrams received out-of-order
	iperfOutOfOrder = regexp.MustCompile(`^\[\s*(\S+?)\s*\]\s+(\d+(?:\.\d+)?)\s*-\s*(\d+(?:\.\d+)?)\s+sec\s+(\d+)\s+datagrams received out-of-order`)
)

// ParseIperfServer parses the output of an iperf2 UDP server (`iperf -s -u`, with or without -e)
// and returns its last report: with -i, that is the end-of-test summary. A client's output also
// works, through the "Server Report" the server sends it back. One server process should serve
// one client run: with several flows the result is that of the last one to report.
func ParseIperfServer(out string) (IperfResult, error) {
	var res IperfResult
	var id, interval string
	found := false
	for _, line := range strings.Split(out, "\n") {
		line = strings.TrimSpace(line)
		if m := iperfReport.FindStringSubmatch(line); m != nil {
			r, err := parseIperfReport(m)
			if err != nil {
				return IperfResult{}, fmt.Errorf("iperf report %q: %w", line, err)
			}
			res, id, interval, found = r, m[1], m[2]+"-"+m[3], true
			continue
		}
		// iperf prints the out-of-order count on the line after the report it belongs to.
		if m := iperfOutOfOrder.FindStringSubmatch(line); m != nil && found && m[1] == id && m[2]+"-"+m[3] == interval {
			n, err := strconv.ParseInt(m[4], 10, 64)
			if err != nil {
				return IperfResult{}, fmt.Errorf("iperf out-of-order %q: %w", line, err)
			}
			res.OutOfOrder = n
		}
	}
	if !found {
		return IperfResult{}, errors.New("no iperf UDP server report (Lost/Total) in output")
	}
	return res, nil
}

func parseIperfReport(m []string) (IperfResult, error) {
	start, err1 := strconv.ParseFloat(m[2], 64)
	end, err2 := strconv.ParseFloat(m[3], 64)
	lost, err3 := strconv.ParseInt(m[4], 10, 64)
	total, err4 := strconv.ParseInt(m[5], 10, 64)
	if err := errors.Join(err1, err2, err3, err4); err != nil {
		return IperfResult{}, err
	}
	// iperf prints "nan" or "-nan" (which ParseFloat rejects) when nothing arrived.
	percent := math.NaN()
	if !strings.HasSuffix(m[6], "nan") {
		var err error
		if percent, err = strconv.ParseFloat(m[6], 64); err != nil {
			return IperfResult{}, err
		}
	}
	return IperfResult{
		Duration:    time.Duration(math.Round((end-start)*1e6)) * time.Microsecond,
		Total:       total,
		Lost:        lost,
		Received:    total - lost,
		LossPercent: percent,
	}, nil
}

// StartIperfServer starts an iperf2 UDP server (`iperf -s -u -p PORT args...`) in the namespace
// and waits until it listens.
func (n *NS) StartIperfServer(t testing.TB, port int, args ...string) *Proc {
	t.Helper()
	p := n.Start(t, "iperf", append([]string{"-s", "-u", "-p", strconv.Itoa(port)}, args...)...)
	if err := n.WaitUDPBound(port, 5*time.Second, p); err != nil {
		t.Fatalf("iperf server: %v", err)
	}
	return p
}

// IperfReport waits at most timeout for the report of the iperf server p, which it prints when
// the client's final datagram arrives, and parses it (ParseIperfServer).
func (p *Proc) IperfReport(timeout time.Duration) (IperfResult, error) {
	var res IperfResult
	err := Eventually(timeout, 50*time.Millisecond, func() (err error) {
		res, err = ParseIperfServer(p.Stdout())
		return err
	})
	if err != nil {
		err = fmt.Errorf("%w\nserver output:\n%s", err, p.Stdout())
	}
	return res, err
}
