// Command udpecho is the two-way traffic tool of the end-to-end tests:
//
//	udpecho serve ADDR                 echo every datagram back to its sender
//	udpecho send -to ADDR [flags]      send numbered datagrams at a fixed rate and count the echoes
//
// send prints one JSON line: {"sent":N,"received":N,"duplicates":N,"corrupt":N}. Every
// run is bounded by -count and -timeout.
package main

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"net"
	"os"
	"syscall"
	"time"

	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: udpecho serve ADDR | udpecho send -to ADDR [-rate PPS] [-count N] [-size BYTES] [-timeout D]")
		os.Exit(2)
	}
	var err error
	switch os.Args[1] {
	case "serve":
		if len(os.Args) != 3 {
			err = fmt.Errorf("usage: udpecho serve ADDR")
			break
		}
		err = serve(os.Args[2])
	case "send":
		err = send(os.Args[2:])
	default:
		err = fmt.Errorf("unknown command %q", os.Args[1])
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "udpecho:", err)
		os.Exit(1)
	}
}

func serve(addr string) error {
	c, err := net.ListenPacket("udp4", addr)
	if err != nil {
		return err
	}
	if err := testenv.ForceReadBuffer(c.(*net.UDPConn), 4<<20); err != nil {
		return err
	}
	buf := make([]byte, 65536)
	for {
		n, from, err := c.ReadFrom(buf)
		if err != nil {
			return err
		}
		if _, err := c.WriteTo(buf[:n], from); err != nil {
			return err
		}
	}
}

type result struct {
	Sent       int `json:"sent"`
	Received   int `json:"received"`
	Duplicates int `json:"duplicates"`
	Corrupt    int `json:"corrupt"`
}

func send(args []string) error {
	fs := flag.NewFlagSet("send", flag.ContinueOnError)
	to := fs.String("to", "", "destination ADDR:PORT")
	rate := fs.Int("rate", 1000, "datagrams per second")
	count := fs.Int("count", 10000, "datagrams to send")
	size := fs.Int("size", 100, "datagram size in bytes (at least 8)")
	timeout := fs.Duration("timeout", 2*time.Second, "how long to wait for echoes after the last send")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *to == "" || *rate <= 0 || *count <= 0 || *size < 8 {
		return fmt.Errorf("need -to, a positive -rate and -count, and -size >= 8")
	}
	raddr, err := net.ResolveUDPAddr("udp4", *to)
	if err != nil {
		return err
	}
	c, err := net.DialUDP("udp4", nil, raddr)
	if err != nil {
		return err
	}
	if err := testenv.ForceReadBuffer(c, 4<<20); err != nil {
		return err
	}
	seen := make([]bool, *count)
	var res result
	done := make(chan struct{})
	go func() {
		defer close(done)
		buf := make([]byte, 65536)
		for {
			n, err := c.Read(buf)
			if errors.Is(err, syscall.ECONNREFUSED) {
				continue // an ICMP error for an earlier datagram, e.g. before the relay listened
			}
			if err != nil {
				return
			}
			if n != *size {
				res.Corrupt++
				continue
			}
			seq := binary.BigEndian.Uint64(buf[:8])
			if seq >= uint64(*count) || !pattern(buf[8:n], seq) {
				res.Corrupt++
				continue
			}
			if seen[seq] {
				res.Duplicates++
				continue
			}
			seen[seq] = true
			res.Received++
		}
	}()
	payload := make([]byte, *size)
	interval := time.Second / time.Duration(*rate)
	start := time.Now()
	for i := 0; i < *count; i++ {
		if d := time.Until(start.Add(time.Duration(i) * interval)); d > 0 {
			time.Sleep(d)
		}
		binary.BigEndian.PutUint64(payload, uint64(i))
		fill(payload[8:], uint64(i))
		if _, err := c.Write(payload); err == nil {
			res.Sent++
		}
	}
	time.Sleep(*timeout)
	_ = c.Close()
	<-done
	return json.NewEncoder(os.Stdout).Encode(res)
}

func fill(b []byte, seq uint64) {
	for i := range b {
		b[i] = byte(seq + uint64(i))
	}
}

func pattern(b []byte, seq uint64) bool {
	for i := range b {
		if b[i] != byte(seq+uint64(i)) {
			return false
		}
	}
	return true
}
