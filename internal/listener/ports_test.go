package listener

import (
	"errors"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"sync/atomic"
	"testing"

	"github.com/pion/turn/v4"

	"github.com/l7mp/stunnerd-xdp/internal/config"
	"github.com/l7mp/stunnerd-xdp/internal/peerpolicy"
)

func endpoint(t *testing.T, s string) config.Endpoint {
	t.Helper()
	e, err := config.ParseEndpoint(s)
	if err != nil {
		t.Fatal(err)
	}
	return e
}

func TestPeerPortsAllowed(t *testing.T) {
	pp := peerPorts{endpoint(t, "10.0.0.0/24:<5000-5000>"), endpoint(t, "10.0.0.7:<6000-6001>"), endpoint(t, "10.0.1.0/24")}
	for peer, want := range map[string]bool{
		"10.0.0.1:5000": true, "10.0.0.1:5001": false, // the /24's one port
		"10.0.0.7:5000": true, "10.0.0.7:6001": true, "10.0.0.7:7000": false, // either endpoint covering it
		"10.0.1.9:1":             true, // no port range: every port
		"192.0.2.1:9":            true, // no endpoint covers it: the peer policy decides
		"[::ffff:10.0.0.1]:5001": false,
	} {
		if got := pp.allowed(netip.MustParseAddrPort(peer)); got != want {
			t.Errorf("%s: %v, want %v", peer, got, want)
		}
	}
	if !(peerPorts{}).allowed(netip.MustParseAddrPort("10.0.0.1:1")) {
		t.Error("no endpoints: refused")
	}
}

// recorder stands in for the mirror: it keeps the channels it holds.
type recorder map[channelKey]bool

func (r recorder) handler() turn.EventHandler {
	return turn.EventHandler{
		OnChannelCreated: func(src, dst net.Addr, _, _, _ string, relay, peer net.Addr, ch uint16) {
			r[newChannelKey(src, dst, relay, peer, ch)] = true
		},
		OnChannelDeleted: func(src, dst net.Addr, _, _, _ string, relay, peer net.Addr, ch uint16) {
			delete(r, newChannelKey(src, dst, relay, peer, ch))
		},
	}
}

// Channels to ports outside the ranges never reach the mirror (so never the
// kernel), and a reload that changes the ranges installs and withdraws them.
func TestPeerPortsGateTheMirror(t *testing.T) {
	d := &Set{}
	ps := &portState{}
	d.setPeerPorts(ps, []config.Endpoint{endpoint(t, "10.0.0.2:<5000-5000>")})
	mirror := recorder{}
	h := ps.withPeerPorts(mirror.handler())
	src := &net.UDPAddr{IP: net.IPv4(10, 1, 0, 2), Port: 40000}
	dst := &net.UDPAddr{IP: net.IPv4(10, 1, 0, 1), Port: 3478}
	relay := &net.UDPAddr{IP: net.IPv4(10, 1, 0, 1), Port: 50000}
	in := &net.UDPAddr{IP: net.IPv4(10, 0, 0, 2), Port: 5000}
	out := &net.UDPAddr{IP: net.IPv4(10, 0, 0, 2), Port: 5001}
	h.OnChannelCreated(src, dst, "UDP", "u", "r", relay, in, 0x4000)
	h.OnChannelCreated(src, dst, "UDP", "u", "r", relay, out, 0x4001)
	if len(mirror) != 1 || !mirror[newChannelKey(src, dst, relay, in, 0x4000)] {
		t.Fatalf("mirror holds %v, want the channel to port 5000 only", mirror)
	}
	// Widened: the refused channel is offered now.
	d.setPeerPorts(ps, []config.Endpoint{endpoint(t, "10.0.0.2:<5000-5001>")})
	if len(mirror) != 2 {
		t.Fatalf("after widening the mirror holds %v", mirror)
	}
	// Narrowed: withdrawn from the kernel path.
	d.setPeerPorts(ps, []config.Endpoint{endpoint(t, "10.0.0.2:<5001-5001>")})
	if len(mirror) != 1 || !mirror[newChannelKey(src, dst, relay, out, 0x4001)] {
		t.Fatalf("after narrowing the mirror holds %v", mirror)
	}
	// pion's deletions reach the mirror only for what it holds.
	h.OnChannelDeleted(src, dst, "UDP", "u", "r", relay, in, 0x4000)
	h.OnChannelDeleted(src, dst, "UDP", "u", "r", relay, out, 0x4001)
	if len(mirror) != 0 || len(ps.channels) != 0 {
		t.Fatalf("after the deletions: mirror %v, tracked %v", mirror, ps.channels)
	}
}

type fakeConn struct {
	net.PacketConn
	wrote []net.Addr
	reads []net.Addr
}

func (c *fakeConn) WriteTo(p []byte, a net.Addr) (int, error) {
	c.wrote = append(c.wrote, a)
	return len(p), nil
}
func (c *fakeConn) ReadFrom([]byte) (int, net.Addr, error) {
	if len(c.reads) == 0 {
		return 0, nil, net.ErrClosed
	}
	a := c.reads[0]
	c.reads = c.reads[1:]
	return 1, a, nil
}

// The relay socket drops what pion would send to or receive from a port
// outside the ranges, as STUNner's PortRangePacketConn.
func TestPortFilterConn(t *testing.T) {
	ps := &portState{}
	(&Set{}).setPeerPorts(ps, []config.Endpoint{endpoint(t, "10.0.0.2:<5000-5000>")})
	in := &net.UDPAddr{IP: net.IPv4(10, 0, 0, 2), Port: 5000}
	out := &net.UDPAddr{IP: net.IPv4(10, 0, 0, 2), Port: 5001}
	fc := &fakeConn{reads: []net.Addr{out, in}}
	c := &portFilterConn{PacketConn: fc, ps: ps}
	if _, err := c.WriteTo([]byte("x"), out); !errors.Is(err, ErrPeerPort) {
		t.Errorf("write to %v: %v", out, err)
	}
	if _, err := c.WriteTo([]byte("x"), in); err != nil || len(fc.wrote) != 1 {
		t.Errorf("write to %v: %v %v", in, err, fc.wrote)
	}
	if _, from, err := c.ReadFrom(make([]byte, 10)); err != nil || from != in {
		t.Errorf("read: %v %v, want the datagram from %v only", from, err, in)
	}
}

// The relay socket follows the policy in force: a peer admitted when the
// socket's verdict was cached is refused once a new policy is stored (both
// directions), and a removed user's socket stops relaying.
func TestPortFilterConnRevokes(t *testing.T) {
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	var pol atomic.Pointer[peerpolicy.Policy]
	pol.Store(peerpolicy.New([]netip.Prefix{netip.MustParsePrefix("10.0.0.0/24")}, nil, true, nil, quiet))
	users := map[string]bool{"alice": true}
	ps := &portState{policy: &pol, userOK: func(u string) bool { return users[u] }}
	(&Set{}).setPeerPorts(ps, nil)
	peer := &net.UDPAddr{IP: net.IPv4(10, 0, 0, 2), Port: 5000}
	fc := &fakeConn{}
	c := &portFilterConn{PacketConn: fc, ps: ps}
	if _, err := c.WriteTo([]byte("x"), peer); err != nil {
		t.Fatalf("write to an admitted peer: %v", err)
	}
	pol.Store(peerpolicy.New([]netip.Prefix{netip.MustParsePrefix("10.0.1.0/24")}, nil, true, nil, quiet))
	if _, err := c.WriteTo([]byte("x"), peer); !errors.Is(err, ErrPeerRefused) {
		t.Fatalf("write after the policy dropped the peer: %v, want ErrPeerRefused", err)
	}
	fc.reads = []net.Addr{peer}
	if _, from, err := c.ReadFrom(make([]byte, 10)); !errors.Is(err, net.ErrClosed) {
		t.Fatalf("read: %v from %v, want the refused peer's datagram dropped", err, from)
	}
	other := &net.UDPAddr{IP: net.IPv4(10, 0, 1, 9), Port: 5000}
	alice := "alice"
	c.user.Store(&alice)
	if _, err := c.WriteTo([]byte("x"), other); err != nil {
		t.Fatalf("alice's write to an admitted peer: %v", err)
	}
	delete(users, "alice")
	if _, err := c.WriteTo([]byte("x"), other); !errors.Is(err, ErrUserRemoved) {
		t.Fatalf("write after alice was removed: %v, want ErrUserRemoved", err)
	}
	if len(fc.wrote) != 2 {
		t.Fatalf("%d datagrams written, want 2", len(fc.wrote))
	}
}
