package userspace

import (
	"bytes"
	"errors"
	"net"
	"testing"

	"github.com/pion/turn/v4"
)

// recordingConn is a relay socket that records what is written to it.
type recordingConn struct {
	net.PacketConn // nil: only WriteTo and Close are used
	addr           *net.UDPAddr
	writes         []write
	err            error
	closed         bool
}

type write struct {
	p    []byte
	addr net.Addr
}

func (c *recordingConn) WriteTo(p []byte, addr net.Addr) (int, error) {
	if c.err != nil {
		return 0, c.err
	}
	c.writes = append(c.writes, write{append([]byte(nil), p...), addr})
	return len(p), nil
}

func (c *recordingConn) Close() error { c.closed = true; return nil }

// fakeGenerator hands out the recordingConns it is given, in order.
type fakeGenerator struct {
	turn.RelayAddressGenerator
	conns []*recordingConn
}

func (g *fakeGenerator) AllocatePacketConn(string, int) (net.PacketConn, net.Addr, error) {
	c := g.conns[0]
	g.conns = g.conns[1:]
	return c, c.addr, nil
}

var (
	client   = &net.UDPAddr{IP: net.IPv4(10, 0, 0, 1).To4(), Port: 40000}
	listener = &net.UDPAddr{IP: net.IPv4(10, 0, 0, 9), Port: 3478}
	peer     = &net.UDPAddr{IP: net.IPv4(10, 0, 1, 1), Port: 5000}
)

// allocate makes a relay socket through the table's generator and reports
// the allocation to the hooks, as pion does.
func allocate(t *testing.T, h turn.EventHandler, gen turn.RelayAddressGenerator, src net.Addr) net.PacketConn {
	t.Helper()
	c, a, err := gen.AllocatePacketConn("udp4", 0)
	if err != nil {
		t.Fatal(err)
	}
	h.OnAllocationCreated(src, listener, "UDP", "u", "r", a, 0)
	return c
}

func chanData(ch uint16, length int, data []byte) []byte {
	return append([]byte{byte(ch >> 8), byte(ch), byte(length >> 8), byte(length)}, data...)
}

func TestChannelsRelay(t *testing.T) {
	r1 := &recordingConn{addr: &net.UDPAddr{IP: net.IPv4(10, 0, 0, 9), Port: 50000}}
	r2 := &recordingConn{addr: &net.UDPAddr{IP: net.IPv4(10, 0, 0, 9), Port: 50001}}
	sockets := NewRelaySockets()
	gen := sockets.Generator(&fakeGenerator{conns: []*recordingConn{r1, r2}})
	var inner []string // the hooks h wraps run too, first
	counters := &Counters{}
	tbl := NewChannels(sockets, counters)
	h := tbl.EventHandler(turn.EventHandler{
		OnChannelCreated: func(_, _ net.Addr, _, _, _ string, _, _ net.Addr, _ uint16) { inner = append(inner, "created") },
	})
	relay1 := allocate(t, h, gen, client)
	h.OnChannelCreated(client, listener, "UDP", "u", "r", r1.addr, peer, 0x4000)
	if len(inner) != 1 || tbl.Len() != 1 {
		t.Fatalf("inner hooks %v, %d channels; want the inner hook run and 1 channel", inner, tbl.Len())
	}

	// pion keys a client by its IP's 16-byte form: a 16-byte source is the
	// same client.
	wide := &net.UDPAddr{IP: client.IP.To16(), Port: client.Port}
	for _, c := range []struct {
		name string
		p    []byte
		src  net.Addr
		want []byte // nil: left to pion
	}{
		{"bound channel", chanData(0x4000, 3, []byte{1, 2, 3}), client, []byte{1, 2, 3}},
		{"16-byte source", chanData(0x4000, 1, []byte{7}), wide, []byte{7}},
		{"padding is not data", chanData(0x4000, 3, []byte{1, 2, 3, 0}), client, []byte{1, 2, 3}},
		{"empty", chanData(0x4000, 0, nil), client, []byte{}},
		{"length past the end", chanData(0x4000, 4, []byte{1, 2, 3}), client, nil},
		{"unbound channel", chanData(0x4001, 1, []byte{1}), client, nil},
		{"other client", chanData(0x4000, 1, []byte{1}), &net.UDPAddr{IP: client.IP, Port: 40001}, nil},
		{"STUN", append([]byte{0x00, 0x01, 0x00, 0x00, 0x21, 0x12, 0xa4, 0x42}, make([]byte, 12)...), client, nil},
		{"short", []byte{0x40, 0x00, 0x00}, client, nil},
		{"not UDP", chanData(0x4000, 1, []byte{1}), &net.TCPAddr{IP: client.IP, Port: client.Port}, nil},
	} {
		t.Run(c.name, func(t *testing.T) {
			r1.writes = nil
			ok := tbl.relay(c.p, c.src)
			if ok != (c.want != nil) {
				t.Fatalf("relayed %v, want %v", ok, c.want != nil)
			}
			if c.want == nil {
				if len(r1.writes) != 0 {
					t.Fatalf("wrote %v for a datagram left to pion", r1.writes)
				}
				return
			}
			if len(r1.writes) != 1 || !bytes.Equal(r1.writes[0].p, c.want) || r1.writes[0].addr != peer {
				t.Fatalf("writes %v, want %v to %v", r1.writes, c.want, peer)
			}
		})
	}

	if n := counters.ShortcutPackets.Load(); n != 4 {
		t.Errorf("counted %d relayed datagrams, want 4", n)
	}

	// A failed write (a socket pion is closing, a refused peer port) leaves
	// the datagram to pion.
	r1.err = errors.New("closed")
	if tbl.relay(chanData(0x4000, 1, []byte{1}), client) || counters.ShortcutPackets.Load() != 4 {
		t.Error("a failed write counts as relayed")
	}
	r1.err = nil

	h.OnChannelDeleted(client, listener, "UDP", "u", "r", r1.addr, peer, 0x4000)
	if tbl.relay(chanData(0x4000, 1, []byte{1}), client) || tbl.Len() != 0 {
		t.Error("relayed on a deleted channel")
	}
	h.OnChannelCreated(client, listener, "UDP", "u", "r", r1.addr, peer, 0x4000)
	h.OnChannelCreated(client, listener, "UDP", "u", "r", r1.addr, peer, 0x4001)
	h.OnAllocationDeleted(client, listener, "UDP", "u", "r")
	if tbl.relay(chanData(0x4000, 1, []byte{1}), client) || tbl.relay(chanData(0x4001, 1, []byte{1}), client) || tbl.Len() != 0 {
		t.Error("relayed on a deleted allocation's channels")
	}

	// The relay socket leaves the set when pion closes it: an allocation
	// reported after that has no socket here, and its channels stay pion's.
	if err := relay1.Close(); err != nil || !r1.closed {
		t.Fatalf("close: %v, closed %v", err, r1.closed)
	}
	if c, _ := sockets.get(r1.addr); c != nil {
		t.Error("a closed relay socket is still in the set")
	}
	h.OnAllocationCreated(client, listener, "UDP", "u", "r", r1.addr, 0)
	h.OnChannelCreated(client, listener, "UDP", "u", "r", r1.addr, peer, 0x4000)
	if tbl.relay(chanData(0x4000, 1, []byte{1}), client) {
		t.Error("relayed through a closed relay socket")
	}

	// A new allocation of the same client starts without the old channels.
	allocate(t, h, gen, client)
	if tbl.Len() != 0 {
		t.Errorf("%d channels after a new allocation, want 0", tbl.Len())
	}
	h.OnChannelCreated(client, listener, "UDP", "u", "r", r2.addr, peer, 0x4002)
	if !tbl.relay(chanData(0x4002, 1, []byte{9}), client) || len(r2.writes) != 1 {
		t.Errorf("the new allocation's channel: writes %v", r2.writes)
	}
}

// fakeListener hands out its datagrams, one per ReadFrom.
type fakeListener struct {
	net.PacketConn
	in [][]byte
}

func (l *fakeListener) ReadFrom(p []byte) (int, net.Addr, error) {
	if len(l.in) == 0 {
		return 0, nil, net.ErrClosed
	}
	n := copy(p, l.in[0])
	l.in = l.in[1:]
	return n, client, nil
}

// TestListenerConnShortcut: ListenerConn hands pion only what the table does
// not relay, and a datagram that fills pion's buffer (which pion drops as
// possibly truncated) is pion's.
func TestListenerConnShortcut(t *testing.T) {
	r := &recordingConn{addr: &net.UDPAddr{IP: net.IPv4(10, 0, 0, 9), Port: 50000}}
	sockets := NewRelaySockets()
	tbl := NewChannels(sockets, &Counters{})
	h := tbl.EventHandler(turn.EventHandler{})
	allocate(t, h, sockets.Generator(&fakeGenerator{conns: []*recordingConn{r}}), client)
	h.OnChannelCreated(client, listener, "UDP", "u", "r", r.addr, peer, 0x4000)

	full := chanData(0x4000, 12, make([]byte, 12))
	unbound := chanData(0x4001, 1, []byte{2})
	l := &fakeListener{in: [][]byte{chanData(0x4000, 1, []byte{1}), unbound, full, chanData(0x4000, 1, []byte{3})}}
	c := &ListenerConn{PacketConn: l, Counters: &Counters{}, Channels: tbl}
	buf := make([]byte, len(full))
	var got [][]byte
	for {
		n, _, err := c.ReadFrom(buf)
		if err != nil {
			break
		}
		got = append(got, append([]byte(nil), buf[:n]...))
	}
	if len(got) != 2 || !bytes.Equal(got[0], unbound) || !bytes.Equal(got[1], full) {
		t.Errorf("pion read %x, want the unbound channel's and the buffer-filling datagram", got)
	}
	if len(r.writes) != 2 || !bytes.Equal(r.writes[0].p, []byte{1}) || !bytes.Equal(r.writes[1].p, []byte{3}) {
		t.Errorf("relayed %v, want [1] and [3]", r.writes)
	}
}
