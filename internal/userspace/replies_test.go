package userspace

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"net"
	"net/netip"
	"runtime"
	"testing"
	"time"

	"github.com/pion/stun/v3"
	"github.com/pion/turn/v4"
	"golang.org/x/sys/unix"

	"github.com/l7mp/stunnerd-xdp/internal/udpio"
)

// peerAddress is XOR-PEER-ADDRESS as pion's proto.PeerAddress encodes it.
type peerAddress stun.XORMappedAddress

func (a peerAddress) AddTo(m *stun.Message) error {
	return stun.XORMappedAddress(a).AddToAs(m, stun.AttrXORPeerAddress)
}

// fixedID sets the transaction id, for comparing with a message of a random one.
type fixedID [stun.TransactionIDSize]byte

func (id fixedID) AddTo(m *stun.Message) error {
	m.TransactionID = id
	m.WriteTransactionID()
	return nil
}

// TestReplyFraming: the ChannelData and Data indications the shortcut frames
// are byte for byte pion's (proto.ChannelData.Encode; stun.Build of the
// type, XOR-PEER-ADDRESS and DATA), given the same transaction id.
func TestReplyFraming(t *testing.T) {
	for _, peer := range []netip.AddrPort{netip.MustParseAddrPort("10.0.1.1:5000"), netip.MustParseAddrPort("[2001:db8::7]:65535")} {
		for _, n := range []int{0, 1, 2, 3, 4, 5, 100, 1599, 1600} {
			t.Run(fmt.Sprintf("%v/%d", peer, n), func(t *testing.T) {
				data := make([]byte, n)
				for i := range data {
					data[i] = byte(i*7 + 1)
				}
				buf := bytes.Repeat([]byte{0xEE}, headroom+1600+3) // stale bytes where padding goes
				copy(buf[headroom:], data)
				cd := channelData(buf, n, 0x4001)
				want := append(binary.BigEndian.AppendUint16(binary.BigEndian.AppendUint16(nil, 0x4001), uint16(n)), data...)
				want = append(want, make([]byte, padded(len(want))-len(want))...)
				if !bytes.Equal(cd, want) {
					t.Fatalf("ChannelData\n got %x\nwant %x", cd, want)
				}

				copy(buf[headroom:], data)
				di, ok := dataIndication(buf, n, peer)
				if !ok {
					t.Fatal("no Data indication")
				}
				ip := net.IP(peer.Addr().AsSlice())
				m, err := stun.Build(fixedID(di[8:20]), stun.NewType(stun.MethodData, stun.ClassIndication),
					peerAddress{IP: ip, Port: int(peer.Port())}, stun.RawAttribute{Type: stun.AttrData, Value: data})
				if err != nil {
					t.Fatal(err)
				}
				if !bytes.Equal(di, m.Raw) {
					t.Fatalf("Data indication\n got %x\nwant %x", di, m.Raw)
				}
				if got, ok := relayedData(di); !ok || got != n {
					t.Errorf("relayedData of it: %d, %v", got, ok)
				}
			})
		}
	}
	// The transaction ids are random.
	buf := make([]byte, headroom+8)
	a, _ := dataIndication(buf, 1, netip.MustParseAddrPort("10.0.1.1:5000"))
	id := append([]byte(nil), a[8:20]...)
	b, _ := dataIndication(buf, 1, netip.MustParseAddrPort("10.0.1.1:5000"))
	if bytes.Equal(id, b[8:20]) {
		t.Error("two Data indications with one transaction id")
	}
}

// TestDataAttrLen: relayedData reads a Data indication's DATA where stun's
// Decode and Get find it, on pion's messages and on random damage to them.
func TestDataAttrLen(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	base, err := stun.Build(stun.TransactionID, stun.NewType(stun.MethodData, stun.ClassIndication),
		peerAddress{IP: net.IPv4(10, 0, 1, 1), Port: 5000}, stun.RawAttribute{Type: stun.AttrData, Value: []byte("hello")},
		stun.RawAttribute{Type: stun.AttrData, Value: []byte("second")})
	if err != nil {
		t.Fatal(err)
	}
	for i := range 20000 {
		p := append([]byte(nil), base.Raw...)
		switch i % 3 {
		case 0: // a byte changed
			p[4+rng.IntN(len(p)-4)] = byte(rng.Uint32())
		case 1: // cut
			p = p[:20+rng.IntN(len(p)-19)]
		case 2: // a length changed
			off := []int{2, 22, 34}[rng.IntN(3)]
			binary.BigEndian.PutUint16(p[off:], uint16(rng.IntN(64)))
		}
		m := &stun.Message{Raw: append([]byte(nil), p...)}
		want, wantOK := 0, false
		if m.Decode() == nil {
			if v, err := m.Get(stun.AttrData); err == nil {
				want, wantOK = len(v), true
			}
		}
		if got, ok := dataAttrLen(p); got != want || ok != wantOK {
			t.Fatalf("%x: dataAttrLen %d, %v; stun %d, %v", p, got, ok, want, wantOK)
		}
	}
}

// turnServer is a pion/turn server on 127.0.0.1 with the userspace wrappers
// as the daemon stacks them, with or without the peer->client shortcut.
type turnServer struct {
	addr     *net.UDPAddr
	counters *Counters
}

func startTurnServer(t testing.TB, replies bool, bindTimeout time.Duration) *turnServer {
	w := newWrapped(t)
	counters, relays, tbl, raw, gen := w.counters, w.relays, w.tbl, w.raw, w.gen
	lc := net.PacketConn(w.listenerConn(true, nil))
	h := tbl.EventHandler(turn.EventHandler{})
	if replies {
		h = NewReplies(relays, lc, counters).EventHandler(h)
	}
	h = relays.PeerHooks(h)
	key := turn.GenerateAuthKey("u", "r", "p")
	srv, err := turn.NewServer(turn.ServerConfig{
		Realm:              "r",
		AuthHandler:        func(string, string, net.Addr) ([]byte, bool) { return key, true },
		ChannelBindTimeout: bindTimeout,
		EventHandler:       h,
		PacketConnConfigs:  []turn.PacketConnConfig{{PacketConn: lc, RelayAddressGenerator: gen}},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close() })
	return &turnServer{addr: raw.LocalAddr().(*net.UDPAddr), counters: counters}
}

// turnClient speaks TURN on a UDP socket, one request at a time.
type turnClient struct {
	t      testing.TB
	conn   *net.UDPConn
	server *net.UDPAddr
	auth   []stun.Setter // username, realm, nonce, integrity once known
	// other collects what came while waiting for a response.
	other [][]byte
}

func (c *turnClient) do(method stun.Method, attrs ...stun.Setter) *stun.Message {
	c.t.Helper()
	setters := append([]stun.Setter{stun.TransactionID, stun.NewType(method, stun.ClassRequest)}, attrs...)
	req := stun.MustBuild(append(setters, c.auth...)...)
	if _, err := c.conn.WriteTo(req.Raw, c.server); err != nil {
		c.t.Fatal(err)
	}
	buf := make([]byte, 2048)
	_ = c.conn.SetReadDeadline(time.Now().Add(5 * time.Second))
	for {
		n, _, err := c.conn.ReadFrom(buf)
		if err != nil {
			c.t.Fatalf("%v: %v", method, err)
		}
		res := &stun.Message{Raw: append([]byte(nil), buf[:n]...)}
		if res.Decode() != nil || res.TransactionID != req.TransactionID {
			c.other = append(c.other, res.Raw)
			continue
		}
		return res
	}
}

func (c *turnClient) allocate() *net.UDPAddr {
	c.t.Helper()
	transport := stun.RawAttribute{Type: stun.AttrRequestedTransport, Value: []byte{17, 0, 0, 0}}
	res := c.do(stun.MethodAllocate, transport)
	var nonce stun.Nonce
	var realm stun.Realm
	if nonce.GetFrom(res) != nil || realm.GetFrom(res) != nil {
		c.t.Fatalf("Allocate: %v", res)
	}
	c.auth = []stun.Setter{stun.NewUsername("u"), realm, nonce, stun.NewLongTermIntegrity("u", "r", "p")}
	res = c.do(stun.MethodAllocate, transport)
	var relay stun.XORMappedAddress
	if res.Type.Class != stun.ClassSuccessResponse || relay.GetFromAs(res, stun.AttrXORRelayedAddress) != nil {
		c.t.Fatalf("Allocate: %v", res)
	}
	return &net.UDPAddr{IP: relay.IP, Port: relay.Port}
}

func (c *turnClient) permit(peer *net.UDPAddr) {
	c.t.Helper()
	if res := c.do(stun.MethodCreatePermission, peerAddress{IP: peer.IP, Port: peer.Port}); res.Type.Class != stun.ClassSuccessResponse {
		c.t.Fatalf("CreatePermission %v: %v", peer, res)
	}
}

func (c *turnClient) bind(ch uint16, peer *net.UDPAddr) {
	c.t.Helper()
	num := stun.RawAttribute{Type: stun.AttrChannelNumber, Value: []byte{byte(ch >> 8), byte(ch), 0, 0}}
	if res := c.do(stun.MethodChannelBind, num, peerAddress{IP: peer.IP, Port: peer.Port}); res.Type.Class != stun.ClassSuccessResponse {
		c.t.Fatalf("ChannelBind %#x: %v", ch, res)
	}
}

// received is what the client read within wait (and what came during its
// requests). A Data indication's transaction id (random in pion's and the
// shortcut's alike) is zeroed, and its XOR-PEER-ADDRESS (first, IPv4: what
// both write) zeroed and named by names: the peers' ports differ from one
// run to the next.
func (c *turnClient) received(wait time.Duration, names map[string]string) []string {
	var got []string
	add := func(p []byte) {
		p = append([]byte(nil), p...)
		from := ""
		if len(p) >= 32 && binary.BigEndian.Uint16(p) == typeDataIndication {
			m := &stun.Message{Raw: append([]byte(nil), p...)}
			var pa stun.XORMappedAddress
			if m.Decode() != nil || pa.GetFromAs(m, stun.AttrXORPeerAddress) != nil {
				c.t.Fatalf("client got %x", p)
			}
			from = names[(&net.UDPAddr{IP: pa.IP, Port: pa.Port}).String()] + " "
			clear(p[8:20])
			clear(p[24:32])
		}
		got = append(got, fmt.Sprintf("%s%x", from, p))
	}
	for _, p := range c.other {
		add(p)
	}
	c.other = nil
	buf := make([]byte, 2048)
	_ = c.conn.SetReadDeadline(time.Now().Add(wait))
	for {
		n, _, err := c.conn.ReadFrom(buf)
		if err != nil {
			return got
		}
		add(buf[:n])
		_ = c.conn.SetReadDeadline(time.Now().Add(100 * time.Millisecond))
	}
}

func udp4(t testing.TB) *net.UDPConn {
	c, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// TestRepliesTwin plays one script of peer datagrams against a pion/turn
// server with the wrappers, once with pion's packet handler relaying them and
// once with the shortcut: the client must get the same bytes at each step
// (Data indications but for their random transaction ids), and the counters
// must agree. With the shortcut, pion's handler must not relay any.
func TestRepliesTwin(t *testing.T) {
	const bindTimeout = 1500 * time.Millisecond
	type outcome struct {
		steps                         []string
		packets, bytes, shortcut, p2c uint64
	}
	play := func(t *testing.T, replies bool) outcome {
		srv := startTurnServer(t, replies, bindTimeout)
		c := &turnClient{t: t, conn: udp4(t), server: srv.addr}
		relay := c.allocate()
		peer, stranger := udp4(t), udp4(t) // one IP: a permission covers both
		other, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 2)})
		if err != nil {
			t.Fatal(err)
		}
		defer other.Close()
		names := map[string]string{peer.LocalAddr().String(): "peer", stranger.LocalAddr().String(): "stranger", other.LocalAddr().String(): "other"}
		var out outcome
		step := func(name string, from *net.UDPConn, p []byte) {
			t.Helper()
			if _, err := from.WriteTo(p, relay); err != nil {
				t.Fatal(err)
			}
			wait := 300 * time.Millisecond
			out.steps = append(out.steps, fmt.Sprintf("%s: %v", name, c.received(wait, names)))
		}
		step("no permission", peer, []byte("dropped"))
		c.permit(peer.LocalAddr().(*net.UDPAddr))
		step("permission", peer, []byte("data indication"))
		step("permission, other port", stranger, []byte("odd"))
		step("empty", peer, nil)
		step("longer than pion's buffer", peer, bytes.Repeat([]byte{7}, 1700))
		step("other IP", other, []byte("dropped"))
		c.bind(0x4000, peer.LocalAddr().(*net.UDPAddr))
		step("channel", peer, []byte("channel data"))
		step("channel, odd length", peer, []byte("abcde"))
		step("not the channel's port", stranger, []byte("indication"))
		step("channel, full buffer", peer, bytes.Repeat([]byte{9}, 1600))
		// The channel expires (pion's timer): its peer gets Data indications
		// again, on the permission the bind refreshed.
		time.Sleep(bindTimeout + 500*time.Millisecond)
		step("channel expired", peer, []byte("after expiry"))
		out.packets, out.bytes = srv.counters.PeerToClientPackets.Load(), srv.counters.PeerToClientBytes.Load()
		out.shortcut = srv.counters.PeerShortcutPackets.Load()
		return out
	}
	var twins [2]outcome
	for i, replies := range []bool{false, true} {
		t.Run(fmt.Sprintf("shortcut=%v", replies), func(t *testing.T) { twins[i] = play(t, replies) })
	}
	pion, sc := twins[0], twins[1]
	if len(pion.steps) != len(sc.steps) {
		t.Fatalf("steps: pion %d, shortcut %d", len(pion.steps), len(sc.steps))
	}
	for i := range pion.steps {
		if pion.steps[i] != sc.steps[i] {
			t.Errorf("step %d:\n   pion %s\nshortcut %s", i, pion.steps[i], sc.steps[i])
		}
	}
	if pion.packets != sc.packets || pion.bytes != sc.bytes {
		t.Errorf("peer->client counters: pion %d packets %d bytes, shortcut %d, %d", pion.packets, pion.bytes, sc.packets, sc.bytes)
	}
	if pion.packets != 9 {
		t.Errorf("pion relayed %d datagrams, want 9", pion.packets)
	}
	if pion.shortcut != 0 || sc.shortcut != sc.packets {
		t.Errorf("the shortcut relayed %d without it, %d of %d with it", pion.shortcut, sc.shortcut, sc.packets)
	}
}

// replyRig is a server with a client bound to channel 0x4000 towards a peer
// (and the peer's IP permitted); the client and the peer use socket calls
// that allocate nothing, so the process's allocations while the peer sends
// are the server's.
type replyRig struct {
	srv          *turnServer
	client, peer *net.UDPConn
	relay        netip.AddrPort
	data, buf    []byte
}

func newReplyRig(t testing.TB, replies bool, channel bool) *replyRig {
	r := &replyRig{srv: startTurnServer(t, replies, 0), client: udp4(t), peer: udp4(t), data: make([]byte, 100), buf: make([]byte, 2048)}
	_ = r.client.SetReadBuffer(4 << 20)
	c := &turnClient{t: t, conn: r.client, server: r.srv.addr}
	r.relay = c.allocate().AddrPort()
	c.permit(r.peer.LocalAddr().(*net.UDPAddr))
	if channel {
		c.bind(0x4000, r.peer.LocalAddr().(*net.UDPAddr))
	}
	_ = r.client.SetReadDeadline(time.Time{})
	return r
}

// burst sends 16 datagrams from the peer and returns how many reached the
// client.
func (r *replyRig) burst(t testing.TB) int {
	const burst = 16
	for range burst {
		if _, err := r.peer.WriteToUDPAddrPort(r.data, r.relay); err != nil {
			t.Fatal(err)
		}
	}
	_ = r.client.SetReadDeadline(time.Now().Add(5 * time.Second))
	got := 0
	for range burst {
		if _, _, err := r.client.ReadFromUDPAddrPort(r.buf); err != nil {
			t.Fatal(err)
		}
		got++
	}
	return got
}

func (r *replyRig) allocsPerPacket(t testing.TB, bursts int) float64 {
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	packets := 0
	for range bursts {
		packets += r.burst(t)
	}
	runtime.ReadMemStats(&after)
	return float64(after.Mallocs-before.Mallocs) / float64(packets)
}

// TestRepliesAllocs: peer->client relaying allocates nothing per datagram
// with the shortcut, ChannelData or Data indications; pion's handler does.
func TestRepliesAllocs(t *testing.T) {
	for _, channel := range []bool{true, false} {
		for _, replies := range []bool{true, false} {
			r := newReplyRig(t, replies, channel)
			r.allocsPerPacket(t, 16) // warm
			allocs := r.allocsPerPacket(t, 64)
			t.Logf("channel %v, shortcut %v: %.3f allocations per relayed datagram", channel, replies, allocs)
			switch {
			case replies && allocs > 0.1:
				t.Errorf("channel %v, with the shortcut: %.2f allocations per datagram, want 0", channel, allocs)
			case !replies && allocs < 1:
				t.Errorf("channel %v, pion's handler: %.2f allocations per datagram; if pion no longer allocates, the shortcut's reason is gone", channel, allocs)
			}
		}
	}
}

// BenchmarkReplies reports the heap allocations, the wall time and the
// process's CPU time (server, peer and client: the last two the same in both)
// per peer->client datagram (16 in flight), with the shortcut and with pion's
// handler.
func BenchmarkReplies(b *testing.B) {
	for _, kind := range []string{"channel", "indication"} {
		for _, replies := range []bool{true, false} {
			name := kind + "/pion"
			if replies {
				name = kind + "/shortcut"
			}
			b.Run(name, func(b *testing.B) {
				r := newReplyRig(b, replies, kind == "channel")
				var before, after runtime.MemStats
				var cpu0, cpu1 unix.Rusage
				runtime.GC()
				runtime.ReadMemStats(&before)
				_ = unix.Getrusage(unix.RUSAGE_SELF, &cpu0)
				packets := 0
				b.ResetTimer()
				for b.Loop() {
					packets += r.burst(b)
				}
				b.StopTimer()
				_ = unix.Getrusage(unix.RUSAGE_SELF, &cpu1)
				runtime.ReadMemStats(&after)
				cpu := cpu1.Utime.Nano() + cpu1.Stime.Nano() - cpu0.Utime.Nano() - cpu0.Stime.Nano()
				b.ReportMetric(float64(cpu)/float64(packets), "cpu-ns/pkt")
				b.ReportMetric(float64(after.Mallocs-before.Mallocs)/float64(packets), "allocs/pkt")
				b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(packets), "ns/pkt")
			})
		}
	}
}

// TestRepliesFields: what the shortcut relays to a client leaves with the
// peer's TTL less one and its TOS, as pion's writes do (fields.go), and a
// peer's TTL of 1 is dropped before either.
func TestRepliesFields(t *testing.T) {
	for _, replies := range []bool{true, false} {
		t.Run(fmt.Sprintf("shortcut=%v", replies), func(t *testing.T) {
			srv := startTurnServer(t, replies, 0)
			client, peer, expiring := sendingWith(t, 64, 0), sendingWith(t, 23, 0x2A), sendingWith(t, 1, 0)
			c := &turnClient{t: t, conn: client.UDPConn, server: srv.addr}
			relay := c.allocate()
			c.permit(peer.LocalAddr().(*net.UDPAddr))
			send := func(from *udpio.Conn, p []byte) {
				t.Helper()
				if _, err := from.WriteTo(p, relay); err != nil {
					t.Fatal(err)
				}
			}
			// A Data indication (its transaction id is random: only the
			// fields and the data are compared).
			send(expiring, []byte("ttl 1"))
			send(peer, []byte("indication"))
			_ = client.SetReadDeadline(time.Now().Add(2 * time.Second))
			buf := make([]byte, 1600)
			n, _, f, err := client.ReadFromFields(buf)
			if err != nil {
				t.Fatal(err)
			}
			if want := (udpio.Fields{TTL: 22, TOS: 0x2A, Valid: true}); !bytes.HasSuffix(buf[:n], []byte("indication\x00\x00")) || f != want {
				t.Errorf("Data indication %x with %+v, want the data with %+v", buf[:n], f, want)
			}
			c.bind(0x4000, peer.LocalAddr().(*net.UDPAddr))
			send(peer, []byte("channel"))
			readWith(t, "ChannelData", client, chanData(0x4000, 7, []byte("channel\x00")), udpio.Fields{TTL: 22, TOS: 0x2A, Valid: true})
			if got := srv.counters.TTLExpired.Load(); got != 1 {
				t.Errorf("TTLExpired %d, want 1", got)
			}
			if got, want := srv.counters.PeerShortcutPackets.Load(), map[bool]uint64{true: 2, false: 0}[replies]; got != want {
				t.Errorf("PeerShortcutPackets %d, want %d", got, want)
			}
		})
	}
}
