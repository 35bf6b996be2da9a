package e2e

import (
	"encoding/binary"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pion/turn/v4"
	"golang.org/x/sys/unix"

	"github.com/l7mp/stunnerd-xdp/internal/config"
	"github.com/l7mp/stunnerd-xdp/test/netns"
	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// This file is the harness of the contract tests (contract_test.go): the
// stunnerd-xdp binary on a STUNner config, a client socket shared by several
// pion/turn clients that checks where the server's replies come from, and
// peers that count what reaches them.

// modes are the runs of every contract test: the kernel path (native),
// pion/turn alone (off: --xdp-mode=off --channeldata-shortcut=false), whose
// behaviour is the expectation, and the userspace path as it ships
// (shortcut: --xdp-mode=off, ChannelData relayed by the read loop on pion's
// channels).
var modes = []string{"native", "off", "shortcut"}

// eachMode runs body once per mode.
func eachMode(t *testing.T, body func(t *testing.T, mode string)) {
	netns.RequirePrivileged(t, "iptables", "conntrack", "ethtool")
	for _, mode := range modes {
		t.Run(mode, func(t *testing.T) { body(t, mode) })
	}
}

// nodeListener is one TURN-UDP listener on port 3478 of a node's STUNner
// config, routed to a cluster of its own: the peers it admits.
type nodeListener struct {
	addr  string
	peers []string // CIDRs
}

// nodeConfig renders a STUNner dataplane config with static credentials and
// one listener and cluster per nodeListener.
func nodeConfig(listeners []nodeListener) string {
	var ls, cs strings.Builder
	for i, l := range listeners {
		fmt.Fprintf(&ls, "  - {name: udp-%d, protocol: TURN-UDP, address: %s, port: 3478, routes: [peers-%d]}\n", i, l.addr, i)
		fmt.Fprintf(&cs, "  - {name: peers-%d, type: STATIC, endpoints: [%s]}\n", i, strings.Join(l.peers, ", "))
	}
	return fmt.Sprintf(`version: v1
admin:
  name: contract
  loglevel: all:INFO
  metrics_endpoint: "http://10.100.0.1:8080/metrics"
  healthcheck_endpoint: "http://10.100.0.1:8086"
auth:
  type: static
  realm: %s
  credentials: {username: %s, password: %s}
listeners:
%sclusters:
%s`, config.DefaultRealm, user, password, ls.String(), cs.String())
}

// startNode runs the stunnerd-xdp binary in the rig's server namespace on a
// STUNner config with the listeners, relaying from 10.200.0.1 in the XDP mode;
// args add flags. The daemon's log is shown when the test fails.
func startNode(t *testing.T, r *netns.Rig, mode string, listeners []nodeListener, args ...string) *netns.Proc {
	t.Helper()
	cfg := filepath.Join(t.TempDir(), "stunnerd.conf")
	writeConfig(t, cfg, nodeConfig(listeners))
	switch mode {
	case "off":
		args = append([]string{"--xdp-mode=off", "--channeldata-shortcut=false"}, args...)
	case "shortcut":
		args = append([]string{"--xdp-mode=off"}, args...)
	default:
		args = append([]string{"--xdp-mode=" + mode}, args...)
	}
	args = append([]string{"--log-format=json", "--relay-address=10.200.0.1",
		"--steering-dir=" + testenv.BPFFS(t), "-c", cfg}, args...)
	return runBinary(t, r, nil, args...)
}

// samples are the daemon's metrics, keyed as the exposition names them:
// name{label="value",...}.
type samples map[string]float64

// scrape reads every sample of the daemon's /metrics inside the namespace.
func scrape(t *testing.T, ns *netns.NS) samples {
	t.Helper()
	return scrapeAt(t, ns, "10.100.0.1")
}

// scrapeAt reads every sample of the /metrics the daemon serves on addr:8080
// inside the namespace.
func scrapeAt(t *testing.T, ns *netns.NS, addr string) samples {
	t.Helper()
	m, err := ns.Scrape("http://" + addr + ":8080/metrics")
	if err != nil {
		t.Fatal(err)
	}
	return m.Samples()
}

// get fails the test when the daemon does not export the sample.
func (s samples) get(t *testing.T, name string) float64 {
	t.Helper()
	v, ok := s[name]
	if !ok {
		t.Fatalf("no metric %s", name)
	}
	return v
}

// grew is how much the sample grew from before to s; both must have it.
func (s samples) grew(t *testing.T, before samples, name string) float64 {
	t.Helper()
	return s.get(t, name) - before.get(t, name)
}

// relayed is the packets_total sample of one path and direction.
func relayed(path, direction string) string {
	return fmt.Sprintf(`stunnerd_xdp_packets_total{direction=%q,path=%q}`, direction, path)
}

// verdict is the verdicts_total sample of one reason.
func verdict(reason string) string {
	return fmt.Sprintf(`stunnerd_xdp_verdicts_total{reason=%q}`, reason)
}

// kernelShare is the part of one direction's relayed packets the XDP program
// relayed between two scrapes.
func kernelShare(t *testing.T, before, after samples, direction string) float64 {
	t.Helper()
	xdp := after.grew(t, before, relayed("xdp", direction))
	user := after.grew(t, before, relayed("userspace", direction))
	if xdp+user == 0 {
		return 0
	}
	return xdp / (xdp + user)
}

// wantKernelShare fails unless the kernel relayed at least 90 % of the packets
// of both directions between the two samples.
func wantKernelShare(t *testing.T, before, after samples, what string) {
	t.Helper()
	for _, dir := range []string{"client_to_peer", "peer_to_client"} {
		if sh := kernelShare(t, before, after, dir); sh < 0.9 {
			t.Errorf("%s %s packets: the kernel relayed %.0f%%, want at least 90%%", what, dir, 100*sh)
		}
	}
}

// setTTL sets IP_TTL on a UDP socket: the TTL of what it sends.
func setTTL(c *net.UDPConn, ttl int) error {
	raw, err := c.SyscallConn()
	if err != nil {
		return err
	}
	var serr error
	if err := raw.Control(func(fd uintptr) { serr = unix.SetsockoptInt(int(fd), unix.IPPROTO_IP, unix.IP_TTL, ttl) }); err != nil {
		return err
	}
	return serr
}

// listenUDP opens a UDP socket on addr inside the namespace, with IP_TTL ttl
// unless ttl is 0; it is closed when the test ends.
func listenUDP(t *testing.T, ns *netns.NS, addr string, ttl int) *net.UDPConn {
	t.Helper()
	var c *net.UDPConn
	err := ns.Do(func() error {
		pc, err := net.ListenPacket("udp4", addr)
		if err != nil {
			return err
		}
		c = pc.(*net.UDPConn)
		if ttl != 0 {
			return setTTL(c, ttl)
		}
		return nil
	})
	if err != nil {
		t.Fatalf("netns %s: UDP socket on %s: %v", ns.Name, addr, err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// clientSocket is one client UDP socket (10.100.0.2, an ephemeral port) that
// pion/turn clients share, one per TURN server address, as libwebrtc shares
// one socket across its TURN servers. A reader hands every datagram to the
// client of the server it came from; a datagram from any other source reaches
// no client and is counted as stray: a TURN server's replies must come from
// the address the client sends to.
type clientSocket struct {
	conn *net.UDPConn

	mu      sync.Mutex
	servers map[netip.AddrPort]*serverConn
	stray   map[netip.AddrPort]int
	dropped int // datagrams for a client that did not keep up
}

// newClientSocket opens the client's socket with IP_TTL ttl (0: the default).
func newClientSocket(t *testing.T, ns *netns.NS, ttl int) *clientSocket {
	t.Helper()
	s := &clientSocket{
		conn:    listenUDP(t, ns, "10.100.0.2:0", ttl),
		servers: map[netip.AddrPort]*serverConn{},
		stray:   map[netip.AddrPort]int{},
	}
	done := make(chan struct{})
	go s.read(done)
	t.Cleanup(func() {
		s.conn.Close()
		<-done
		if s.dropped > 0 {
			t.Logf("client socket: %d datagrams dropped for slow pion/turn clients", s.dropped)
		}
	})
	return s
}

func (s *clientSocket) read(done chan struct{}) {
	defer close(done)
	buf := make([]byte, 65536)
	for {
		n, from, err := s.conn.ReadFromUDPAddrPort(buf)
		if err != nil {
			return
		}
		from = netip.AddrPortFrom(from.Addr().Unmap(), from.Port())
		s.mu.Lock()
		c, ok := s.servers[from]
		if !ok {
			s.stray[from]++
			s.mu.Unlock()
			continue
		}
		select {
		case c.in <- append([]byte(nil), buf[:n]...):
		default:
			s.dropped++
		}
		s.mu.Unlock()
	}
}

// allocate makes an allocation on the TURN server at server with a pion/turn
// client that uses this socket (see testenv.Allocate).
func (s *clientSocket) allocate(t *testing.T, server netip.AddrPort) (net.PacketConn, error) {
	t.Helper()
	c := &serverConn{s: s, server: server, in: make(chan []byte, 4096), done: make(chan struct{})}
	s.mu.Lock()
	s.servers[server] = c
	s.mu.Unlock()
	return testenv.Allocate(t, &turn.ClientConfig{
		TURNServerAddr: server.String(), STUNServerAddr: server.String(),
		Username: user, Password: password, Realm: config.DefaultRealm, Conn: c,
	})
}

// strays returns the datagrams that came from no server a client talks to, by source.
func (s *clientSocket) strays() map[netip.AddrPort]int {
	s.mu.Lock()
	defer s.mu.Unlock()
	m := make(map[netip.AddrPort]int, len(s.stray))
	for k, v := range s.stray {
		m[k] = v
	}
	return m
}

// serverConn is one pion/turn client's view of a clientSocket: what came from
// its server. Writes go straight to the shared socket.
type serverConn struct {
	s      *clientSocket
	server netip.AddrPort
	in     chan []byte
	done   chan struct{}
	once   sync.Once

	mu       sync.Mutex
	deadline time.Time
}

func (c *serverConn) ReadFrom(b []byte) (int, net.Addr, error) {
	c.mu.Lock()
	deadline := c.deadline
	c.mu.Unlock()
	var expired <-chan time.Time
	if !deadline.IsZero() {
		timer := time.NewTimer(time.Until(deadline))
		defer timer.Stop()
		expired = timer.C
	}
	select {
	case p := <-c.in:
		return copy(b, p), net.UDPAddrFromAddrPort(c.server), nil
	case <-c.done:
		return 0, nil, net.ErrClosed
	case <-expired:
		return 0, nil, os.ErrDeadlineExceeded
	}
}

func (c *serverConn) WriteTo(b []byte, addr net.Addr) (int, error) { return c.s.conn.WriteTo(b, addr) }

func (c *serverConn) Close() error {
	c.once.Do(func() { close(c.done) })
	return nil
}

func (c *serverConn) LocalAddr() net.Addr { return c.s.conn.LocalAddr() }

func (c *serverConn) SetDeadline(t time.Time) error {
	if err := c.SetReadDeadline(t); err != nil {
		return err
	}
	return c.SetWriteDeadline(t)
}

func (c *serverConn) SetReadDeadline(t time.Time) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.deadline = t
	return nil
}

// SetWriteDeadline sets it on the shared socket: writes never wait on the
// other clients.
func (c *serverConn) SetWriteDeadline(t time.Time) error { return c.s.conn.SetWriteDeadline(t) }

// udpPeer is a peer socket: it counts the datagrams it receives, by the 8-byte
// tag a taggedSession starts each with, and echoes them when told to.
type udpPeer struct {
	conn *net.UDPConn

	mu    sync.Mutex
	total int
	tags  map[uint64]int
}

// startPeer opens a peer on addr in the namespace with IP_TTL ttl (0: the
// default); echo sends every datagram back to where it came from.
func startPeer(t *testing.T, ns *netns.NS, addr string, echo bool, ttl int) *udpPeer {
	t.Helper()
	p := &udpPeer{conn: listenUDP(t, ns, addr, ttl), tags: map[uint64]int{}}
	testenv.ReadBuffer(t, p.conn, 4<<20)
	go func() {
		buf := make([]byte, 65536)
		for {
			n, from, err := p.conn.ReadFromUDPAddrPort(buf)
			if err != nil {
				return
			}
			p.mu.Lock()
			p.total++
			if n >= 8 {
				p.tags[binary.BigEndian.Uint64(buf)]++
			}
			p.mu.Unlock()
			if echo {
				_, _ = p.conn.WriteToUDPAddrPort(buf[:n], from)
			}
		}
	}()
	return p
}

// send sends n datagrams with the tag and a sequence number to addr, a
// millisecond apart.
func (p *udpPeer) send(t *testing.T, to net.Addr, tag uint64, n int) {
	t.Helper()
	msg := make([]byte, 16)
	binary.BigEndian.PutUint64(msg, tag)
	for i := 0; i < n; i++ {
		binary.BigEndian.PutUint64(msg[8:], uint64(i))
		if _, err := p.conn.WriteTo(msg, to); err != nil {
			t.Fatalf("peer %v: %v", p.conn.LocalAddr(), err)
		}
		time.Sleep(time.Millisecond)
	}
}

// drainRelay reads from a relay until nothing arrives for idle (scaled:
// testenv.Timeout) and returns how
// many of the datagrams carried the tag.
func drainRelay(relay net.PacketConn, tag uint64, idle time.Duration) int {
	n := 0
	buf := make([]byte, 1500)
	for {
		_ = relay.SetReadDeadline(time.Now().Add(testenv.Timeout(idle)))
		got, _, err := relay.ReadFrom(buf)
		if err != nil {
			return n
		}
		if got >= 8 && binary.BigEndian.Uint64(buf) == tag {
			n++
		}
	}
}

// got is how many datagrams with the tag arrived; received how many in all.
func (p *udpPeer) got(tag uint64) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.tags[tag]
}

func (p *udpPeer) received() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.total
}

// checkSession fails the test unless at least 99 % of what the session sent came
// back, all of it its own.
func checkSession(t *testing.T, what string, s *taggedSession) {
	t.Helper()
	sent, got, foreign := s.sent.Load(), s.received.Load(), s.foreign.Load()
	t.Logf("%s: %d sent, %d echoed, %d foreign", what, sent, got, foreign)
	if sent == 0 || float64(got) < 0.99*float64(sent) {
		t.Errorf("%s: %d of %d echoes came back, want at least 99%%", what, got, sent)
	}
	if foreign != 0 {
		t.Errorf("%s: %d datagrams that were not its own echoes", what, foreign)
	}
}
