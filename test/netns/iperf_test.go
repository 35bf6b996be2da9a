package netns_test

import (
	"flag"
	"math"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/l7mp/stunnerd-xdp/test/netns"
)

var update = flag.Bool("update", false, "rewrite testdata/iperf-*.txt from live iperf runs (TestIperf)")

func TestParseIperfServer(t *testing.T) {
	for _, tc := range []struct {
		name string
		file string // in testdata; or out
		out  string
		want netns.IperfResult
	}{
		// Captured by `go test -run 'TestIperf$' -update` (iperf 2.1.8): 100-byte datagrams at
		// 20000 pps for 2s, from the server namespace to the peer. A new capture changes the numbers.
		{name: "server enhanced", file: "iperf-server-enhanced.txt",
			want: netns.IperfResult{Duration: 2 * time.Second, Total: 40002, Lost: 0, Received: 40002}},
		{name: "client enhanced", file: "iperf-client-enhanced.txt",
			want: netns.IperfResult{Duration: 2 * time.Second, Total: 40002, Lost: 0, Received: 40002}},
		// This run lost 97 datagrams at the peer's socket buffer (Udp.RcvbufErrors).
		{name: "server", file: "iperf-server.txt",
			want: netns.IperfResult{Duration: 1999900 * time.Microsecond, Total: 40002, Lost: 97, Received: 39905, LossPercent: 0.24}},
		{name: "client", file: "iperf-client.txt",
			want: netns.IperfResult{Duration: 1999900 * time.Microsecond, Total: 40002, Lost: 97, Received: 39905, LossPercent: 0.24}},
		// Older iperf2 layout, with interval reports and an out-of-order line for the summary.
		{name: "intervals and out-of-order", out: `
[ ID] Interval       Transfer     Bandwidth        Jitter   Lost/Total Datagrams
[  3]  0.0- 1.0 sec  60.3 KBytes   494 Kbits/sec  12.208 ms    4/   42 (9.5%)
[  3]  0.0- 1.0 sec  4 datagrams received out-of-order
[  3]  1.0- 2.0 sec  58.9 KBytes   482 Kbits/sec  12.538 ms    0/   41 (0%)
[  3]  0.0- 2.0 sec   119 KBytes   488 Kbits/sec  12.538 ms    4/   83 (4.8%)
[  3]  0.0- 2.0 sec  7 datagrams received out-of-order
`, want: netns.IperfResult{Duration: 2 * time.Second, Total: 83, Lost: 4, Received: 79, LossPercent: 4.8, OutOfOrder: 7}},
		{name: "out-of-order of another interval", out: `
[  3]  0.0- 1.0 sec  60.3 KBytes   494 Kbits/sec  12.208 ms    4/   42 (9.5%)
[  3]  0.0- 1.0 sec  4 datagrams received out-of-order
[  3]  1.0- 2.0 sec  58.9 KBytes   482 Kbits/sec  12.538 ms    0/   41 (0%)
`, want: netns.IperfResult{Duration: time.Second, Total: 41, Received: 41}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			out := tc.out
			if tc.file != "" {
				b, err := os.ReadFile(filepath.Join("testdata", tc.file))
				if err != nil {
					t.Fatal(err)
				}
				out = string(b)
			}
			got, err := netns.ParseIperfServer(out)
			if err != nil {
				t.Fatal(err)
			}
			if got != tc.want {
				t.Errorf("ParseIperfServer() = %+v, want %+v", got, tc.want)
			}
		})
	}
}

func TestParseIperfServerNaN(t *testing.T) {
	got, err := netns.ParseIperfServer("[  1] 0.0000-0.0000 sec  0.00 Bytes  0.00 bits/sec   0.000 ms 0/0 (-nan%)\n")
	if err != nil {
		t.Fatal(err)
	}
	if got.Total != 0 || !math.IsNaN(got.LossPercent) {
		t.Errorf("ParseIperfServer() = %+v, want Total 0 and LossPercent NaN", got)
	}
}

func TestParseIperfServerNoReport(t *testing.T) {
	for _, out := range []string{
		"",
		"Server listening on UDP port 5001\n",
		// The client's own line carries Write/Err, not Lost/Total.
		"[  1] 0.0000-2.0009 sec  3.81 MBytes  16.0 Mbits/sec  39999/0    19992 pps\n",
	} {
		if got, err := netns.ParseIperfServer(out); err == nil {
			t.Errorf("ParseIperfServer(%q) = %+v, want an error", out, got)
		}
	}
}

// TestIperf runs iperf2 from the server to the peer namespace and checks what ParseIperfServer
// makes of the live output against the peer's UDP counters. With -update it stores the output as
// the fixtures of TestParseIperfServer.
func TestIperf(t *testing.T) {
	netns.RequirePrivileged(t, "iperf")
	r := netns.NewRouted(t)

	for _, tc := range []struct {
		name     string
		enhanced bool
	}{{"enhanced", true}, {"plain", false}} {
		t.Run(tc.name, func(t *testing.T) {
			var serverArgs []string
			// iperf2 -b takes bits/s or, with the pps suffix, datagrams/s.
			clientArgs := []string{"-c", r.PeerIf.Addr.String(), "-u", "-p", "5001", "-l", "100", "-b", "20000pps", "-t", "2"}
			if tc.enhanced {
				serverArgs = append(serverArgs, "-e")
				clientArgs = append(clientArgs, "-e")
			}
			server := r.Peer.StartIperfServer(t, 5001, serverArgs...)
			before := r.Peer.Snmp(t)
			clientOut := r.Server.Run(t, "iperf", clientArgs...)

			res, err := server.IperfReport(5 * time.Second)
			if err != nil {
				t.Fatal(err)
			}
			after := r.Peer.Snmp(t)
			if err := server.Stop(); err != nil {
				t.Errorf("iperf server: %v", err)
			}
			t.Logf("%+v", res)

			fromClient, err := netns.ParseIperfServer(clientOut)
			if err != nil {
				t.Fatalf("client output: %v:\n%s", err, clientOut)
			}
			if fromClient.Total != res.Total || fromClient.Lost != res.Lost {
				t.Errorf("client's server report %+v differs from the server's %+v", fromClient, res)
			}
			if res.Duration < time.Second || res.Duration > 3*time.Second {
				t.Errorf("duration %v, want about 2s", res.Duration)
			}
			if res.Total < 1000 {
				t.Errorf("only %d datagrams sent, want about 40000", res.Total)
			}
			// iperf's count should match the kernel's: every datagram it counts as received was
			// delivered to its socket, and on a veth loss only happens at the socket buffer.
			delivered := after["Udp.InDatagrams"] - before["Udp.InDatagrams"]
			if d := delivered - res.Received; d < 0 || d > 10 {
				t.Errorf("iperf received %d, peer Udp.InDatagrams grew by %d", res.Received, delivered)
			}
			if dropped := after["Udp.RcvbufErrors"] - before["Udp.RcvbufErrors"]; dropped != res.Lost {
				t.Logf("iperf lost %d, peer Udp.RcvbufErrors grew by %d", res.Lost, dropped)
			}

			if *update {
				suffix := map[bool]string{true: "-enhanced", false: ""}[tc.enhanced]
				write(t, "iperf-server"+suffix+".txt", server.Stdout())
				write(t, "iperf-client"+suffix+".txt", clientOut)
			}
		})
	}
}

func write(t *testing.T, name, content string) {
	t.Helper()
	if err := os.MkdirAll("testdata", 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join("testdata", name), []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
}
