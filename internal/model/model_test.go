package model_test

import (
	"bytes"
	"encoding/binary"
	"net/netip"
	"testing"

	"github.com/l7mp/stunnerd-xdp/bpf"
	"github.com/l7mp/stunnerd-xdp/internal/channelmap"
	"github.com/l7mp/stunnerd-xdp/internal/model"
	"github.com/l7mp/stunnerd-xdp/internal/packet"
)

// These tests pin the model's own reading of the spec, unprivileged: the
// privileged tests in bpf/ then hold the program to the model.

var (
	clientMAC = [6]byte{2, 0, 0, 0, 0x10, 2}
	peerMAC   = [6]byte{2, 0, 0, 0, 0x20, 2}
	aMAC      = [6]byte{2, 0, 0, 0, 0xa0, 1}
	bMAC      = [6]byte{2, 0, 0, 0, 0xb0, 1}
)

func testEnv() model.Env {
	return model.Env{
		ListenerPorts: []uint16{3478}, MinRelayPort: 49152, MaxRelayPort: 65535,
		Interfaces: []model.Interface{
			{Name: "a", Index: 2, MAC: aMAC, Addr: netip.MustParsePrefix("10.100.0.1/24"), MTU: 1500, Forwarding: true, Attached: true,
				Neighbours: map[netip.Addr][6]byte{netip.MustParseAddr("10.100.0.2"): clientMAC}},
			{Name: "b", Index: 3, MAC: bMAC, Addr: netip.MustParsePrefix("10.200.0.1/24"), MTU: 100, Forwarding: true, Attached: true,
				Neighbours: map[netip.Addr][6]byte{netip.MustParseAddr("10.200.0.2"): peerMAC}},
		},
		Unreachable: []netip.Prefix{netip.MustParsePrefix("10.200.0.128/25")},
	}
}

var binding = channelmap.Binding{
	Client: netip.MustParseAddrPort("10.100.0.2:40000"), ListenerPort: 3478, Channel: 0x4000,
	Peer: netip.MustParseAddrPort("10.200.0.2:5001"), Relay: netip.MustParseAddrPort("10.200.0.1:50000"),
}

func newModel(t *testing.T, bs ...channelmap.Binding) *model.Model {
	t.Helper()
	m, err := model.New(testEnv(), bs)
	if err != nil {
		t.Fatal(err)
	}
	return m
}

func clientFrame(dst string, payload []byte) packet.Frame {
	return packet.Frame{DstMAC: aMAC, SrcMAC: clientMAC, TTL: 1, ID: 7, FragOff: 0x4000, TOS: 0xb8,
		Src: binding.Client, Dst: netip.AddrPortFrom(netip.MustParseAddr(dst), 3478), Payload: payload}
}

func TestClientToPeer(t *testing.T) {
	m := newModel(t, binding)
	d := []byte("hello, peer")
	in := clientFrame("10.100.0.1", packet.ChannelData(0x4000, d, []byte{9}))
	res := m.Process(2, in.Marshal())
	if res.Verdict != model.Redirect || res.Reason != bpf.RelayReasonREASON_RELAY_C2P_REDIRECT {
		t.Fatalf("%v %v, want REDIRECT relay_c2p_redirect", res.Verdict, res.Reason)
	}
	want := packet.Frame{DstMAC: peerMAC, SrcMAC: bMAC, TTL: 64, ID: 7, FragOff: 0x4000, TOS: 0xb8,
		Src: binding.Relay, Dst: binding.Peer, Payload: d}.Marshal()
	if !bytes.Equal(res.Frame, want) {
		t.Fatalf("output\n got %x\nwant %x", res.Frame, want)
	}
	if res.Learned == nil || res.Learned.Addr != netip.MustParseAddr("10.100.0.1") {
		t.Fatalf("learned %+v, want 10.100.0.1", res.Learned)
	}
	if res.Counted == nil || *res.Counted != binding.Key() || res.DataLen != len(d) {
		t.Fatalf("counted %v/%d", res.Counted, res.DataLen)
	}
}

func TestPeerToClientWaitsForListener(t *testing.T) {
	m := newModel(t, binding)
	in := packet.Frame{SrcMAC: peerMAC, TTL: 9, Src: binding.Peer, Dst: binding.Relay, Payload: []byte{1, 2, 3}}
	if res := m.Process(3, in.Marshal()); res.Reason != bpf.RelayReasonREASON_CLIENT_ADDR_UNKNOWN {
		t.Fatalf("before learning: %v", res.Reason)
	}
	m.Process(2, clientFrame("192.0.2.10", packet.ChannelData(0x4000, nil, nil)).Marshal()) // a VIP
	res := m.Process(3, in.Marshal())
	want := packet.Frame{DstMAC: clientMAC, SrcMAC: aMAC, TTL: 64,
		Src: netip.MustParseAddrPort("192.0.2.10:3478"), Dst: binding.Client, Payload: packet.ChannelData(0x4000, []byte{1, 2, 3}, nil)}.Marshal()
	if res.Verdict != model.Redirect || !bytes.Equal(res.Frame, want) {
		t.Fatalf("after learning: %v %v\n got %x\nwant %x", res.Verdict, res.Reason, res.Frame, want)
	}
}

// A wrong UDP checksum stays wrong by the same amount; an absent one stays absent.
func TestChecksumErrorCarriedOver(t *testing.T) {
	m := newModel(t, binding)
	in := clientFrame("10.100.0.1", packet.ChannelData(0x4000, []byte("odd"), []byte{1}))
	good := m.Process(2, in.Marshal()).Frame
	if _, err := packet.Parse(good); err != nil {
		t.Fatal(err)
	}
	bad := in.Marshal()
	off := packet.EthLen + packet.IPv4Len + 6
	binary.BigEndian.PutUint16(bad[off:], binary.BigEndian.Uint16(bad[off:])^0x0100)
	if _, err := packet.Parse(m.Process(2, bad).Frame); err == nil {
		t.Fatal("a damaged datagram was relayed with a valid checksum")
	}
	in.NoUDPChecksum = true
	if out := m.Process(2, in.Marshal()).Frame; binary.BigEndian.Uint16(out[off:]) != 0 {
		t.Fatal("an absent checksum was filled in")
	}
}

func TestPassReasons(t *testing.T) {
	cd := packet.ChannelData(0x4000, make([]byte, 10), nil)
	ok := clientFrame("10.100.0.1", cd).Marshal()
	far := binding
	far.Channel, far.Peer, far.Relay = 0x4001, netip.MustParseAddrPort("10.200.0.200:5001"), netip.MustParseAddrPort("10.200.0.1:50001")
	big := binding
	big.Channel, big.Relay = 0x4002, netip.MustParseAddrPort("10.200.0.1:50002")
	big.Peer = netip.MustParseAddrPort("10.200.0.3:5001")
	for _, c := range []struct {
		name    string
		ingress int
		frame   []byte
		reason  bpf.RelayReason
	}{
		{"shorter than ethernet", 2, ok[:13], bpf.RelayReasonREASON_NOT_IPV4},
		{"empty", 2, nil, bpf.RelayReasonREASON_NOT_IPV4},
		{"trailer is not the message", 2, clientFrame("10.100.0.1", nil).Marshal(), bpf.RelayReasonREASON_MALFORMED_CHANNEL_DATA},
		{"forwarding off", 9, ok, bpf.RelayReasonREASON_FIB_FWD_DISABLED},
		{"unreachable beats connected", 2, clientFrame("10.100.0.1", packet.ChannelData(0x4001, nil, nil)).Marshal(), bpf.RelayReasonREASON_FIB_NOT_FORWARDED},
		{"mtu before neighbour", 2, clientFrame("10.100.0.1", packet.ChannelData(0x4002, make([]byte, 73), nil)).Marshal(), bpf.RelayReasonREASON_FIB_FRAG_NEEDED},
		{"no neighbour", 2, clientFrame("10.100.0.1", packet.ChannelData(0x4002, nil, nil)).Marshal(), bpf.RelayReasonREASON_FIB_NO_NEIGH},
	} {
		t.Run(c.name, func(t *testing.T) {
			m := newModel(t, binding, far, big)
			res := m.Process(c.ingress, c.frame)
			if res.Verdict != model.Pass || res.Reason != c.reason || !bytes.Equal(res.Frame, c.frame) {
				t.Fatalf("%v %v, want PASS %v untouched", res.Verdict, res.Reason, c.reason)
			}
		})
	}
}

func TestNewRejectsInconsistentBindings(t *testing.T) {
	dup := binding
	dup.Peer = netip.MustParseAddrPort("10.200.0.9:1")
	if _, err := model.New(testEnv(), []channelmap.Binding{binding, dup}); err == nil {
		t.Fatal("two bindings for one client key accepted")
	}
	v6 := binding
	v6.Peer = netip.MustParseAddrPort("[2001:db8::1]:1")
	if _, err := model.New(testEnv(), []channelmap.Binding{v6}); err == nil {
		t.Fatal("an IPv6 peer accepted")
	}
}
