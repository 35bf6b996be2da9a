package e2e

import (
	"encoding/binary"
	"fmt"
	"net"
	"slices"
	"testing"
	"time"

	"github.com/pion/stun/v3"

	"github.com/l7mp/stunnerd-xdp/bpf"
	"github.com/l7mp/stunnerd-xdp/internal/channelmap"
	"github.com/l7mp/stunnerd-xdp/internal/config"
	"github.com/l7mp/stunnerd-xdp/internal/loader"
	"github.com/l7mp/stunnerd-xdp/internal/shield"
	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// The listener shield (bpf/relay.c listener_shield, --listener-shield, on by
// default): the same datagrams to the listener get the same answers from the
// daemon with XDP and with --xdp-mode=off, whose answers are pion/turn's.
// Every request type a client sends, in the encodings pion/turn accepts, is
// answered alike; what pion/turn discards unanswered gets no answer in either
// mode, and with XDP it never reaches pion: the kernel drops it, counted by
// reason.

// TestListenerShieldXDP runs the probes with XDP.
func TestListenerShieldXDP(t *testing.T) {
	inRig(t, false, func(t *testing.T, r rig) { shieldProbes(t, r, loader.ModeNative) })
}

// TestListenerShieldUserspace is its twin with --xdp-mode=off: the answers
// are pion/turn's own.
func TestListenerShieldUserspace(t *testing.T) {
	inRig(t, false, func(t *testing.T, r rig) { shieldProbes(t, r, loader.ModeOff) })
}

// shieldProbe is one datagram to the listener, sent repeat times, and what
// comes back to its socket (want: describeAnswer's, one per datagram sent;
// nil: nothing); drop is the shield's reason for it with XDP (0: it passes).
type shieldProbe struct {
	name   string
	from   *net.UDPConn
	msg    []byte
	repeat int
	want   []string
	drop   bpf.RelayReason
}

func shieldProbes(t *testing.T, r rig, mode loader.Mode) {
	d := startDaemon(t, mode, r.serverIfaces, nil)
	startEcho(t, r.peer, echoPeer)
	server := net.UDPAddrFromAddrPort(listenAddr)

	// A client that allocates, permits the echo peer and binds a channel to
	// it through the authenticated requests, each answered with success.
	c := listenUDP(t, r.client, "10.100.0.2:0", 0)
	turn := &testenv.RawTURN{T: t, Conn: c, Server: server, User: user,
		Key: stun.NewLongTermIntegrity(user, config.DefaultRealm, password)}
	turn.Allocate(time.Minute) // a 401 first: its nonce
	peer := testenv.PeerAddress(stun.XORMappedAddress{IP: net.ParseIP(peerAddr), Port: int(echoPeer.Port())})
	lifetime := stun.RawAttribute{Type: stun.AttrLifetime, Value: []byte{0, 0, 0, 60}}
	for _, req := range []struct {
		method stun.Method
		attrs  []stun.Setter
	}{
		{stun.MethodCreatePermission, []stun.Setter{peer}},
		{stun.MethodChannelBind, []stun.Setter{stun.RawAttribute{Type: stun.AttrChannelNumber, Value: []byte{0x40, 0, 0, 0}}, peer}},
		{stun.MethodRefresh, []stun.Setter{lifetime}},
		{stun.MethodBinding, nil},
	} {
		if res := turn.Do(req.method, req.attrs...); res.Type.Class != stun.ClassSuccessResponse {
			t.Fatalf("%v: %v", req.method, res)
		}
	}
	// Another client of the same host, which has no allocation.
	stranger := listenUDP(t, r.client, "10.100.0.2:0", 0)

	sendInd := stun.MustBuild(stun.TransactionID, stun.NewType(stun.MethodSend, stun.ClassIndication), peer,
		stun.RawAttribute{Type: stun.AttrData, Value: []byte("a send indication")})
	headerOnly := func(typ uint16, cookie uint32) []byte {
		b := make([]byte, 20)
		binary.BigEndian.PutUint16(b[0:], typ)
		binary.BigEndian.PutUint32(b[4:], cookie)
		copy(b[8:], "shieldprobe1")
		return b
	}
	const magic = 0x2112A442
	channelData := func(ch uint16, data string) []byte {
		b := binary.BigEndian.AppendUint16(nil, ch)
		b = binary.BigEndian.AppendUint16(b, uint16(len(data)))
		b = append(b, data...)
		return append(b, make([]byte, (4-len(data)%4)%4)...)
	}
	const n = 10
	probes := []shieldProbe{
		// What pion/turn answers, or relays.
		{name: "bound channel", from: c, msg: channelData(0x4000, "through the channel"), repeat: 1, want: []string{"channeldata 0x4000"}},
		// The peer's echo comes back on the channel bound to it.
		{name: "send indication", from: c, msg: sendInd.Raw, repeat: 1, want: []string{"channeldata 0x4000"}},
		{name: "binding request", from: stranger, msg: headerOnly(0x0001, magic), repeat: 1, want: []string{"Binding success response"}},
		// stun reads the method without the type's top two bits.
		{name: "binding request, top bits 10", from: stranger, msg: headerOnly(0x8001, magic), repeat: 1, want: []string{"Binding success response"}},
		{name: "binding request, trailing bytes", from: stranger, msg: append(headerOnly(0x0001, magic), 1, 2, 3), repeat: 1,
			want: []string{"Binding success response"}},
		{name: "unauthenticated allocate", from: stranger,
			msg: stun.MustBuild(stun.TransactionID, stun.NewType(stun.MethodAllocate, stun.ClassRequest),
				stun.RawAttribute{Type: stun.AttrRequestedTransport, Value: []byte{17, 0, 0, 0}}).Raw,
			repeat: 1, want: []string{"Allocate error response 401"}},
		// pion/turn discards ChannelData on a channel nobody bound of a
		// client that has an allocation: the shield leaves that to it.
		{name: "unbound channel of an allocation", from: c, msg: channelData(0x4001, "nobody bound it"), repeat: n},
		// What pion/turn discards unanswered.
		{name: "channeldata without an allocation", from: stranger, msg: channelData(0x4000, "a stranger's"), repeat: n,
			drop: bpf.RelayReasonREASON_NO_ALLOCATION},
		{name: "binding request, top bits 01 (channeldata to pion)", from: stranger, msg: headerOnly(0x4001, magic), repeat: n,
			drop: bpf.RelayReasonREASON_NO_ALLOCATION},
		{name: "random bytes", from: stranger, msg: []byte("\x80\x01 not a TURN message at all"), repeat: n,
			drop: bpf.RelayReasonREASON_NOT_TURN},
		{name: "bad magic cookie", from: stranger, msg: headerOnly(0x0001, 0x2112A443), repeat: n, drop: bpf.RelayReasonREASON_NOT_TURN},
		{name: "length beyond the datagram", from: c, msg: append(headerOnly(0x0001, magic)[:2], append([]byte{0, 8}, headerOnly(0x0001, magic)[4:]...)...),
			repeat: n, drop: bpf.RelayReasonREASON_NOT_TURN},
		{name: "Binding success response", from: stranger, msg: headerOnly(0x0101, magic), repeat: n, drop: bpf.RelayReasonREASON_STUN_UNHANDLED},
		{name: "Data indication", from: c, msg: headerOnly(0x0017, magic), repeat: n, drop: bpf.RelayReasonREASON_STUN_UNHANDLED},
		{name: "connect request (RFC 6062)", from: c, msg: headerOnly(0x000a, magic), repeat: n, drop: bpf.RelayReasonREASON_STUN_UNHANDLED},
	}

	before := snapshot(t, d)
	wantDrops := map[bpf.RelayReason]uint64{}
	for _, p := range probes {
		got := exchange(t, p.from, server, p.msg, p.repeat)
		if !slices.Equal(got, p.want) {
			t.Errorf("%s: answered %q, want %q", p.name, got, p.want)
		}
		if p.drop != 0 {
			wantDrops[p.drop] += uint64(p.repeat)
		}
	}
	after := snapshot(t, d)
	// Where each reason's drops are counted: by the kernel with XDP, by the
	// read loops' shield (internal/shield) without it.
	userReason := map[bpf.RelayReason]shield.Reason{bpf.RelayReasonREASON_NO_ALLOCATION: shield.NoAllocation,
		bpf.RelayReasonREASON_NOT_TURN: shield.NotTURNReason, bpf.RelayReasonREASON_STUN_UNHANDLED: shield.UnhandledReason}
	for reason, ur := range userReason {
		var kernel, user uint64
		if mode != loader.ModeOff {
			kernel = after.verdicts[reason] - before.verdicts[reason]
		}
		user = after.shield[ur] - before.shield[ur]
		want := [2]uint64{wantDrops[reason], 0}
		if mode == loader.ModeOff {
			want = [2]uint64{0, wantDrops[reason]}
		}
		if kernel != want[0] || user != want[1] {
			t.Errorf("%s: %d dropped by the kernel, %d by the read loops; want %d and %d", channelmap.ReasonNames[reason], kernel, user, want[0], want[1])
		}
	}
	t.Logf("dropped by the shield: %v", wantDrops)
}

// exchange sends msg repeat times from c to server and returns what comes back
// to c until nothing has for 300 ms, each answer described.
func exchange(t *testing.T, c *net.UDPConn, server *net.UDPAddr, msg []byte, repeat int) []string {
	t.Helper()
	for range repeat {
		if _, err := c.WriteTo(msg, server); err != nil {
			t.Fatal(err)
		}
	}
	var got []string
	buf := make([]byte, 1500)
	for {
		if err := c.SetReadDeadline(time.Now().Add(testenv.Timeout(300 * time.Millisecond))); err != nil {
			t.Fatal(err)
		}
		n, _, err := c.ReadFrom(buf)
		if err != nil {
			return got
		}
		got = append(got, describeAnswer(buf[:n]))
	}
}

// describeAnswer names a datagram from the server: ChannelData and its
// channel, or a STUN message's method and class (and error code).
func describeAnswer(b []byte) string {
	if len(b) >= 4 && b[0]>>6 == 1 {
		return fmt.Sprintf("channeldata %#04x", binary.BigEndian.Uint16(b))
	}
	m := &stun.Message{Raw: append([]byte(nil), b...)}
	if err := m.Decode(); err != nil {
		return fmt.Sprintf("undecodable %x", b)
	}
	s := m.Type.String()
	var code stun.ErrorCodeAttribute
	if code.GetFrom(m) == nil {
		s += fmt.Sprintf(" %d", code.Code)
	}
	return s
}
