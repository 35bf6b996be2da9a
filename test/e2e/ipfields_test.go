package e2e

import (
	"encoding/binary"
	"fmt"
	"net"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pion/transport/v4/stdnet"
	"github.com/pion/turn/v4"
	"golang.org/x/sys/unix"

	"github.com/l7mp/stunnerd-xdp/internal/config"
	"github.com/l7mp/stunnerd-xdp/test/netns"
	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// ipFields are the IP header fields a datagram arrived with: TTL and the TOS
// byte (DSCP and ECN).
type ipFields struct {
	ttl, tos int
}

func (f ipFields) String() string { return fmt.Sprintf("ttl %d tos %#02x", f.ttl, f.tos) }

// fieldSet counts the fields datagrams arrived with, by kind.
type fieldSet struct {
	mu sync.Mutex
	m  map[string]map[ipFields]int
}

func (s *fieldSet) add(kind string, f ipFields) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.m == nil {
		s.m = map[string]map[ipFields]int{}
	}
	if s.m[kind] == nil {
		s.m[kind] = map[ipFields]int{}
	}
	s.m[kind][f]++
}

func (s *fieldSet) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	var parts []string
	for kind, m := range s.m {
		for f, n := range m {
			parts = append(parts, fmt.Sprintf("%s: %d with %v", kind, n, f))
		}
	}
	sort.Strings(parts)
	return strings.Join(parts, "; ")
}

// check fails the test unless every datagram of every kind arrived with want,
// and at least min of kind came.
func (s *fieldSet) check(t *testing.T, what string, want ipFields, kind string, min int) {
	t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	for k, m := range s.m {
		for f, n := range m {
			if f != want {
				t.Errorf("%s: %d %s datagrams arrived with %v, want %v", what, n, k, f, want)
			}
		}
	}
	if n := s.m[kind][want]; n < min {
		t.Errorf("%s: %d %s datagrams arrived with %v, want at least %d", what, n, kind, want, min)
	}
}

// fieldsSocket opens a UDP socket on addr in the namespace that sends with
// ttl and tos and reports the fields of what it receives (an IPv6 addr: hop
// limit and traffic class).
func fieldsSocket(t *testing.T, ns *netns.NS, addr string, ttl, tos int) *net.UDPConn {
	t.Helper()
	v6 := strings.HasPrefix(addr, "[")
	var c *net.UDPConn
	if v6 {
		if err := ns.Do(func() error {
			pc, err := net.ListenPacket("udp6", addr)
			if err == nil {
				c = pc.(*net.UDPConn)
			}
			return err
		}); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
	} else {
		c = listenUDP(t, ns, addr, ttl)
	}
	rc, err := c.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	level, opts := unix.IPPROTO_IP, [][2]int{{unix.IP_TOS, tos}, {unix.IP_RECVTTL, 1}, {unix.IP_RECVTOS, 1}}
	if v6 {
		level, opts = unix.IPPROTO_IPV6, [][2]int{{unix.IPV6_UNICAST_HOPS, ttl}, {unix.IPV6_TCLASS, tos},
			{unix.IPV6_RECVHOPLIMIT, 1}, {unix.IPV6_RECVTCLASS, 1}}
	}
	var serr error
	if err := rc.Control(func(fd uintptr) {
		for _, o := range opts {
			if serr = unix.SetsockoptInt(int(fd), level, o[0], o[1]); serr != nil {
				return
			}
		}
	}); err != nil {
		t.Fatal(err)
	}
	if serr != nil {
		t.Fatal(serr)
	}
	return c
}

// readFields reads one datagram with its fields.
func readFields(c *net.UDPConn, p []byte) (int, *net.UDPAddr, ipFields, error) {
	oob := make([]byte, 128)
	n, oobn, _, from, err := c.ReadMsgUDP(p, oob)
	if err != nil {
		return 0, nil, ipFields{}, err
	}
	f := ipFields{ttl: -1, tos: -1}
	msgs, _ := unix.ParseSocketControlMessage(oob[:oobn])
	for _, m := range msgs {
		switch {
		case m.Header.Level == unix.IPPROTO_IP && m.Header.Type == unix.IP_TTL && len(m.Data) >= 4:
			f.ttl = int(binary.NativeEndian.Uint32(m.Data))
		case m.Header.Level == unix.IPPROTO_IP && m.Header.Type == unix.IP_TOS && len(m.Data) >= 1:
			f.tos = int(m.Data[0])
		case m.Header.Level == unix.IPPROTO_IPV6 && m.Header.Type == unix.IPV6_HOPLIMIT && len(m.Data) >= 4:
			f.ttl = int(binary.NativeEndian.Uint32(m.Data))
		case m.Header.Level == unix.IPPROTO_IPV6 && m.Header.Type == unix.IPV6_TCLASS && len(m.Data) >= 4:
			f.tos = int(binary.NativeEndian.Uint32(m.Data))
		}
	}
	return n, from, f, nil
}

// fieldsClientConn is a pion/turn client's socket that records the fields
// of the relayed data the server sends it (ChannelData, Data indications).
type fieldsClientConn struct {
	*net.UDPConn
	got fieldSet
}

func (c *fieldsClientConn) ReadFrom(p []byte) (int, net.Addr, error) {
	n, from, f, err := readFields(c.UDPConn, p)
	if err != nil {
		return n, nil, err
	}
	switch {
	case n >= 4 && p[0]&0xC0 == 0x40:
		c.got.add("ChannelData", f)
	case n >= 20 && binary.BigEndian.Uint16(p) == 0x0017:
		c.got.add("Data indication", f)
	}
	return n, from, nil
}

// TestContractIPFields: RFC 8656 section 14's preferred behaviour on both
// paths. The client sends with TTL 37 and TOS 0xB9 (DSCP EF, ECT(1)), the peer
// echoes with TTL 23 and TOS 0x2A (DSCP AF11, ECT(0)); whatever carries a
// datagram (pion's Send and Data indications, the read loop's ChannelData
// shortcut, pion's ChannelData, the XDP program), it arrives with the TTL one
// less than it was sent with (the relay is one hop) and the TOS byte as it was
// sent. The first datagrams travel as indications (before the client's
// ChannelBind), the rest as ChannelData: in native mode on the kernel path.
func TestContractIPFields(t *testing.T) {
	eachMode(t, func(t *testing.T, mode string) {
		r := netns.NewRouted(t)
		startNode(t, r, mode, defaultListener)
		ipFieldsSession(t, r, mode, "10.100.0.2:0", listenAddr.String())
	})
}

// TestContractIPFieldsIPv6Client: the same with an IPv6 client (hop limit 37,
// traffic class 0xB9) and the IPv4 peer: the hop limit less one becomes the
// TTL, the traffic class the TOS byte, and back.
func TestContractIPFieldsIPv6Client(t *testing.T) {
	eachMode(t, func(t *testing.T, mode string) {
		r := netns.New(t, netns.WithIPv6())
		startNode(t, r, mode, append(defaultListener, nodeListener{addr: "fd00:100::1", peers: []string{"10.200.0.0/24"}}))
		ipFieldsSession(t, r, mode, "[fd00:100::2]:0", "[fd00:100::1]:3478")
	})
}

// ipFieldsSession runs the session of TestContractIPFields from a client
// socket on client to the listener at server.
func ipFieldsSession(t *testing.T, r *netns.Rig, mode, client, server string) {
	t.Helper()
	const (
		clientTTL, clientTOS = 37, 0xB9
		peerTTL, peerTOS     = 23, 0x2A
	)
	// The peer echoes every datagram and records its fields.
	peer := fieldsSocket(t, r.Peer, peerAddr+":5004", peerTTL, peerTOS)
	var atPeer fieldSet
	go func() {
		buf := make([]byte, 65536)
		for {
			n, from, f, err := readFields(peer, buf)
			if err != nil {
				return
			}
			atPeer.add("datagram", f)
			_, _ = peer.WriteToUDP(buf[:n], from)
		}
	}()

	conn := &fieldsClientConn{UDPConn: fieldsSocket(t, r.Client, client, clientTTL, clientTOS)}
	sn, err := stdnet.NewNet()
	if err != nil {
		t.Fatal(err)
	}
	relay, err := testenv.Allocate(t, &turn.ClientConfig{
		TURNServerAddr: server, STUNServerAddr: server, Net: udp6Net{sn},
		Username: user, Password: password, Realm: config.DefaultRealm, Conn: conn,
	})
	if err != nil {
		t.Fatal(err)
	}
	before := scrape(t, r.Server)
	s := &taggedSession{peer: mustUDPAddr(peerAddr + ":5004")}
	s.run(t, relay, 0xF5, 300, time.Second)
	after := scrape(t, r.Server)
	checkSession(t, "echoes", s)
	t.Logf("%s: at the peer: %v", mode, &atPeer)
	t.Logf("%s: at the client: %v", mode, &conn.got)
	atPeer.check(t, "client->peer", ipFields{clientTTL - 1, clientTOS}, "datagram", int(s.sent.Load())*99/100)
	conn.got.check(t, "peer->client", ipFields{peerTTL - 1, peerTOS}, "ChannelData", int(s.received.Load())*9/10)
	if mode == "native" {
		wantKernelShare(t, before, after, "the")
	}
}
