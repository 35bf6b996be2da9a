package userspace

import (
	"bytes"
	"fmt"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pion/stun/v3"
	"github.com/pion/turn/v4"

	"github.com/l7mp/stunnerd-xdp/internal/udpio"
)

// readAll is what the UDP socket c reads within wait, as strings.
func readAll(c *net.UDPConn, wait time.Duration) []string {
	var got []string
	buf := make([]byte, 2048)
	_ = c.SetReadDeadline(time.Now().Add(wait))
	for {
		n, _, err := c.ReadFrom(buf)
		if err != nil {
			return got
		}
		got = append(got, string(buf[:n]))
		_ = c.SetReadDeadline(time.Now().Add(100 * time.Millisecond))
	}
}

// wrapped is a listener socket (on 127.0.0.1) and a relay address generator
// with the userspace wrappers, as the daemon stacks them.
type wrapped struct {
	counters *Counters
	relays   *RelaySockets
	tbl      *Channels
	raw      *udpio.BatchConn
	gen      turn.RelayAddressGenerator
}

func newWrapped(t testing.TB) *wrapped {
	t.Helper()
	w := &wrapped{counters: &Counters{}, relays: NewRelaySockets()}
	w.tbl = NewChannels(w.relays, w.counters)
	var err error
	if w.raw, err = udpio.NewBatchConn(listenUDP(t)); err != nil {
		t.Fatal(err)
	}
	w.gen = w.relays.Generator(&RelayAddressGenerator{
		RelayAddressGeneratorPortRange: turn.RelayAddressGeneratorPortRange{
			RelayAddress: net.IPv4(127, 0, 0, 1), Address: "127.0.0.1", MinPort: 50000, MaxPort: 60000,
		},
		Counters: w.counters, Sockets: w.relays,
	})
	if err := w.gen.Validate(); err != nil {
		t.Fatal(err)
	}
	return w
}

// listenerConn is the listener socket as pion reads it, with wrap (nil:
// none) between ListenerConn and the innermost wrapper.
func (w *wrapped) listenerConn(shortcut bool, wrap func(net.PacketConn) net.PacketConn) *ListenerConn {
	var pc net.PacketConn = w.tbl.ListenerSocket(w.raw)
	if wrap != nil {
		pc = wrap(pc)
	}
	return &ListenerConn{PacketConn: pc, Counters: w.counters, Channels: w.tbl, NoShortcut: !shortcut}
}

// TestShortcutBatch drives a read loop's ListenerConn through one recvmmsg
// batch: the ChannelData it relays goes out in a batch (each peer gets its
// datagrams in order), a datagram for pion flushes the batch first, and a
// deferred write that fails goes to pion, with every later one of its relay
// socket, in order, before anything else; the counters count what was sent.
func TestShortcutBatch(t *testing.T) {
	w := newWrapped(t)
	counters, tbl, raw, gen := w.counters, w.tbl, w.raw, w.gen
	lc := w.listenerConn(true, nil)
	h := tbl.EventHandler(turn.EventHandler{})
	cl := udp4(t)
	src := &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1), Port: cl.LocalAddr().(*net.UDPAddr).Port}
	rc := allocate(t, h, gen, src)
	defer rc.Close()
	p1, p2 := udp4(t), udp4(t)
	bad := &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 0} // a send fails: EINVAL
	for ch, peer := range map[uint16]net.Addr{0x4000: p1.LocalAddr(), 0x4001: bad, 0x4002: p2.LocalAddr()} {
		h.OnChannelCreated(src, listener, "UDP", "u", "r", rc.LocalAddr(), peer, ch)
	}
	cd := func(ch uint16, s string) []byte { return chanData(ch, len(s), []byte(s)) }
	burst := [][]byte{
		cd(0x4000, "a"), cd(0x4002, "b"), cd(0x4001, "bad"), cd(0x4000, "c"), // c: after the failure
		[]byte("\x00\x01pion X"),
		cd(0x4000, "d"), cd(0x4002, "e"),
		[]byte("\x00\x01pion Y"),
	}
	to := raw.LocalAddr()
	for _, p := range burst {
		if _, err := cl.WriteTo(p, to); err != nil {
			t.Fatal(err)
		}
	}
	buf := make([]byte, 1600)
	var pion []string
	for range 4 {
		_ = raw.SetReadDeadline(time.Now().Add(2 * time.Second))
		n, from, err := lc.ReadFrom(buf)
		if err != nil {
			t.Fatalf("pion read %q, then %v", pion, err)
		}
		k, _ := clientKey(src)
		if fk, _ := clientKey(from); fk != k {
			t.Errorf("%q from %v, want the client's", buf[:n], from)
		}
		if f, ok := tbl.cur.of(k); !ok || !f.Valid {
			t.Errorf("%q: the read loop's current datagram is not the client's (%v, %v)", buf[:n], f, ok)
		}
		pion = append(pion, string(buf[:n]))
	}
	want := []string{string(cd(0x4001, "bad")), string(cd(0x4000, "c")), "\x00\x01pion X", "\x00\x01pion Y"}
	if fmt.Sprintf("%q", pion) != fmt.Sprintf("%q", want) {
		t.Errorf("pion read %q, want %q", pion, want)
	}
	if got := readAll(p1, time.Second); fmt.Sprint(got) != "[a d]" {
		t.Errorf("peer 1 read %q, want a d", got)
	}
	if got := readAll(p2, time.Second); fmt.Sprint(got) != "[b e]" {
		t.Errorf("peer 2 read %q, want b e", got)
	}
	if p, b, s, sent := counters.ClientToPeerPackets.Load(), counters.ClientToPeerBytes.Load(), counters.ShortcutPackets.Load(), tbl.batch.sent.Load(); p != 4 || b != 4 || s != 4 || sent != 4 {
		t.Errorf("counted %d packets, %d bytes, %d by the shortcut, %d from batches; want 4 each", p, b, s, sent)
	}
}

// gateConn holds pion's read loop before a read that would wait, when told,
// so that what the client sends meanwhile comes in one recvmmsg batch.
type gateConn struct {
	net.PacketConn
	raw        *udpio.BatchConn
	hold       atomic.Bool
	held, open chan struct{}
}

func (g *gateConn) ReadFrom(p []byte) (int, net.Addr, error) {
	if g.raw.Buffered() == 0 && g.hold.CompareAndSwap(true, false) {
		g.held <- struct{}{}
		<-g.open
	}
	return g.PacketConn.ReadFrom(p)
}

// TestShortcutBatchTwin plays one script of a client's bursts against a
// pion/turn server with the wrappers, once with pion relaying everything and
// once with the shortcut relaying ChannelData in batches: each burst comes in
// one recvmmsg batch and mixes ChannelData on two channels with Send
// indications, ChannelData on an unbound channel and a datagram that fills
// pion's buffer. Each peer must read the same datagrams in the same order,
// and the counters must agree.
func TestShortcutBatchTwin(t *testing.T) {
	type outcome struct {
		p1, p2                   []string
		packets, bytes, shortcut uint64
	}
	play := func(t *testing.T, shortcut bool) (outcome, uint64) {
		w := newWrapped(t)
		counters, relays, tbl, raw := w.counters, w.relays, w.tbl, w.raw
		var g *gateConn
		lc := w.listenerConn(shortcut, func(pc net.PacketConn) net.PacketConn {
			g = &gateConn{PacketConn: pc, raw: raw, held: make(chan struct{}), open: make(chan struct{})}
			return g
		})
		key := turn.GenerateAuthKey("u", "r", "p")
		srv, err := turn.NewServer(turn.ServerConfig{
			Realm:             "r",
			AuthHandler:       func(string, string, net.Addr) ([]byte, bool) { return key, true },
			EventHandler:      relays.PeerHooks(tbl.EventHandler(turn.EventHandler{})),
			PacketConnConfigs: []turn.PacketConnConfig{{PacketConn: lc, RelayAddressGenerator: w.gen}},
		})
		if err != nil {
			t.Fatal(err)
		}
		defer srv.Close()
		c := &turnClient{t: t, conn: udp4(t), server: raw.LocalAddr().(*net.UDPAddr)}
		c.allocate()
		p1, p2 := udp4(t), udp4(t)
		a1, a2 := p1.LocalAddr().(*net.UDPAddr), p2.LocalAddr().(*net.UDPAddr)
		c.permit(a1)
		c.permit(a2)
		c.bind(0x4000, a1)
		c.bind(0x4001, a2)
		send := func(peer *net.UDPAddr, s string) []byte {
			return stun.MustBuild(stun.TransactionID, stun.NewType(stun.MethodSend, stun.ClassIndication),
				peerAddress{IP: peer.IP, Port: peer.Port}, stun.RawAttribute{Type: stun.AttrData, Value: []byte(s)}).Raw
		}
		cd := func(ch uint16, s string) []byte { return chanData(ch, len(s), []byte(s)) }
		bursts := [][][]byte{
			{cd(0x4000, "a1"), cd(0x4001, "b1"), cd(0x4000, "a2"), cd(0x4000, "a3"), cd(0x4001, "b2")},
			{cd(0x4000, "a4"), send(a1, "s1"), cd(0x4000, "a5"), cd(0x4001, "b3"), send(a2, "s2"), cd(0x4001, "b4")},
			{cd(0x4000, "a6"), cd(0x4007, "unbound"), cd(0x4000, "a7"), chanData(0x4001, 1596, make([]byte, 1596)), cd(0x4001, "b5")},
			{cd(0x4000, "a8")},
		}
		for i := range 30 {
			bursts[0] = append(bursts[0], cd(0x4000+uint16(i%2), fmt.Sprintf("x%d", i)))
		}
		for _, burst := range bursts {
			// The read loop handles the request (or holds before it
			// and reads it with the burst), then waits at the gate.
			g.hold.Store(true)
			req := stun.MustBuild(stun.TransactionID, stun.BindingRequest)
			if _, err := c.conn.WriteTo(req.Raw, c.server); err != nil {
				t.Fatal(err)
			}
			<-g.held
			for _, p := range burst {
				if _, err := c.conn.WriteTo(p, c.server); err != nil {
					t.Fatal(err)
				}
			}
			g.open <- struct{}{}
		}
		o := outcome{p1: readAll(p1, time.Second), p2: readAll(p2, time.Second)}
		srv.Close()
		o.packets, o.bytes, o.shortcut = counters.ClientToPeerPackets.Load(), counters.ClientToPeerBytes.Load(), counters.ShortcutPackets.Load()
		return o, tbl.batch.sent.Load()
	}
	pion, _ := play(t, false)
	short, sent := play(t, true)
	if len(pion.p1) == 0 || len(pion.p2) == 0 {
		t.Fatalf("pion relayed %q and %q", pion.p1, pion.p2)
	}
	if fmt.Sprintf("%q", pion.p1) != fmt.Sprintf("%q", short.p1) || fmt.Sprintf("%q", pion.p2) != fmt.Sprintf("%q", short.p2) {
		t.Errorf("peers read\n  %q\n  %q\nwith pion, and\n  %q\n  %q\nwith the shortcut's batches", pion.p1, pion.p2, short.p1, short.p2)
	}
	if pion.packets != short.packets || pion.bytes != short.bytes {
		t.Errorf("pion counted %d packets, %d bytes; the shortcut %d, %d", pion.packets, pion.bytes, short.packets, short.bytes)
	}
	// Every ChannelData on a bound channel but the one that fills pion's
	// buffer is the shortcut's (43), most of them from batches.
	if pion.shortcut != 0 || short.shortcut != 43 || sent < 35 {
		t.Errorf("the shortcut relayed %d (%d from batches), want 43; without it %d", short.shortcut, sent, pion.shortcut)
	}
	if !bytes.Contains([]byte(fmt.Sprint(short.p1)), []byte("s1")) {
		t.Errorf("peer 1 read no Send indication's data: %q", short.p1)
	}
}
