package shield

import (
	"encoding/binary"
	"net"
	"net/netip"
	"testing"

	"github.com/pion/stun/v3"
)

func header(typ uint16, length int, cookie uint32) []byte {
	b := make([]byte, 20+length)
	binary.BigEndian.PutUint16(b, typ)
	binary.BigEndian.PutUint16(b[2:], uint16(length))
	binary.BigEndian.PutUint32(b[4:], cookie)
	return b
}

func TestClassify(t *testing.T) {
	req := stun.MustBuild(stun.TransactionID, stun.NewType(stun.MethodAllocate, stun.ClassRequest), stun.Fingerprint)
	for _, c := range []struct {
		name string
		b    []byte
		want Class
	}{
		{"channeldata", []byte{0x40, 0x00, 0x00, 0x02, 1, 2, 0, 0}, ChannelData},
		{"channeldata, last channel, long padding", append([]byte{0x7f, 0xff, 0x00, 0x01, 1}, make([]byte, 40)...), ChannelData},
		{"channeldata, length beyond", []byte{0x40, 0x00, 0x00, 0x08, 1, 2}, NotTURN},
		{"empty", nil, NotTURN},
		{"allocate", req.Raw, Request},
		{"binding", header(0x0001, 0, magicCookie), Request},
		{"binding, top bits 10", header(0x8001, 0, magicCookie), Request},
		{"binding, top bits 01: channeldata", header(0x4001, 0, magicCookie), ChannelData},
		{"refresh", header(0x0004, 0, magicCookie), Request},
		{"create permission", header(0x0008, 0, magicCookie), Request},
		{"channel bind", header(0x0009, 0, magicCookie), Request},
		{"send indication", header(0x0016, 0, magicCookie), Indication},
		{"data indication", header(0x0017, 0, magicCookie), Unhandled},
		{"binding success", header(0x0101, 0, magicCookie), Unhandled},
		{"allocate error", header(0x0113, 0, magicCookie), Unhandled},
		{"connect", header(0x000a, 0, magicCookie), Unhandled},
		{"bad cookie", header(0x0001, 0, magicCookie+1), NotTURN},
		{"length beyond", header(0x0001, 8, magicCookie)[:24], NotTURN},
		{"trailing bytes", append(header(0x0001, 0, magicCookie), 1, 2, 3), Request},
	} {
		if got := Classify(c.b); got != c.want {
			t.Errorf("%s: %d, want %d", c.name, got, c.want)
		}
	}
}

// FuzzClassify checks Classify against pion/stun's decoding: what it calls
// not TURN, stun cannot decode (and pion/turn's ChannelData test refuses);
// what stun decodes it classes as stun reads the type.
func FuzzClassify(f *testing.F) {
	f.Add(header(0x0001, 0, magicCookie))
	f.Add(header(0x8113, 4, magicCookie))
	f.Add([]byte{0x40, 0, 0, 0})
	f.Add(stun.MustBuild(stun.TransactionID, stun.NewType(stun.MethodChannelBind, stun.ClassRequest), stun.Fingerprint).Raw)
	f.Fuzz(func(t *testing.T, b []byte) {
		got := Classify(b)
		channelData := len(b) >= 4 && b[0]>>6 == 1 && int(binary.BigEndian.Uint16(b[2:])) <= len(b)-4
		if channelData != (got == ChannelData) {
			t.Fatalf("%x: class %d, pion's ChannelData test says %v", b, got, channelData)
		}
		if channelData {
			return
		}
		m := &stun.Message{Raw: append([]byte(nil), b...)}
		err := m.Decode()
		if got == NotTURN {
			if err == nil {
				t.Fatalf("%x: not TURN, but stun decodes %v", b, m)
			}
			return
		}
		if err != nil {
			return // an attribute stun refuses: pion/turn's to discard
		}
		handled := map[stun.Method]bool{stun.MethodBinding: true, stun.MethodAllocate: true, stun.MethodRefresh: true,
			stun.MethodCreatePermission: true, stun.MethodChannelBind: true}
		want := Unhandled
		switch {
		case m.Type.Class == stun.ClassRequest && handled[m.Type.Method]:
			want = Request
		case m.Type.Class == stun.ClassIndication && m.Type.Method == stun.MethodSend:
			want = Indication
		}
		if got != want {
			t.Fatalf("%x (%v): class %d, want %d", b, m.Type, got, want)
		}
	})
}

type allocs map[[2]netip.AddrPort]bool

func (a allocs) Has(l, c netip.AddrPort) bool { return a[[2]netip.AddrPort{l, c}] }

func TestListenerDrop(t *testing.T) {
	l := netip.MustParseAddrPort("0.0.0.0:3478")
	member := &net.UDPAddr{IP: net.ParseIP("10.0.0.2"), Port: 4000}
	stranger := &net.UDPAddr{IP: net.ParseIP("10.0.0.3"), Port: 4000}
	var counts Counts
	s := New(allocs{{l, netip.MustParseAddrPort("10.0.0.2:4000")}: true}, &counts, 1, 2)
	sl := s.Listener(l)
	cd := []byte{0x40, 0, 0, 0}
	allocate := header(0x0003, 0, magicCookie)
	for i, c := range []struct {
		b    []byte
		from *net.UDPAddr
		drop bool
	}{
		{cd, member, false},
		{cd, stranger, true},
		{[]byte("junk"), member, true},
		{header(0x0101, 0, magicCookie), member, true},
		{header(0x0016, 0, magicCookie), stranger, false},
		{allocate, stranger, false}, // the burst of two
		{allocate, stranger, false},
		{allocate, stranger, true},
		{allocate, member, false}, // an allocation's: not charged
		{allocate, member, false},
		{allocate, member, false},
	} {
		if got := sl.Drop(c.b, c.from); got != c.drop {
			t.Errorf("%d: drop %v, want %v", i, got, c.drop)
		}
	}
	want := [reasons]uint64{NoAllocation: 1, NotTURNReason: 1, UnhandledReason: 1, Admission: 1}
	for r := range want {
		if got := counts[r].Load(); got != want[r] {
			t.Errorf("%s: %d, want %d", Names[r], got, want[r])
		}
	}
	var nilShield *Shield
	if nilShield.Listener(l).Drop([]byte("junk"), stranger) {
		t.Error("a nil shield dropped")
	}
}
