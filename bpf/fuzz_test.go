package bpf_test

import (
	"bufio"
	"bytes"
	"encoding/hex"
	"go/build"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/l7mp/stunnerd-xdp/internal/channelmap"
	"github.com/l7mp/stunnerd-xdp/test/model"
	"github.com/l7mp/stunnerd-xdp/test/packet"
)

// Differential fuzzing of the XDP program against the reference model. Both
// targets run every input through BPF_PROG_RUN in the shared environment
// (newEnv) and through the model, and fail on any difference (env.check). Run
// one for a while with
//
//	go test ./bpf -run '^$' -fuzz '^FuzzRelayVsModel$' -fuzztime 30s -fuzzminimizetime 3s
//	go test ./bpf -run '^$' -fuzz '^FuzzRelayBindingsVsModel$' -fuzztime 30s -fuzzminimizetime 3s
//
// (as root; an execution costs ~100 syscalls, so the default minimization
// budget of 60 s per new input stalls every worker for a minute at a time).
//
// Without -fuzz, `go test` runs their seeds and bpf/testdata/fuzz as tests.

// FuzzRelayVsModel: any frame, arriving on any interface of the environment,
// against the golden bindings. Seeded with every golden and hostile row and with
// pion/turn's ChannelData fuzz corpus.
func FuzzRelayVsModel(f *testing.F) {
	e := newEnv(f)
	bs := sortedBindings()
	e.replace(f, bs)
	for _, c := range append(goldenCases(e), hostileCases(e)...) {
		f.Add(c.in, ingressIndex(c.ingress))
	}
	// The same rows with the ingress's dev_caps varied (see fuzzCapsByte).
	redirectIn := fromClient(bindings["redirect"], "10.100.0.1", packet.ChannelData(bindings["redirect"].Channel, data(1480), nil))
	for _, c := range []uint8{1, 2, 3, 0x04, 0x0c, 0x1c} {
		f.Add(redirectIn.Marshal(), ingressIndex("a0")|c<<3)
	}
	redirect := bindings["redirect"]
	for _, msg := range pionChannelData(f) {
		f.Add(fromClient(redirect, "10.100.0.1", msg).Marshal(), uint8(0))
		// The same message on the bound channel and cut to its own length plus
		// padding, so that it is relayed rather than refused for its tail.
		if len(msg) >= 4 {
			n := int(msg[2])<<8 | int(msg[3])
			relayable := packet.ChannelData(redirect.Channel, msg[4:min(len(msg), 4+n)], nil)
			f.Add(fromClient(redirect, "10.100.0.1", relayable).Marshal(), uint8(0))
		}
	}

	// The listener shield on, with the golden clients' allocations (as
	// pion/turn holds them) in the daemon's table: a stranger's ChannelData
	// and junk to a listener are dropped (model rule 12).
	e.setShield(f, nil, model.Shield{Junk: true, Allocations: true}, fuzzAllocations(bs, 0), fuzzAllocations(bs, 1))

	f.Fuzz(func(t *testing.T, frame []byte, ingress uint8) {
		// Bits 0-2 the ingress, 3-7 its dev_caps (fuzzCapsByte).
		name := ifaceNames[int(ingress&7)%len(ifaceNames)]
		if c := ingress >> 3; c != 0 {
			e.setCaps(t, nil, name, e.fuzzCapsByte(name, c))
		}
		m := e.newModel(t, bs)
		if len(frame) < minRunFrame || len(frame) > maxRunFrame {
			m.Process(e.ifaces[name].index, frame) // BPF_PROG_RUN refuses it; the model must not panic
			return
		}
		// The learned listener addresses are the only state a frame changes
		// besides counters (which check reads as deltas); check has compared
		// the kernel's with the model's, so only a learned one needs undoing.
		if _, res := e.check(t, m, name, frame); res.Learned != nil {
			e.restore(t, bs)
		}
	})
}

// FuzzRelayBindingsVsModel: varies the binding set as well. spec encodes up to
// eight bindings drawn from addresses that lead to every FIB outcome in the
// environment; the frame is built from one of them (pick), in either direction,
// to one of several destination addresses, with a fuzzed payload.
func FuzzRelayBindingsVsModel(f *testing.F) {
	e := newEnv(f)
	// spec bytes per binding: client host, client port, channel, peer
	// host<<4|port, relay addr<<4|port, listener address.
	seeds := []struct {
		spec             []byte
		pick, dst, flags uint8
		payload          []byte
	}{
		{[]byte{0, 0, 0, 0x20, 0x10, 1}, 0, 0, 1, data(100)},                   // redirect c2p
		{[]byte{0, 0, 0, 0x20, 0x10, 1}, 1, 0, 0, data(100)},                   // redirect p2c
		{[]byte{0, 0, 1, 0x10, 0x00, 1}, 0, 0, 1, data(10)},                    // XDP_TX c2p
		{[]byte{0, 0, 1, 0x10, 0x00, 1}, 1, 0, 0, data(10)},                    // XDP_TX p2c
		{[]byte{0, 0, 0, 0x20, 0x10, 0}, 1, 0, 0, data(10)},                    // listener unknown
		{[]byte{0, 0, 0, 0x20, 0x10, 0}, 0, 1, 1, data(10)},                    // learn a VIP
		{[]byte{0, 0, 0, 0x40, 0x20, 1}, 0, 0, 1, data(80)},                    // MTU 100
		{[]byte{4, 0, 0, 0x20, 0x10, 3}, 1, 0, 0, data(69)},                    // client behind MTU 100
		{[]byte{0, 0, 0, 0x50, 0x20, 1}, 0, 0, 1, data(10)},                    // no neighbour, MTU 100
		{[]byte{6, 0, 0, 0x20, 0x10, 4}, 0, 2, 1, data(10)},                    // forwarding off on ingress d0
		{[]byte{0, 0, 0, 0x70, 0x40, 1}, 0, 0, 1, data(10)},                    // egress not attached
		{[]byte{0, 0, 0, 0x80, 0x10, 1}, 0, 0, 1, data(10)},                    // unreachable
		{[]byte{0, 0, 0, 0xa0, 0x10, 1}, 0, 0, 1, data(10)},                    // broadcast peer
		{[]byte{0, 0, 0, 0x20, 0x10, 1, 0, 1, 0, 0x21, 0x11, 0}, 2, 0, 1, nil}, // two clients' ports
		{[]byte{0, 0, 4, 0x20, 0x10, 1}, 0, 0, 1 | 3<<1, data(5)},              // channel 0x7fff, padding 3
		// IPv6 clients (client host byte 0x80 and up: the IPv6 pool).
		{[]byte{0x80, 0, 0, 0x20, 0x10, 1}, 0, 0, 1, data(100)},                       // v6 redirect c2p
		{[]byte{0x80, 0, 0, 0x20, 0x10, 1}, 1, 0, 0, data(100)},                       // v6 redirect p2c
		{[]byte{0x81, 0, 1, 0x10, 0x00, 1}, 0, 0, 1 | 2<<1, data(10)},                 // v6 XDP_TX c2p, padding 2
		{[]byte{0x81, 0, 1, 0x10, 0x00, 1}, 1, 0, 0, data(10)},                        // v6 XDP_TX p2c
		{[]byte{0x80, 0, 0, 0x20, 0x10, 0}, 1, 0, 0, data(10)},                        // v6 listener unknown
		{[]byte{0x80, 0, 0, 0x20, 0x10, 0}, 0, 1, 1, data(10)},                        // v6 learn a VIP
		{[]byte{0x80, 0, 0, 0x20, 0x10, 0}, 0, 5, 1, data(10)},                        // v6 learn ::ffff:10.100.0.1
		{[]byte{0x80, 0, 0, 0x20, 0x10, 0}, 0, 4, 1, data(10)},                        // v6 to ff02::1: not learned
		{[]byte{0x80, 0, 0, 0x20, 0x10, 1}, 1, 0, 8, data(10)},                        // v6 p2c without checksum
		{[]byte{0x80, 0, 0, 0x20, 0x10, 1}, 0, 0, 1 | 8, data(10)},                    // v6 c2p without checksum
		{[]byte{0x83, 0, 0, 0x20, 0x10, 3}, 1, 0, 0, data(1229)},                      // v6 client behind MTU 1280
		{[]byte{0x83, 0, 0, 0x20, 0x10, 3}, 1, 0, 0, data(1228)},                      // just fits
		{[]byte{0x82, 0, 0, 0x20, 0x10, 1}, 1, 0, 0, data(10)},                        // v6 no neighbour
		{[]byte{0x84, 0, 0, 0x20, 0x10, 4}, 0, 2, 1, data(10)},                        // v6 client on d0: IPv4 forwarding off
		{[]byte{0x84, 0, 0, 0x20, 0x10, 4}, 1, 0, 0, data(10)},                        // its replies: IPv6 forwarding on
		{[]byte{0x80, 0, 0, 0x70, 0x40, 1}, 0x41, 4, 0, data(10)},                     // peer on e0: IPv6 forwarding off
		{[]byte{0x85, 0, 0, 0x20, 0x10, 1}, 1, 0, 0, data(10)},                        // v6 client behind e0, not attached
		{[]byte{0x86, 0, 0, 0x20, 0x10, 1}, 1, 0, 0, data(10)},                        // v6 unreachable
		{[]byte{0x88, 0, 0, 0x20, 0x10, 1}, 1, 0, 0, data(10)},                        // v6 no route
		{[]byte{0x80, 0, 0, 0x20, 0x10, 1, 0, 0, 0, 0x21, 0x11, 1}, 2, 0, 1, data(3)}, // v4 and v6 twins of one port
		// A rate-limit byte after the bindings (see fuzzRateLimit).
		{[]byte{0, 0, 0, 0x20, 0x10, 1, 1}, 0, 0, 1, data(100)},     // packet limit, under it: relayed
		{[]byte{0, 0, 0, 0x20, 0x10, 1, 1 | 4}, 0, 0, 1, data(100)}, // over it: dropped
		{[]byte{0, 0, 0, 0x20, 0x10, 1, 2 | 4}, 1, 0, 0, data(100)}, // over it, pass
		{[]byte{0, 0, 0, 0x20, 0x10, 1, 3 | 4}, 1, 0, 0, data(100)}, // byte limit, over it
		{[]byte{0, 0, 0, 0x50, 0x20, 1, 1 | 4}, 0, 0, 1, data(10)},  // over it, no neighbour: the FIB first
		// dev_caps bytes for a0, b0, ... then the rate-limit byte (see fuzzCaps).
		{[]byte{0, 0, 0, 0x20, 0x10, 1, 0xc, 0x0, 0}, 0, 0, 1, data(100)},    // b0 transmits no XDP frame: passed
		{[]byte{0, 0, 0, 0x20, 0x10, 1, 0x0, 0xc, 0}, 1, 0, 0, data(100)},    // a0 neither, peer->client
		{[]byte{0, 0, 0, 0x20, 0x10, 1, 0x1, 0x0, 0}, 0, 0, 1, data(100)},    // generic a0: redirected anyway
		{[]byte{0, 0, 0, 0x20, 0x10, 1, 0x3, 0xc, 0}, 0, 0, 1, data(100)},    // nothing known of a0: as native
		{[]byte{0, 0, 1, 0x10, 0x00, 1, 0x4, 0}, 0, 0, 1, data(10)},          // XDP_TX, a0 without it
		{[]byte{0, 0, 1, 0x10, 0x00, 1, 0x1, 0}, 1, 0, 0, data(10)},          // XDP_TX, generic a0
		{[]byte{0, 0, 0, 0x20, 0x10, 1, 0x2c, 0xc, 0}, 0, 0, 1, data(1480)},  // 1516 bytes in, a0's MTU 1600
		{[]byte{0, 0, 0, 0x20, 0x10, 1, 0xc, 0xc, 0}, 0, 0, 1, data(1480)},   // over a0's MTU
		{[]byte{0, 0, 0, 0x20, 0x10, 1, 0xc, 0x3c, 0}, 1, 0, 0, data(1500)},  // over b0's MTU, peer->client
		{[]byte{0x80, 0, 0, 0x20, 0x10, 1, 0xc, 0x8, 0}, 0, 0, 1, data(100)}, // v6 client, b0 without XDP_XMIT
		// Reverse-path filtering (caps bit 7; ingress a0 unless the pick says
		// e0, see below): strict on a0, the client's way back.
		{[]byte{0, 0, 0, 0x20, 0x10, 1, 0x8c, 0x8c, 0}, 0, 0, 1, data(100)},    // c2p: passes the check
		{[]byte{0, 0, 0, 0x20, 0x10, 1, 0x8c, 0x8c, 0}, 1, 0, 0, data(100)},    // p2c on a0: the peer's way back is b0
		{[]byte{0, 0, 0, 0x20, 0x10, 1, 0x9c, 0x9c, 0}, 1, 0, 0, data(100)},    // loose: a way back exists
		{[]byte{12, 0, 0, 0x20, 0x10, 1, 0x9c, 0x9c, 0}, 0, 0, 1, data(100)},   // loose, a source without a route
		{[]byte{0x80, 0, 0, 0x20, 0x10, 1, 0x8c, 0x8c, 0}, 0, 0, 1, data(100)}, // IPv6: not checked
		// NodePort: the client sends to nodePort (dst bit 6), replies from it
		// (listener byte bit 6).
		{[]byte{0, 0, 0, 0x20, 0x10, 0}, 0, 0x40, 1, data(10)},     // learn the NodePort
		{[]byte{0, 0, 0, 0x20, 0x10, 0x41}, 0, 0x40, 1, data(100)}, // c2p to it
		{[]byte{0, 0, 0, 0x20, 0x10, 0x41}, 1, 0, 0, data(100)},    // p2c from it
		{[]byte{0, 0, 0, 0x20, 0x10, 0x41}, 0, 0, 1, data(100)},    // back to the listener port: learned
		{[]byte{0, 0, 0, 0x20, 0x10, 0x41}, 0, 0x42, 1, data(10)},  // a NodePort at an address not translated
		{[]byte{0x80, 0, 0, 0x20, 0x10, 0x41}, 1, 0, 0, data(100)}, // v6 p2c from it
		{[]byte{0x80, 0, 0, 0x20, 0x10, 0}, 0, 0x40, 1, data(100)}, // v6 learn it
		{[]byte{0, 0, 0, 0x20, 0x10, 0x41}, 1, 0, 0x10, data(10)},  // TTL 1 from the peer
	}
	for _, s := range seeds {
		ingress := uint8(0)
		if s.pick&0x40 != 0 { // the peer on e0
			ingress = ingressIndex("e0")
		}
		f.Add(s.spec, ingress, s.pick, s.dst, s.flags, s.payload)
	}
	for _, msg := range pionChannelData(f) {
		f.Add([]byte{0, 0, 0, 0x20, 0x10, 1}, uint8(0), uint8(0), uint8(0), uint8(0), msg)
	}

	// Bit 7 of ingress sets the flow caches aside for the input (as
	// channelmap does with many bindings): the model knows no caches, so
	// the program's answer must not depend on them either way.
	f.Add([]byte{0, 0, 0, 0x20, 0x10, 1}, uint8(0x80), uint8(0), uint8(0), uint8(1), data(100))
	f.Add([]byte{0, 0, 0, 0x20, 0x10, 1}, uint8(0x80), uint8(1), uint8(0), uint8(0), data(100))

	f.Fuzz(func(t *testing.T, spec []byte, ingress, pick, dst, flags uint8, payload []byte) {
		bs := decodeBindings(spec)
		e.replace(t, bs)
		e.fuzzCaps(t, spec)
		e.setFlowsAside(t, ingress&0x80 != 0)
		e.fuzzShield(t, bs, len(payload)+int(flags))
		m := e.newModel(t, bs)
		e.fuzzRateLimit(t, m, spec, bs)
		if len(payload) > maxRunFrame-64 {
			payload = payload[:maxRunFrame-64]
		}
		name := ifaceNames[int(ingress&0x7f)%len(ifaceNames)]
		e.check(t, m, name, fuzzFrame(bs, pick, dst, flags, payload))
	})
}

// fuzzShield sets the listener shield from a number the input gives: off,
// junk only, testing allocations too, or admitting requests as well, with the bindings' allocations split
// between the daemon's table and the node's.
func (e *env) fuzzShield(t *testing.T, bs []channelmap.Binding, n int) {
	switch n % 4 {
	case 1:
		e.setShield(t, nil, model.Shield{Junk: true}, nil, nil)
	case 2:
		e.setShield(t, nil, model.Shield{Junk: true, Allocations: true}, fuzzAllocations(bs, 0), fuzzAllocations(bs, 1))
	case 3:
		// Admission with no burst: a source's first request passes, what
		// follows within the second is dropped.
		e.setShield(t, nil, model.Shield{Junk: true, Allocations: true, Admission: model.Admission{Cost: uint64(time.Second)}},
			fuzzAllocations(bs, 0), fuzzAllocations(bs, 1))
	}
}

// fuzzAllocations are the allocations of every other binding, from the
// first (0) or the second (1): those of the daemon's table and the node's.
func fuzzAllocations(bs []channelmap.Binding, from int) map[model.Allocation]bool {
	out := map[model.Allocation]bool{}
	for i := from; i < len(bs); i += 2 {
		out[model.Allocation{Listener: bs[i].Listener, Client: bs[i].Client}] = true
	}
	return out
}

// fuzzCaps reads dev_caps bytes after the binding specs: of the bytes that
// follow the last whole spec, all but the last (the rate-limit byte) give the
// interfaces a0, b0, ... their dev_caps (fuzzCapsByte) for this input.
func (e *env) fuzzCaps(t *testing.T, spec []byte) {
	tail := spec[len(spec)/6*6:]
	for i := 0; i+1 < len(tail) && i < len(ifaceNames); i++ {
		e.setCaps(t, nil, ifaceNames[i], e.fuzzCapsByte(ifaceNames[i], tail[i]))
	}
}

// fuzzCapsByte decodes one dev_caps byte: bits 0-1 the mode (native, generic,
// not attached, no entry at all), bit 2 XDP frames redirected to it are
// transmitted, bit 3 XDP_TX out of it is, bits 4-5 its MTU (the device's,
// 1400, 1600, 9000), bit 6 its transmit needs a route on the skb (the TC
// engine's bpf_redirect_neigh), bit 7 the stack filters by reverse path
// there: strictly, or loosely with bit 4 (which the MTU shares).
func (e *env) fuzzCapsByte(name string, b byte) *model.DevCaps {
	c := &model.DevCaps{XDPXmit: b&4 != 0, XDPTX: b&8 != 0, NeedsRoute: b&0x40 != 0,
		MTU: []int{e.ifaces[name].mtu, 1400, 1600, 9000}[b>>4&3]}
	if b&0x80 != 0 {
		c.RPFilter = model.RPStrict
		if b&0x10 != 0 {
			c.RPFilter = model.RPLoose
		}
	}
	switch b & 3 {
	case 0:
		c.Native = true
	case 1:
		c.Generic = true
	case 3:
		return nil
	}
	return c
}

// fuzzRateLimit reads a rate-limit byte after the binding specs (a spec whose
// length is not a multiple of 6): bits 0-1 the limit (off, packets and drop,
// packets and pass, bytes and drop), bit 2 whether every binding owes 10 s
// (every packet over the limit) or nothing (the first under it). The outcome
// does not depend on when the program reads the clock.
func (e *env) fuzzRateLimit(t *testing.T, m *model.Model, spec []byte, bs []channelmap.Binding) {
	var rl channelmap.RateLimit
	var b byte
	if len(spec)%6 != 0 {
		b = spec[len(spec)-1]
	}
	switch b & 3 {
	case 1:
		rl = channelmap.RateLimit{PacketsPerSecond: 1000}
	case 2:
		rl = channelmap.RateLimit{PacketsPerSecond: 1000, Pass: true}
	case 3:
		rl = channelmap.RateLimit{BytesPerSecond: 100000}
	}
	e.setRateLimit(t, m, rl)
	if b&4 != 0 {
		owed := model.MonotonicNow() + uint64(10*time.Second)
		for _, bd := range bs {
			e.owe(t, m, bd, model.RateState{PacketTAT: owed, ByteTAT: owed})
		}
	}
}

// Address pools of the environment (see ifaceTable): neighbours on each
// interface, a host without a neighbour entry, one behind the MTU-100 link,
// the unreachable subnet, the server's own and broadcast addresses, a network
// address and one without a route.
var (
	fuzzHosts = []string{"10.100.0.2", "10.100.0.3", "10.200.0.2", "10.200.0.9", "10.201.0.2", "10.201.0.9",
		"10.202.0.2", "10.203.0.2", "10.250.0.2", "10.100.0.1", "10.100.0.255", "10.100.0.0", "192.0.2.1", "10.204.0.2"}
	// IPv6 clients (a client host byte of 0x80 and up): neighbours on a0, one
	// without a neighbour entry, behind f0 (MTU 1280), d0 (IPv4 forwarding
	// off), e0 (not attached), the unreachable prefix, the server's own
	// address, no route, multicast.
	fuzzHosts6 = []string{"fd00:100::2", "fd00:100::3", "fd00:100::9", "fd00:204::2", "fd00:202::2", "fd00:203::2",
		"fd00:250::2", "fd00:100::1", "2001:db8::1", "ff02::1", "fe80::2", "::1"}
	fuzzClientPorts = []uint16{40000, 40001, listenerPort, 50000}
	fuzzPeerPorts   = []uint16{5001, 5002, 49152, listenerPort}
	fuzzRelayAddrs  = []string{"10.100.0.1", "10.200.0.1", "10.201.0.1", "10.202.0.1", "10.203.0.1", "10.200.0.99"}
	fuzzRelayPorts  = []uint16{49152, 50000, 65535}
	// A masquerade's ports: in the relay range or not, and a listener's.
	fuzzWirePorts = []uint16{50000, 31041, 1024, 49151, listenerPort}
	fuzzChannels  = []uint16{0x4000, 0x4001, 0x4FFF, 0x5000, 0x7FFF}
	// Listener addresses: not known (learned from packets), the interfaces', a
	// VIP in front of the node, unspecified.
	fuzzListeners  = []string{"", "10.100.0.1", "10.100.0.100", "10.201.0.1", "10.202.0.1", "0.0.0.0"}
	fuzzListeners6 = []string{"", "fd00:100::1", "fd00:100::100", "fd00:204::1", "fd00:202::1", "::"}
	// Where a client's packet may be addressed: as fuzzListeners, and broadcast
	// (IPv6: multicast and an IPv4-mapped address).
	fuzzDsts  = []string{"10.100.0.1", "10.100.0.100", "10.202.0.1", "10.201.0.1", "0.0.0.0", "255.255.255.255"}
	fuzzDsts6 = []string{"fd00:100::1", "fd00:100::100", "fd00:202::1", "::", "ff02::1", "::ffff:10.100.0.1", "fe80::1", "::1"}
)

func pick[T any](pool []T, b byte) T { return pool[int(b)%len(pool)] }

// decodeBindings turns spec into a consistent binding set, as pion/turn would
// hold: a client key or a peer-and-relay pair already taken is skipped. A client
// host byte of 0x80 or more picks an IPv6 client (and its listener address from
// the IPv6 pool); relays and peers are IPv4.
func decodeBindings(spec []byte) []channelmap.Binding {
	var out []channelmap.Binding
	clients := map[channelmap.Key]bool{}
	peers := map[[2]netip.AddrPort]bool{}
	for i := 0; i+6 <= len(spec) && len(out) < 8; i += 6 {
		s := spec[i : i+6]
		clientPool, listenerPool := fuzzHosts, fuzzListeners
		if s[0]&0x80 != 0 {
			clientPool, listenerPool = fuzzHosts6, fuzzListeners6
		}
		listener := wildcard4
		if s[0]&0x80 != 0 {
			listener = wildcard6
		}
		if s[5]&0x80 != 0 { // the specific listener sharing the port
			listener = map[netip.AddrPort]netip.AddrPort{wildcard4: specific4, wildcard6: specific6}[listener]
		}
		b := channelmap.Binding{
			Client:   netip.AddrPortFrom(netip.MustParseAddr(pick(clientPool, s[0]&0x7f)), pick(fuzzClientPorts, s[1])),
			Listener: listener,
			Channel:  pick(fuzzChannels, s[2]),
			Peer:     netip.AddrPortFrom(netip.MustParseAddr(pick(fuzzHosts, s[3]>>4)), pick(fuzzPeerPorts, s[3]&0xf)),
			Relay:    netip.AddrPortFrom(netip.MustParseAddr(pick(fuzzRelayAddrs, s[4]>>4)), pick(fuzzRelayPorts, s[4]&0xf)),
		}
		if l := pick(listenerPool, s[5]&0x3f); l != "" {
			b.ReplySource = netip.MustParseAddr(l)
			if s[5]&0x40 != 0 { // learned through the NodePort
				b.ReplyPort = nodePort
			}
		}
		if s[4]&0x08 != 0 { // the node source-NATs the flow: another relay on the wire
			b.Wire = netip.AddrPortFrom(netip.MustParseAddr(pick(fuzzRelayAddrs, s[4]>>4+1)), pick(fuzzWirePorts, s[4]&0x7))
		}
		pk := [2]netip.AddrPort{b.Peer, b.OnWire()}
		if clients[b.Key()] || peers[pk] {
			continue
		}
		clients[b.Key()], peers[pk] = true, true
		out = append(out, b)
	}
	return out
}

// fuzzFrame builds the frame of a fuzz input. pick's low bit is the direction
// (client->peer or peer->client), the rest the binding; dst picks the
// destination address, and with bit 6 the client sends to the NodePort
// (nodePort) instead of the listener port; flags: bit 0 wraps the
// payload as ChannelData on the binding's channel with (flags>>1)&3 bytes of
// padding, bit 3 sends no UDP checksum (with bit 7 of dst: a partial one, as a
// sender with tx checksum offload hands it over), bits 4-5 choose the TTL (hop limit),
// bit 6 sets DF (IPv6: a flow label), bit 7 sends from a port one above the
// bound one. An IPv6 client's frames are IPv6, to fuzzDsts6.
func fuzzFrame(bs []channelmap.Binding, pickB, dst, flags uint8, payload []byte) []byte {
	b := bindings["redirect"] // with no bindings, still a frame to refuse
	if len(bs) > 0 {
		b = bs[int(pickB>>1)%len(bs)]
	}
	var f packet.Frame
	if pickB&1 == 0 {
		dsts := fuzzDsts
		if b.Client.Addr().Is6() {
			dsts = fuzzDsts6
		}
		f = fromClient(b, pick(dsts, dst), payload)
		if dst&0x40 != 0 {
			f = toPort(f, nodePort)
		}
		if flags&1 != 0 {
			f.Payload = packet.ChannelData(b.Channel, payload, bytes.Repeat([]byte{0xEE}, int(flags>>1&3)))
		}
	} else {
		f = fromPeer(b, payload)
	}
	f.NoUDPChecksum = flags&8 != 0 && dst&0x80 == 0
	f.PartialChecksum = flags&8 != 0 && dst&0x80 != 0
	f.TTL = []uint8{64, 1, 0, 2}[flags>>4&3]
	f.FragOff, f.FlowLabel = 0, 0
	if flags&0x40 != 0 {
		f.FragOff, f.FlowLabel = 0x4000, 0x54321
	}
	if flags&0x80 != 0 {
		f.Src = netip.AddrPortFrom(f.Src.Addr(), f.Src.Port()+1)
	}
	return f.Marshal()
}

func ingressIndex(name string) uint8 {
	for i, n := range ifaceNames {
		if n == name {
			return uint8(i)
		}
	}
	panic("no interface " + name)
}

// pionChannelData returns pion/turn's ChannelData fuzz corpus and its captured
// ChannelData message from the module cache (internal/proto/testdata of the
// version go.mod requires), or nothing when the cache does not have them: the
// golden and hostile rows, built with test/packet's encoder, seed the
// targets anyway. pion's encoder itself is internal to its module.
func pionChannelData(t testing.TB) [][]byte {
	t.Helper()
	dir := pionTestdata()
	if dir == "" {
		t.Log("pion/turn testdata not in the module cache: no pion seeds")
		return nil
	}
	var out [][]byte
	files, _ := filepath.Glob(filepath.Join(dir, "fuzz", "FuzzChannelData", "*"))
	for _, name := range files {
		b, err := os.ReadFile(name)
		if err != nil {
			t.Fatal(err)
		}
		// "go test fuzz v1" then one []byte("...") line.
		sc := bufio.NewScanner(bytes.NewReader(b))
		sc.Buffer(nil, 1<<20)
		for sc.Scan() {
			line := sc.Text()
			if lit, ok := strings.CutPrefix(line, "[]byte("); ok {
				v, err := strconv.Unquote(strings.TrimSuffix(lit, ")"))
				if err != nil {
					t.Fatalf("%s: %v", name, err)
				}
				out = append(out, []byte(v))
			}
		}
	}
	if b, err := os.ReadFile(filepath.Join(dir, "02_chandata.hex")); err == nil {
		if msg, err := hex.DecodeString(strings.TrimSpace(string(b))); err == nil {
			out = append(out, msg)
		}
	}
	return out
}

// pionTestdata finds pion/turn's internal/proto/testdata in the module cache,
// for the version go.mod requires (the tests run in bpf/, next to ../go.mod; the
// bpf package does not link pion/turn, so the build info does not name it).
func pionTestdata() string {
	gomod, err := os.ReadFile(filepath.Join("..", "go.mod"))
	if err != nil {
		return ""
	}
	version := ""
	for _, line := range strings.Split(string(gomod), "\n") {
		if f := strings.Fields(line); len(f) >= 2 && f[0] == "github.com/pion/turn/v4" {
			version = f[1]
		}
	}
	if version == "" {
		return ""
	}
	cache := os.Getenv("GOMODCACHE")
	if cache == "" {
		gopath := os.Getenv("GOPATH")
		if gopath == "" {
			gopath = build.Default.GOPATH
		}
		cache = filepath.Join(filepath.SplitList(gopath)[0], "pkg", "mod")
	}
	dir := filepath.Join(cache, "github.com", "pion", "turn", "v4@"+version, "internal", "proto", "testdata")
	if _, err := os.Stat(dir); err != nil {
		return ""
	}
	return dir
}
