package bpf_test

import (
	"encoding/binary"
	"errors"
	"maps"
	"net/netip"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/l7mp/stunnerd-xdp/bpf"
	"github.com/l7mp/stunnerd-xdp/internal/channelmap"
	"github.com/l7mp/stunnerd-xdp/test/model"
	"github.com/l7mp/stunnerd-xdp/test/packet"
)

// The listener shield (model rule 12): at a listener socket, what pion/turn
// would discard unanswered is dropped, each for its reason; everything
// pion/turn answers, and everything not for a listener socket, passes as
// before. Both engines, against the model.

// setShield sets the shield and the two allocation tables in the program
// and the model (the shield off and the tables emptied when t ends).
func (e *env) setShield(t testing.TB, m *model.Model, s model.Shield, allocs, nodeAllocs map[model.Allocation]bool) {
	t.Helper()
	write := func(s model.Shield, allocs, nodeAllocs map[model.Allocation]bool) {
		t.Helper()
		if err := e.maps.SetShield(channelmap.Shield{Junk: s.Junk, Allocations: s.Allocations,
			AdmitCost: time.Duration(s.Admission.Cost), AdmitBurst: time.Duration(s.Admission.Burst)}); err != nil {
			t.Fatal(err)
		}
		pm := e.prog.Maps()
		// What the source addresses owe their admission starts afresh, as
		// the model's does.
		var (
			src  bpf.RelayAddr
			tat  uint64
			srcs []bpf.RelayAddr
		)
		it := pm.AdmitTats.Iterate()
		for it.Next(&src, &tat) {
			srcs = append(srcs, src)
		}
		if err := it.Err(); err != nil {
			t.Fatal(err)
		}
		for _, a := range srcs {
			if err := pm.AdmitTats.Delete(a); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
				t.Fatal(err)
			}
		}
		for _, tb := range []struct {
			m    *ebpf.Map
			want map[model.Allocation]bool
		}{{pm.AllocFlows, allocs}, {pm.NodeFlows, nodeAllocs}} {
			var (
				k    bpf.SteerFlow
				v    uint32
				keys []bpf.SteerFlow
			)
			it := tb.m.Iterate()
			for it.Next(&k, &v) {
				keys = append(keys, k)
			}
			if err := it.Err(); err != nil {
				t.Fatal(err)
			}
			for _, k := range keys {
				if err := tb.m.Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
					t.Fatal(err)
				}
			}
			for a := range tb.want {
				if err := tb.m.Put(bpf.FlowKey(bpf.FlowGroup(unix.IPPROTO_UDP, a.Listener), a.Client), uint32(0)); err != nil {
					t.Fatal(err)
				}
			}
		}
		e.shield, e.allocs, e.nodeAllocs = s, maps.Clone(allocs), maps.Clone(nodeAllocs)
		if m != nil {
			m.SetEnv(e.modelEnv())
		}
	}
	write(s, allocs, nodeAllocs)
	t.Cleanup(func() { write(model.Shield{}, nil, nil) })
}

// stunMessage is a STUN header of the given type (class and method bits as on
// the wire) whose length field says length, followed by length bytes, and
// with the magic cookie when cookie.
func stunMessage(typ uint16, length int, cookie bool) []byte {
	b := make([]byte, 20+length)
	binary.BigEndian.PutUint16(b[0:], typ)
	binary.BigEndian.PutUint16(b[2:], uint16(length))
	if cookie {
		binary.BigEndian.PutUint32(b[4:], 0x2112A442)
	}
	copy(b[8:20], "transaction1")
	for i := 20; i < len(b); i++ {
		b[i] = byte(i)
	}
	return b
}

// shieldRow is one datagram to a listener port with the shield it meets and
// the reason both engines must give (the verdict follows from it: the
// shield's reasons drop, the rest pass or relay).
type shieldRow struct {
	name    string
	shield  model.Shield
	allocs  map[model.Allocation]bool // alloc_flows
	node    map[model.Allocation]bool // node_flows
	src     netip.AddrPort
	dst     string // the destination address (listener port 3478 unless dstPort)
	dstPort uint16
	payload []byte
	want    bpf.RelayReason
}

func shieldRows() []shieldRow {
	on := model.Shield{Junk: true, Allocations: true}
	stranger := ap("10.100.0.9:41000")
	stranger6 := ap("[fd00:100::9]:41000")
	bound := bindings["redirect"]
	has := func(l, c netip.AddrPort) map[model.Allocation]bool {
		return map[model.Allocation]bool{{Listener: l, Client: c}: true}
	}
	cd := func(ch uint16, n, pad int) []byte {
		return append(packet.ChannelData(ch, data(n), nil), make([]byte, pad)...)
	}
	// A ChannelData header whose length runs past the payload: not
	// ChannelData to pion/turn, nor a STUN header.
	over := []byte{0x40, 0x00, 0x01, 0x00, 1, 2, 3, 4}
	return []shieldRow{
		{name: "channeldata/no-allocation", shield: on, src: stranger, dst: "10.100.0.1", payload: cd(0x4000, 100, 0),
			want: bpf.RelayReasonREASON_NO_ALLOCATION},
		{name: "channeldata/no-allocation/ipv6", shield: on, src: stranger6, dst: "fd00:100::1", payload: cd(0x4000, 100, 0),
			want: bpf.RelayReasonREASON_NO_ALLOCATION},
		// The allocation on another listener socket (the specific one of
		// the same port) is not this one's.
		{name: "channeldata/allocation-on-other-socket", shield: on, allocs: has(specific4, stranger), src: stranger, dst: "10.100.0.1",
			payload: cd(0x4000, 100, 0), want: bpf.RelayReasonREASON_NO_ALLOCATION},
		// An allocation without this channel: pion/turn's to discard (or to
		// relay, should the binding be there and not offloaded).
		{name: "channeldata/allocation/unbound-channel", shield: on, allocs: has(wildcard4, stranger), src: stranger, dst: "10.100.0.1",
			payload: cd(0x4000, 100, 0), want: bpf.RelayReasonREASON_NO_CHANNEL},
		{name: "channeldata/allocation/ipv6", shield: on, allocs: has(wildcard6, stranger6), src: stranger6, dst: "fd00:100::1",
			payload: cd(0x4000, 100, 0), want: bpf.RelayReasonREASON_NO_CHANNEL},
		// Another daemon's allocation (the steering's steer_flows).
		{name: "channeldata/node-allocation", shield: on, node: has(wildcard4, stranger), src: stranger, dst: "10.100.0.1",
			payload: cd(0x4000, 100, 0), want: bpf.RelayReasonREASON_NO_CHANNEL},
		{name: "channeldata/allocations-not-tested", shield: model.Shield{Junk: true}, src: stranger, dst: "10.100.0.1",
			payload: cd(0x4000, 100, 0), want: bpf.RelayReasonREASON_NO_CHANNEL},
		{name: "channeldata/shield-off", src: stranger, dst: "10.100.0.1", payload: cd(0x4000, 100, 0),
			want: bpf.RelayReasonREASON_NO_CHANNEL},
		{name: "channeldata/bound", shield: on, src: bound.Client, dst: "10.100.0.1", payload: cd(bound.Channel, 100, 0),
			want: bpf.RelayReasonREASON_RELAY_C2P_REDIRECT},
		// ChannelData to pion/turn, which the kernel path does not relay.
		{name: "channeldata/long-padding/no-allocation", shield: on, src: stranger, dst: "10.100.0.1", payload: cd(0x4000, 10, 90),
			want: bpf.RelayReasonREASON_NO_ALLOCATION},
		{name: "channeldata/long-padding/allocation", shield: on, allocs: has(wildcard4, stranger), src: stranger, dst: "10.100.0.1",
			payload: cd(0x4000, 10, 90), want: bpf.RelayReasonREASON_MALFORMED_CHANNEL_DATA},
		{name: "channeldata/last-channel/no-allocation", shield: on, src: stranger, dst: "10.100.0.1", payload: cd(0x7fff, 100, 0),
			want: bpf.RelayReasonREASON_NO_ALLOCATION},
		{name: "channeldata/empty/no-allocation", shield: on, src: stranger, dst: "10.100.0.1", payload: cd(0x4000, 0, 0),
			want: bpf.RelayReasonREASON_NO_ALLOCATION},
		{name: "channeldata/length-beyond", shield: on, src: stranger, dst: "10.100.0.1", payload: over,
			want: bpf.RelayReasonREASON_NOT_TURN},
		{name: "junk/bytes", shield: on, src: stranger, dst: "10.100.0.1", payload: []byte("GET / HTTP/1.1\r\n\r\n"),
			want: bpf.RelayReasonREASON_NOT_TURN},
		{name: "junk/bytes/ipv6", shield: on, src: stranger6, dst: "fd00:100::1", payload: data(64),
			want: bpf.RelayReasonREASON_NOT_TURN},
		{name: "junk/one-byte", shield: on, src: stranger, dst: "10.100.0.1", payload: []byte{0},
			want: bpf.RelayReasonREASON_NOT_TURN},
		{name: "junk/empty", shield: on, src: stranger, dst: "10.100.0.1", payload: []byte{},
			want: bpf.RelayReasonREASON_NOT_TURN},
		{name: "junk/shield-off", src: stranger, dst: "10.100.0.1", payload: []byte("GET / HTTP/1.1\r\n\r\n"),
			want: bpf.RelayReasonREASON_MALFORMED_CHANNEL_DATA},
		// Through a NodePort (a wire port the node DNATs to the listener).
		{name: "junk/nodeport", shield: on, src: stranger, dst: "10.100.0.1", dstPort: nodePort, payload: data(64),
			want: bpf.RelayReasonREASON_NOT_TURN},
		// Not for a listener socket: the kernel forwards it or gives it to
		// whoever it is for.
		{name: "junk/not-a-listener-address", shield: on, src: stranger, dst: "10.100.0.42", payload: data(64),
			want: bpf.RelayReasonREASON_STUN},
		{name: "channeldata/not-a-listener-address", shield: on, src: stranger, dst: "10.100.0.42", payload: cd(0x4000, 100, 0),
			want: bpf.RelayReasonREASON_NOT_LISTENER_ADDR},
		{name: "stun/bad-cookie", shield: on, src: stranger, dst: "10.100.0.1", payload: stunMessage(0x0003, 8, false),
			want: bpf.RelayReasonREASON_NOT_TURN},
		{name: "stun/length-beyond", shield: on, src: stranger, dst: "10.100.0.1", payload: stunMessage(0x0003, 8, true)[:24],
			want: bpf.RelayReasonREASON_NOT_TURN},
		{name: "stun/short-header", shield: on, src: stranger, dst: "10.100.0.1", payload: stunMessage(0x0001, 0, true)[:19],
			want: bpf.RelayReasonREASON_NOT_TURN},
		// What pion/turn answers passes, whatever its attributes.
		{name: "stun/binding-request", shield: on, src: stranger, dst: "10.100.0.1", payload: stunMessage(0x0001, 0, true),
			want: bpf.RelayReasonREASON_STUN},
		{name: "stun/binding-request/ipv6", shield: on, src: stranger6, dst: "fd00:100::1", payload: stunMessage(0x0001, 0, true),
			want: bpf.RelayReasonREASON_STUN},
		{name: "stun/allocate-request", shield: on, src: stranger, dst: "10.100.0.1", payload: stunMessage(0x0003, 8, true),
			want: bpf.RelayReasonREASON_STUN},
		{name: "stun/refresh-request", shield: on, src: stranger, dst: "10.100.0.1", payload: stunMessage(0x0004, 8, true),
			want: bpf.RelayReasonREASON_STUN},
		{name: "stun/create-permission-request", shield: on, src: stranger, dst: "10.100.0.1", payload: stunMessage(0x0008, 8, true),
			want: bpf.RelayReasonREASON_STUN},
		{name: "stun/channel-bind-request", shield: on, src: stranger, dst: "10.100.0.1", payload: stunMessage(0x0009, 8, true),
			want: bpf.RelayReasonREASON_STUN},
		{name: "stun/send-indication", shield: on, src: stranger, dst: "10.100.0.1", payload: stunMessage(0x0016, 8, true),
			want: bpf.RelayReasonREASON_STUN},
		// Trailing bytes past the STUN length: stun decodes the header's
		// length and ignores them.
		{name: "stun/trailing-bytes", shield: on, src: stranger, dst: "10.100.0.1", payload: append(stunMessage(0x0003, 8, true), 1, 2, 3),
			want: bpf.RelayReasonREASON_STUN},
		// stun reads the method without the type's top two bits: 0x8001 is
		// a Binding request to pion/turn (0x4001 would be ChannelData).
		{name: "stun/binding-request/top-bits-10", shield: on, src: stranger, dst: "10.100.0.1", payload: stunMessage(0x8001, 0, true),
			want: bpf.RelayReasonREASON_STUN},
		{name: "stun/binding-request/top-bits-01", shield: on, src: stranger, dst: "10.100.0.1", payload: stunMessage(0x4001, 0, true),
			want: bpf.RelayReasonREASON_NO_ALLOCATION},
		{name: "stun/binding-success", shield: on, src: stranger, dst: "10.100.0.1", payload: stunMessage(0x0101, 8, true),
			want: bpf.RelayReasonREASON_STUN_UNHANDLED},
		{name: "stun/allocate-error", shield: on, src: stranger, dst: "10.100.0.1", payload: stunMessage(0x0113, 8, true),
			want: bpf.RelayReasonREASON_STUN_UNHANDLED},
		{name: "stun/data-indication", shield: on, src: stranger, dst: "10.100.0.1", payload: stunMessage(0x0017, 8, true),
			want: bpf.RelayReasonREASON_STUN_UNHANDLED},
		{name: "stun/binding-indication", shield: on, src: stranger, dst: "10.100.0.1", payload: stunMessage(0x0011, 0, true),
			want: bpf.RelayReasonREASON_STUN_UNHANDLED},
		// RFC 6062's Connect: pion/turn v4 has no handler.
		{name: "stun/connect-request", shield: on, src: stranger, dst: "10.100.0.1", payload: stunMessage(0x000a, 8, true),
			want: bpf.RelayReasonREASON_STUN_UNHANDLED},
		{name: "stun/unhandled/shield-off", src: stranger, dst: "10.100.0.1", payload: stunMessage(0x0101, 8, true),
			want: bpf.RelayReasonREASON_STUN},
	}
}

func (r shieldRow) frame() []byte {
	port := r.dstPort
	if port == 0 {
		port = listenerPort
	}
	f := packet.Frame{DstMAC: [6]byte{0x02, 0xaa}, SrcMAC: clientMAC, TTL: 63, ID: 0x1234, FragOff: 0x4000,
		Src: r.src, Dst: netip.AddrPortFrom(netip.MustParseAddr(r.dst), port), Payload: r.payload}
	return f.Marshal()
}

// TestShieldGoldenPackets runs every shieldRows row twice through the XDP
// program and the model.
func TestShieldGoldenPackets(t *testing.T) {
	e := newEnv(t)
	bs := sortedBindings()
	e.replace(t, bs)
	m := e.newModel(t, bs)
	for _, r := range shieldRows() {
		t.Run(r.name, func(t *testing.T) {
			e.setShield(t, m, r.shield, r.allocs, r.node)
			for run := 0; run < 2; run++ {
				got, res := e.check(t, m, "a0", r.frame())
				if got.reason != r.want {
					t.Errorf("run %d: %s, want %s", run, reasonName(got.reason), reasonName(r.want))
				}
				if drops := r.want >= bpf.RelayReasonREASON_NO_ALLOCATION && r.want <= bpf.RelayReasonREASON_STUN_UNHANDLED; drops != (res.Verdict == model.Drop) {
					t.Errorf("run %d: %v for %s", run, res.Verdict, reasonName(r.want))
				}
			}
		})
	}
}

// withoutXDP marks the named interface as one the XDP program is not
// attached to (restored when t ends): the TC engine runs the shield only
// there.
func (e *env) withoutXDP(t testing.TB, m *model.Model, name string) {
	t.Helper()
	c := *e.ifaces[name].caps
	c.Native, c.Generic = false, false
	e.setCaps(t, m, name, &c)
}

// TestTCShieldGoldenPackets: the same rows through the TC engine, arriving
// where XDP is not attached, which shoots what XDP drops.
func TestTCShieldGoldenPackets(t *testing.T) {
	e := newTCEnv(t)
	bs := sortedBindings()
	e.replace(t, bs)
	m := e.newModel(t, bs)
	e.withoutXDP(t, m, "a0")
	for _, r := range shieldRows() {
		t.Run(r.name, func(t *testing.T) {
			e.setShield(t, m, r.shield, r.allocs, r.node)
			for run := 0; run < 2; run++ {
				got, res := e.checkTC(t, m, "a0", r.frame(), model.SKB{Checksum: model.ChecksumNone})
				if got.reason != r.want {
					t.Errorf("run %d: %s, want %s", run, tcReasonName(got.reason), tcReasonName(r.want))
				}
				if drops := r.want >= bpf.RelayReasonREASON_NO_ALLOCATION && r.want <= bpf.RelayReasonREASON_STUN_UNHANDLED; drops != (res.Verdict == model.TCShot) {
					t.Errorf("run %d: %v for %s", run, res.Verdict, tcReasonName(r.want))
				}
			}
		})
	}
}

// TestShieldAdmission: requests of clients without an allocation are admitted
// at their source address's rate (model rule 13): at one per second with a
// burst of two, a source's first two requests pass and its third is dropped;
// another source, a client with an allocation, and an indication from the
// throttled source are not charged. Both engines, against the model.
func TestShieldAdmission(t *testing.T) {
	t.Run("xdp", func(t *testing.T) {
		e := newEnv(t)
		admissionSteps(t, e, func(frame []byte, m *model.Model) (bpf.RelayReason, bool) {
			got, res := e.check(t, m, "a0", frame)
			return got.reason, res.Verdict == model.Drop
		})
	})
	t.Run("tc", func(t *testing.T) {
		e := newTCEnv(t)
		admissionSteps(t, e.env, func(frame []byte, m *model.Model) (bpf.RelayReason, bool) {
			e.withoutXDP(t, m, "a0")
			got, res := e.checkTC(t, m, "a0", frame, model.SKB{Checksum: model.ChecksumNone})
			return got.reason, res.Verdict == model.TCShot
		})
	})
}

func admissionSteps(t *testing.T, e *env, check func([]byte, *model.Model) (bpf.RelayReason, bool)) {
	bs := sortedBindings()
	e.replace(t, bs)
	m := e.newModel(t, bs)
	flooder, other, member := ap("10.100.0.9:41000"), ap("10.100.0.10:41000"), ap("10.100.0.11:41000")
	flooder6 := ap("[fd00:100::9]:41000")
	e.setShield(t, m, model.Shield{Junk: true, Allocations: true,
		Admission: model.Admission{Cost: uint64(time.Second), Burst: uint64(time.Second)}},
		map[model.Allocation]bool{{Listener: wildcard4, Client: member}: true}, nil)
	allocate := stunMessage(0x0003, 8, true)
	binding := stunMessage(0x0001, 0, true)
	send := stunMessage(0x0016, 8, true)
	row := func(src netip.AddrPort, dst string, msg []byte) shieldRow {
		return shieldRow{src: src, dst: dst, payload: msg}
	}
	steps := []struct {
		name string
		row  shieldRow
		drop bool
	}{
		{"first", row(flooder, "10.100.0.1", allocate), false},
		{"second (the burst)", row(flooder, "10.100.0.1", binding), false},
		{"third: over", row(flooder, "10.100.0.1", allocate), true},
		{"fourth: over, charged nothing", row(flooder, "10.100.0.1", binding), true},
		{"an indication", row(flooder, "10.100.0.1", send), false},
		{"another port of the address", row(ap("10.100.0.9:41001"), "10.100.0.1", allocate), true},
		{"another address", row(other, "10.100.0.1", allocate), false},
		{"a client with an allocation", row(member, "10.100.0.1", allocate), false},
		{"a client with an allocation, again", row(member, "10.100.0.1", allocate), false},
		{"a client with an allocation, a third time", row(member, "10.100.0.1", allocate), false},
		{"ipv6 first", row(flooder6, "fd00:100::1", allocate), false},
		{"ipv6 second", row(flooder6, "fd00:100::1", allocate), false},
		{"ipv6 third: over", row(flooder6, "fd00:100::1", allocate), true},
	}
	for _, s := range steps {
		reason, dropped := check(s.row.frame(), m)
		want := bpf.RelayReasonREASON_STUN
		if s.drop {
			want = bpf.RelayReasonREASON_ADMISSION
		}
		if reason != want || dropped != s.drop {
			t.Errorf("%s: %s (dropped %v), want %s", s.name, reasonName(reason), dropped, reasonName(want))
		}
	}
}

// TestTCShieldOnceWithXDP: on an interface where XDP runs (or of which nothing
// is known) the TC engine leaves the shield to XDP's, which passed what
// reaches it: junk and a stranger's ChannelData go on untouched, and a
// request is not charged a second time.
func TestTCShieldOnceWithXDP(t *testing.T) {
	e := newTCEnv(t)
	bs := sortedBindings()
	e.replace(t, bs)
	m := e.newModel(t, bs)
	e.setShield(t, m, model.Shield{Junk: true, Allocations: true, Admission: model.Admission{Cost: uint64(time.Second)}}, nil, nil)
	stranger := ap("10.100.0.9:41000")
	rows := []shieldRow{
		{src: stranger, dst: "10.100.0.1", payload: []byte("GET / HTTP/1.1\r\n\r\n"), want: bpf.RelayReasonREASON_MALFORMED_CHANNEL_DATA},
		{src: stranger, dst: "10.100.0.1", payload: packet.ChannelData(0x4000, data(100), nil), want: bpf.RelayReasonREASON_NO_CHANNEL},
		{src: stranger, dst: "10.100.0.1", payload: stunMessage(0x0003, 8, true), want: bpf.RelayReasonREASON_STUN},
		{src: stranger, dst: "10.100.0.1", payload: stunMessage(0x0003, 8, true), want: bpf.RelayReasonREASON_STUN},
	}
	for _, caps := range []string{"native", "generic", "none"} {
		t.Run(caps, func(t *testing.T) {
			switch caps {
			case "generic":
				c := *e.ifaces["a0"].caps
				c.Native, c.Generic = false, true
				e.setCaps(t, m, "a0", &c)
			case "none":
				e.setCaps(t, m, "a0", nil)
			}
			for i, r := range rows {
				got, res := e.checkTC(t, m, "a0", r.frame(), model.SKB{Checksum: model.ChecksumNone})
				if got.reason != r.want || res.Verdict == model.TCShot {
					t.Errorf("%d: %s (%v), want %s", i, tcReasonName(got.reason), res.Verdict, tcReasonName(r.want))
				}
			}
		})
	}
}
