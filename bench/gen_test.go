package bench

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"net"
	"net/netip"
	"os"
	"runtime"
	"sort"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/pion/logging"
	"github.com/pion/turn/v4"
	"golang.org/x/sys/unix"

	"github.com/l7mp/stunnerd-xdp/test/netns"
	"github.com/l7mp/stunnerd-xdp/test/packet"
	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// ---- the load generator ----

// mmsghdr is struct mmsghdr of sendmmsg(2). x/sys v0.50 has no Sendmmsg, so
// the generator calls the syscall itself.
type mmsghdr struct {
	hdr unix.Msghdr
	len uint32
	_   [4]byte
}

const batchSize = 64

// stream is one socket's share of the load: datagrams to dst, cycling through
// payloads (one per channel when several channels share the socket).
type stream struct {
	fd       int
	dst      unix.RawSockaddrInet4
	payloads [][]byte
}

func sockaddr(ip net.IP, port int) unix.RawSockaddrInet4 {
	sa := unix.RawSockaddrInet4{Family: unix.AF_INET}
	binary.BigEndian.PutUint16((*[2]byte)(unsafe.Pointer(&sa.Port))[:], uint16(port))
	copy(sa.Addr[:], ip.To4())
	return sa
}

// genResult is what a generator run sent.
type genResult struct {
	sent    uint64
	retries uint64 // EAGAIN/ENOBUFS: the socket or device queue was full
	elapsed time.Duration
}

// generate sends for dur at rate packets/s in total (0: as fast as it can) from
// workers threads, each with batches of up to 64 datagrams per sendmmsg. Paced
// runs send bursts of about a millisecond's worth, so the generator sleeps
// between bursts instead of spinning on the cores the relays need. It stops by
// itself after dur.
func generate(streams []*stream, rate float64, dur time.Duration, workers int) genResult {
	if workers < 1 {
		workers = 1
	}
	var sent, retries atomic.Uint64
	var wg sync.WaitGroup
	start := time.Now()
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			s, r := sendLoop(streams, rate/float64(workers), dur, w, start)
			sent.Add(s)
			retries.Add(r)
		}(w)
	}
	wg.Wait()
	return genResult{sent: sent.Load(), retries: retries.Load(), elapsed: time.Since(start)}
}

func sendLoop(streams []*stream, rate float64, dur time.Duration, worker int, start time.Time) (sent, retries uint64) {
	var hdrs [batchSize]mmsghdr
	var iovs [batchSize]unix.Iovec
	si := worker % len(streams) // stream index
	pi := make([]int, len(streams))
	burst := 64.0
	if rate > 0 {
		burst = math.Max(1, math.Min(64, rate/1000))
	}
	for {
		elapsed := time.Since(start)
		if elapsed >= dur {
			return sent, retries
		}
		n := batchSize
		if rate > 0 {
			due := rate*elapsed.Seconds() - float64(sent)
			if due < burst {
				time.Sleep(time.Duration((burst - due) / rate * float64(time.Second)))
				continue
			}
			n = int(math.Min(due, batchSize))
		}
		cur := si
		s := streams[cur]
		si = (si + 1) % len(streams)
		for i := 0; i < n; i++ {
			p := s.payloads[pi[cur]%len(s.payloads)]
			pi[cur]++
			iovs[i].Base = &p[0]
			iovs[i].SetLen(len(p))
			hdrs[i].hdr.Name = (*byte)(unsafe.Pointer(&s.dst))
			hdrs[i].hdr.Namelen = unix.SizeofSockaddrInet4
			hdrs[i].hdr.Iov = &iovs[i]
			hdrs[i].hdr.SetIovlen(1)
		}
		off := 0
		for off < n {
			r, _, errno := unix.Syscall6(unix.SYS_SENDMMSG, uintptr(s.fd), uintptr(unsafe.Pointer(&hdrs[off])), uintptr(n-off), 0, 0, 0)
			if errno != 0 {
				if errno == unix.EINTR {
					continue
				}
				// EAGAIN (non-blocking socket full) or ENOBUFS: back off a little.
				retries++
				time.Sleep(20 * time.Microsecond)
				if time.Since(start) >= dur {
					return sent, retries
				}
				continue
			}
			off += int(r)
			sent += uint64(r)
		}
	}
}

// fdOf returns the descriptor of a Go UDP socket, to send on it with sendmmsg
// next to Go's own use of it. The socket must stay open while it is used.
func fdOf(c *net.UDPConn) (int, error) {
	rc, err := c.SyscallConn()
	if err != nil {
		return 0, err
	}
	var fd int
	err = rc.Control(func(f uintptr) { fd = int(f) })
	return fd, err
}

// ---- the peer: sink and echo ----

// peers are the sink and the echo in the peer namespace.
type peers struct {
	sink *net.UDPConn
}

func (h *harness) startPeers(t *testing.T) {
	t.Helper()
	p := &peers{}
	err := h.rig.Peer.Do(func() (err error) {
		p.sink, err = net.ListenUDP("udp4", &net.UDPAddr{IP: peerIP, Port: sinkPort})
		return err
	})
	if err != nil {
		t.Fatalf("peer sink: %v", err)
	}
	// Small on purpose: nobody reads the sink, and a full buffer turns every
	// datagram into a cheap Udp.RcvbufErrors.
	_ = p.sink.SetReadBuffer(8192)
	t.Cleanup(func() { p.sink.Close() })
	h.rig.Peer.ServeUDPEcho(t, netip.AddrPortFrom(netip.AddrFrom4([4]byte(peerIP)), uint16(echoPort)))
	h.peers = p
}

// sinkSaw reads the sink for up to wait and reports whether marker arrived;
// it also empties the sink's buffer of older datagrams.
func (p *peers) sinkSaw(marker []byte, wait time.Duration) bool {
	buf := make([]byte, 2048)
	deadline := time.Now().Add(wait)
	defer func() { _ = p.sink.SetReadDeadline(time.Time{}) }()
	for {
		_ = p.sink.SetReadDeadline(deadline)
		n, _, err := p.sink.ReadFromUDP(buf)
		if err != nil {
			return false
		}
		if bytes.Contains(buf[:n], marker) {
			return true
		}
	}
}

// delivered is what reached the peer's UDP layer: accepted by a socket,
// dropped at a full socket buffer, or sent to a port nobody listens on.
func delivered(c map[string]int64) int64 {
	return c["Udp.InDatagrams"] + c["Udp.RcvbufErrors"] + c["Udp.NoPorts"]
}

// ---- a client session: a real TURN allocation, or the direct path ----

// session is one client UDP socket in the client namespace. Over TURN it holds
// an allocation with channel sinkChan bound to the sink and echoChan to the
// echo; direct, it talks to the peer without a relay (kernel forwarding).
type session struct {
	conn   *net.UDPConn
	fd     int
	turn   bool
	client *turn.Client
	relay  net.PacketConn
	server *net.UDPAddr // TURN: the listener; direct: nil

	probes  chan struct{}
	lat     atomic.Pointer[latencyRecorder]
	readers sync.WaitGroup
}

var (
	probeMarker = []byte("bench-probe")
	sinkMarker  = []byte("bench-sink")
	latMagic    = []byte("LAT!")
)

// quietLogger keeps pion's client quiet unless something is wrong.
func quietLogger() logging.LoggerFactory {
	f := logging.NewDefaultLoggerFactory()
	f.DefaultLogLevel = logging.LogLevelError
	return f
}

// newSession opens the client socket; over TURN (server non-nil) it allocates
// and binds both channels, and waits until data flows through each.
func newSession(t *testing.T, h *harness, server *net.UDPAddr) *session {
	return newSessionIn(t, h, h.rig.Client, clientIP, server)
}

// newSessionIn is newSession with the socket at ip in namespace ns.
func newSessionIn(t *testing.T, h *harness, ns *netns.NS, ip net.IP, server *net.UDPAddr) *session {
	t.Helper()
	s := &session{turn: server != nil, server: server, probes: make(chan struct{}, 16)}
	err := ns.Do(func() error {
		var err error
		s.conn, err = net.ListenUDP("udp4", &net.UDPAddr{IP: ip})
		return err
	})
	if err != nil {
		t.Fatalf("client socket: %v", err)
	}
	testenv.ReadBuffer(t, s.conn, 4<<20)
	testenv.WriteBuffer(t, s.conn, 4<<20)
	if s.fd, err = fdOf(s.conn); err != nil {
		t.Fatal(err)
	}
	if s.turn {
		s.client, err = turn.NewClient(&turn.ClientConfig{
			STUNServerAddr: server.String(), TURNServerAddr: server.String(),
			Username: user, Password: password, Conn: s.conn, LoggerFactory: quietLogger(),
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	s.readers.Add(1)
	go s.read()
	t.Cleanup(s.close)
	if !s.turn {
		return s
	}

	if s.relay, err = s.client.Allocate(); err != nil {
		t.Fatalf("allocate at %v: %v", server, err)
	}
	sink := &net.UDPAddr{IP: peerIP, Port: sinkPort}
	echo := &net.UDPAddr{IP: peerIP, Port: echoPort}
	// pion's client numbers channels from 0x4000 in the order of first use:
	// sink first (sinkChan), then echo (echoChan). Until a ChannelBind
	// completes it sends Send indications, and it retries the bind on writes.
	sinkOK, echoOK := false, false
	if err := netns.Eventually(10*time.Second, time.Millisecond, func() error {
		if _, err := s.relay.WriteTo([]byte("bind"), sink); err != nil {
			return netns.Abort(fmt.Errorf("write to sink through the relay: %w", err))
		}
		if _, err := s.relay.WriteTo([]byte("bind"), echo); err != nil {
			return netns.Abort(fmt.Errorf("write to echo through the relay: %w", err))
		}
		time.Sleep(20 * time.Millisecond)
		_, _ = s.conn.WriteToUDP(packet.ChannelData(sinkChan, sinkMarker, nil), server)
		_, _ = s.conn.WriteToUDP(packet.ChannelData(echoChan, probeMarker, nil), server)
		if !sinkOK {
			sinkOK = h.peers.sinkSaw(sinkMarker, 100*time.Millisecond)
		}
		select {
		case <-s.probes:
			echoOK = true
		case <-time.After(100 * time.Millisecond):
		}
		if sinkOK && echoOK {
			return nil
		}
		return fmt.Errorf("channels not bound through %v (sink %v, echo %v)", server, sinkOK, echoOK)
	}); err != nil {
		t.Fatal(err)
	}
	return s
}

// read handles everything that comes back to the client socket: echoes on
// echoChan (or from the echo, direct) are probes or latency samples; the rest
// is STUN for pion's client.
func (s *session) read() {
	defer s.readers.Done()
	client := s.client // close() clears the field only after this goroutine has ended
	buf := make([]byte, 2048)
	for {
		n, from, err := s.conn.ReadFromUDP(buf)
		if err != nil {
			return
		}
		now := time.Now()
		var payload []byte
		switch {
		case s.turn && n >= 4 && buf[0]&0xC0 == 0x40:
			if binary.BigEndian.Uint16(buf) != echoChan {
				continue
			}
			l := int(binary.BigEndian.Uint16(buf[2:]))
			if 4+l > n {
				continue
			}
			payload = buf[4 : 4+l]
		case s.turn:
			_, _ = client.HandleInbound(buf[:n], from)
			continue
		default:
			payload = buf[:n]
		}
		if bytes.Equal(payload, probeMarker) {
			select {
			case s.probes <- struct{}{}:
			default:
			}
		} else if rec := s.lat.Load(); rec != nil {
			rec.record(payload, now)
		}
	}
}

// stream returns the generator's view of this session: datagrams of size bytes
// of application data to the sink, as ChannelData over TURN.
func (s *session) stream(size int) *stream {
	data := make([]byte, size)
	for i := range data {
		data[i] = byte(i)
	}
	if s.turn {
		return &stream{fd: s.fd, dst: sockaddr(s.server.IP, s.server.Port), payloads: [][]byte{packet.ChannelData(sinkChan, data, nil)}}
	}
	return &stream{fd: s.fd, dst: sockaddr(peerIP, sinkPort), payloads: [][]byte{data}}
}

func (s *session) close() {
	if s.relay != nil {
		// A Refresh with lifetime 0: the server deallocates. The reader is
		// still running, so the response reaches pion's client.
		_ = s.relay.Close()
		s.relay = nil
	}
	if s.conn != nil {
		s.conn.Close()
		s.readers.Wait()
		s.conn = nil
	}
	if s.client != nil {
		s.client.Close()
		s.client = nil
	}
}

// ---- latency ----

type latencyRecorder struct {
	base time.Time
	mu   sync.Mutex
	rtt  []time.Duration // by sequence number; 0: no echo
}

func (r *latencyRecorder) record(p []byte, now time.Time) {
	if len(p) < 16 || !bytes.Equal(p[:4], latMagic) {
		return
	}
	seq := int(binary.BigEndian.Uint32(p[4:]))
	sentAt := time.Duration(binary.BigEndian.Uint64(p[8:]))
	r.mu.Lock()
	defer r.mu.Unlock()
	if seq < len(r.rtt) && r.rtt[seq] == 0 {
		r.rtt[seq] = now.Sub(r.base) - sentAt
	}
}

// latency sends rate timestamped datagrams per second for dur to the echo and
// returns the round-trip percentiles of those that came back.
func (s *session) latency(t *testing.T, name string, rate float64, dur time.Duration, size int) LatencyRow {
	t.Helper()
	count := int(rate * dur.Seconds())
	rec := &latencyRecorder{base: time.Now(), rtt: make([]time.Duration, count)}
	s.lat.Store(rec)
	defer s.lat.Store(nil)
	dst := &net.UDPAddr{IP: peerIP, Port: echoPort}
	if s.turn {
		dst = s.server
	}
	payload := make([]byte, size)
	copy(payload, latMagic)
	for i := 0; i < count; i++ {
		due := time.Duration(float64(i) / rate * float64(time.Second))
		if wait := due - time.Since(rec.base); wait > 0 {
			time.Sleep(wait)
		}
		binary.BigEndian.PutUint32(payload[4:], uint32(i))
		binary.BigEndian.PutUint64(payload[8:], uint64(time.Since(rec.base)))
		msg := payload
		if s.turn {
			msg = packet.ChannelData(echoChan, payload, nil)
		}
		if _, err := s.conn.WriteToUDP(msg, dst); err != nil {
			t.Fatalf("latency probe: %v", err)
		}
	}
	time.Sleep(300 * time.Millisecond) // the last echoes
	rec.mu.Lock()
	var got []float64
	for _, d := range rec.rtt {
		if d > 0 {
			got = append(got, float64(d)/float64(time.Microsecond))
		}
	}
	rec.mu.Unlock()
	sort.Float64s(got)
	row := LatencyRow{Server: name, RatePPS: rate, Payload: size, Sent: count, Received: len(got),
		P50Us: quantile(got, 0.50), P99Us: quantile(got, 0.99), P999Us: quantile(got, 0.999)}
	return row
}

// quantile of sorted values (nearest rank); NaN when empty.
func quantile(sorted []float64, q float64) float64 {
	if len(sorted) == 0 {
		return math.NaN()
	}
	i := int(math.Ceil(q*float64(len(sorted)))) - 1
	return sorted[max(0, min(i, len(sorted)-1))]
}

// ---- CPU accounting ----

// clockTick is USER_HZ, the unit of /proc/stat and /proc/PID/stat (100 on Linux/amd64).
const clockTick = 100

type cpuSnap struct {
	proc       uint64 // utime+stime ticks of the measured processes
	soft, busy uint64 // ticks of all CPUs
}

func takeCPU(pids ...int) (cpuSnap, error) {
	var c cpuSnap
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return c, err
	}
	line, _, _ := bytes.Cut(b, []byte("\n"))
	fields := bytes.Fields(line) // cpu user nice system idle iowait irq softirq steal guest guest_nice
	if len(fields) < 9 || string(fields[0]) != "cpu" {
		return c, fmt.Errorf("/proc/stat: unexpected first line %q", line)
	}
	v := make([]uint64, len(fields))
	for i := 1; i < len(fields); i++ {
		if _, err := fmt.Sscan(string(fields[i]), &v[i]); err != nil {
			return c, fmt.Errorf("/proc/stat: field %d of %q: %w", i, line, err)
		}
	}
	c.soft = v[7]
	c.busy = v[1] + v[2] + v[3] + v[6] + v[7] + v[8]
	for _, pid := range pids {
		t, err := procTicks(pid)
		if err != nil {
			return c, err
		}
		c.proc += t
	}
	return c, nil
}

// procTicks is utime+stime of every thread of a process.
func procTicks(pid int) (uint64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, errors.New("bad /proc/PID/stat")
	}
	f := bytes.Fields(b[i+1:]) // from field 3 (state) on: utime is field 14, stime 15
	var u, s uint64
	if len(f) < 13 {
		return 0, errors.New("bad /proc/PID/stat")
	}
	if _, err := fmt.Sscan(string(f[11]), &u); err != nil {
		return 0, fmt.Errorf("/proc/%d/stat utime: %w", pid, err)
	}
	if _, err := fmt.Sscan(string(f[12]), &s); err != nil {
		return 0, fmt.Errorf("/proc/%d/stat stime: %w", pid, err)
	}
	return u + s, nil
}

// usPer converts a tick delta to microseconds per packet.
func usPer(ticks uint64, packets float64) float64 {
	if packets <= 0 {
		return math.NaN()
	}
	return float64(ticks) * 1e6 / clockTick / packets
}

// ---- sockets for the synthetic allocations of the scaling stage ----

// rawSocket opens a blocking UDP socket bound to ip:port (0: any port) in ns and
// returns it with its port; it is closed at cleanup.
func rawSocket(t *testing.T, ns *netns.NS, ip net.IP, port, rcvbuf int) (int, int) {
	t.Helper()
	var fd, got int
	err := ns.Do(func() error {
		var err error
		if fd, err = unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0); err != nil {
			return err
		}
		if rcvbuf > 0 {
			_ = unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_RCVBUF, rcvbuf)
		}
		sa := &unix.SockaddrInet4{Port: port}
		copy(sa.Addr[:], ip.To4())
		if err := unix.Bind(fd, sa); err != nil {
			unix.Close(fd)
			return err
		}
		name, err := unix.Getsockname(fd)
		if err != nil {
			unix.Close(fd)
			return err
		}
		got = name.(*unix.SockaddrInet4).Port
		return nil
	})
	if err != nil {
		t.Fatalf("netns %s: socket %v:%d: %v", ns.Name, ip, port, err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	return fd, got
}
