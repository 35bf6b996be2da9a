package model_test

import (
	"net/netip"
	"testing"

	"github.com/l7mp/stunnerd-xdp/bpf"
	"github.com/l7mp/stunnerd-xdp/internal/shield"
	"github.com/l7mp/stunnerd-xdp/test/model"
	"github.com/l7mp/stunnerd-xdp/test/packet"
)

// FuzzUserspaceShieldVsModel: the read loops' shield (internal/shield) classes
// a datagram as the kernel path's specification does (rule 12): what the
// model drops for no allocation is ChannelData to it, what it drops as not
// TURN or unhandled STUN is that, and what it passes is a request or an
// indication pion/turn handles.
func FuzzUserspaceShieldVsModel(f *testing.F) {
	f.Add([]byte{0x40, 0, 0, 0})
	f.Add([]byte{0, 1, 0, 0, 0x21, 0x12, 0xa4, 0x42, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12})
	f.Add([]byte("junk"))
	listener, dst := netip.MustParseAddrPort("0.0.0.0:3478"), netip.MustParseAddrPort("10.0.0.1:3478")
	m, err := model.New(model.Env{ListenerPorts: []uint16{3478}, MinRelayPort: 49152, MaxRelayPort: 65535,
		Destinations: map[netip.AddrPort]netip.AddrPort{dst: listener},
		Shield:       model.Shield{Junk: true, Allocations: true}}, nil)
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		if len(b) > 1400 {
			b = b[:1400]
		}
		frame := packet.Frame{TTL: 64, Src: netip.MustParseAddrPort("10.0.0.2:4000"), Dst: dst, Payload: b}.Marshal()
		res := m.Process(1, frame)
		want := map[shield.Class]bpf.RelayReason{shield.ChannelData: bpf.RelayReasonREASON_NO_ALLOCATION,
			shield.NotTURN: bpf.RelayReasonREASON_NOT_TURN, shield.Unhandled: bpf.RelayReasonREASON_STUN_UNHANDLED}
		c := shield.Classify(b)
		if r, drops := want[c]; drops != (res.Verdict == model.Drop) || drops && r != res.Reason {
			t.Fatalf("%x: class %d; the model: %v %v", b, c, res.Verdict, res.Reason)
		}
	})
}
