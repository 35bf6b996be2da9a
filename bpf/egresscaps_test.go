package bpf_test

import (
	"fmt"
	"testing"

	"github.com/l7mp/stunnerd-xdp/bpf"
	"github.com/l7mp/stunnerd-xdp/test/model"
	"github.com/l7mp/stunnerd-xdp/test/packet"
)

// native is the dev_caps of a device where the program runs in the driver and
// XDP frames leave (a NIC, a veth whose far end runs XDP); modify the copy.
func native(mtu int) *model.DevCaps {
	return &model.DevCaps{Native: true, XDPXmit: true, XDPTX: true, MTU: mtu}
}

func generic(mtu int) *model.DevCaps { return &model.DevCaps{Generic: true, MTU: mtu} }

// noXmit is a device where the program runs natively (or does not run) and a
// redirected or XDP_TX'd frame would be dropped: a veth whose peer runs no XDP,
// a bridge, a tunnel.
func noXmit(mtu int) *model.DevCaps { return &model.DevCaps{Native: true, MTU: mtu} }

// capsGolden is a golden row run with some interfaces' dev_caps replaced.
type capsGolden struct {
	golden
	caps map[string]*model.DevCaps // nil value: no entry
}

// TestGoldenEgressCaps: every outcome of the egress and ingress-MTU decisions,
// through BPF_PROG_RUN against the model: a native ingress redirects only to
// an egress that transmits XDP frames and sends XDP_TX only where it can; a
// generic one through the skb path, anywhere; a packet longer than the
// ingress MTU passes. A passed packet is the input, untouched, and counted
// nowhere (check compares the per-binding counters with the model's).
func TestGoldenEgressCaps(t *testing.T) {
	e := newEnv(t)
	m := e.install(t)
	a0, b0 := e.ifaces["a0"], e.ifaces["b0"]
	redirect, tx, v6 := bindings["redirect"], bindings["tx"], bindings["v6redirect"]
	cd := func(ch uint16, n int) []byte { return packet.ChannelData(ch, data(n), nil) }
	c2p := fromClient(redirect, "10.100.0.1", cd(redirect.Channel, 100))
	p2c := fromPeer(redirect, data(100))
	c2pTX := fromClient(tx, "10.100.0.1", cd(tx.Channel, 100))
	p2cTX := fromPeer(tx, data(100))
	p2cTX.SrcMAC = peer2MAC
	c2p6 := fromClient(v6, "fd00:100::1", cd(v6.Channel, 100))
	p2c6 := fromPeer(v6, data(100))
	const noXDP = bpf.RelayReasonREASON_EGRESS_NO_XDP_XMIT
	const overMTU = bpf.RelayReasonREASON_INGRESS_OVER_MTU
	pass := func(name, ingress string, in packet.Frame, reason bpf.RelayReason, caps map[string]*model.DevCaps) capsGolden {
		return capsGolden{golden{name: name, ingress: ingress, in: in.Marshal(), verdict: xdpPass, reason: reason}, caps}
	}
	relay := func(name, ingress string, in packet.Frame, verdict uint32, reason bpf.RelayReason, out packet.Frame,
		caps map[string]*model.DevCaps) capsGolden {
		return capsGolden{golden{name: name, ingress: ingress, in: in.Marshal(), verdict: verdict, reason: reason, out: out.Marshal()}, caps}
	}
	rows := []capsGolden{
		// Native ingress, redirect.
		relay("c2p/redirect/egress-transmits", "a0", c2p, xdpRedirect, bpf.RelayReasonREASON_RELAY_C2P_REDIRECT,
			toPeer(c2p, redirect, b0.mac, peerMAC, data(100)), nil),
		pass("c2p/redirect/egress-no-xmit", "a0", c2p, noXDP, map[string]*model.DevCaps{"b0": noXmit(1500)}),
		pass("c2p/redirect/egress-unknown", "a0", c2p, noXDP, map[string]*model.DevCaps{"b0": nil}),
		pass("c2p/redirect/egress-generic-no-xmit", "a0", c2p, noXDP,
			map[string]*model.DevCaps{"b0": {Generic: true, XDPTX: true, MTU: 1500}}),
		pass("p2c/redirect/egress-no-xmit", "b0", p2c, noXDP, map[string]*model.DevCaps{"a0": noXmit(1500)}),
		pass("c2p6/redirect/egress-no-xmit", "a0", c2p6, noXDP, map[string]*model.DevCaps{"b0": noXmit(1500)}),
		pass("p2c6/redirect/egress-no-xmit", "b0", p2c6, noXDP, map[string]*model.DevCaps{"a0": noXmit(1500)}),
		// Nothing known of the ingress: as native.
		relay("c2p/redirect/ingress-unknown", "a0", c2p, xdpRedirect, bpf.RelayReasonREASON_RELAY_C2P_REDIRECT,
			toPeer(c2p, redirect, b0.mac, peerMAC, data(100)), map[string]*model.DevCaps{"a0": nil}),
		pass("c2p/redirect/ingress-unknown/egress-no-xmit", "a0", c2p, noXDP,
			map[string]*model.DevCaps{"a0": nil, "b0": noXmit(1500)}),
		// Generic ingress: the skb path reaches any device.
		relay("c2p/redirect/generic-ingress/egress-no-xmit", "a0", c2p, xdpRedirect, bpf.RelayReasonREASON_RELAY_C2P_REDIRECT,
			toPeer(c2p, redirect, b0.mac, peerMAC, data(100)), map[string]*model.DevCaps{"a0": generic(1500), "b0": noXmit(1500)}),
		relay("p2c/redirect/generic-ingress/egress-unknown", "b0", p2c, xdpRedirect, bpf.RelayReasonREASON_RELAY_P2C_REDIRECT,
			toClient(p2c, redirect, redirect.ReplySource, a0.mac, clientMAC, data(100)),
			map[string]*model.DevCaps{"b0": generic(1500), "a0": nil}),
		// XDP_TX: the ingress's own transmit.
		pass("c2p/tx/ingress-no-tx", "a0", c2pTX, noXDP, map[string]*model.DevCaps{"a0": noXmit(1500)}),
		pass("c2p/tx/ingress-xmit-but-no-tx", "a0", c2pTX, noXDP,
			map[string]*model.DevCaps{"a0": {Native: true, XDPXmit: true, MTU: 1500}}),
		pass("p2c/tx/ingress-unknown", "a0", p2cTX, noXDP, map[string]*model.DevCaps{"a0": nil}),
		relay("p2c/tx/generic-ingress", "a0", p2cTX, xdpTX, bpf.RelayReasonREASON_RELAY_P2C_TX,
			toClient(p2cTX, tx, tx.ReplySource, a0.mac, clientMAC, data(100)), map[string]*model.DevCaps{"a0": generic(1500)}),
		relay("c2p/tx/ingress-tx-only", "a0", c2pTX, xdpTX, bpf.RelayReasonREASON_RELAY_C2P_TX,
			toPeer(c2pTX, tx, a0.mac, peer2MAC, data(100)), map[string]*model.DevCaps{"a0": {Native: true, XDPTX: true, MTU: 1500}}),
	}
	// The ingress MTU: IP packets of 1500 bytes are never measured, longer
	// ones against the ingress's MTU (none known: passed).
	for _, c := range []struct {
		ipLen int
		caps  *model.DevCaps
		over  bool
	}{{1500, nil, false}, {1501, nil, true}, {1501, native(1500), true}, {1501, native(1501), false},
		{1600, native(9000), false}, {1600, generic(1500), true}} {
		n := c.ipLen - packet.IPv4Len - packet.UDPLen - 4
		in := fromClient(redirect, "10.100.0.1", cd(redirect.Channel, n))
		name := fmt.Sprintf("c2p/ingress-mtu/len=%d/caps=%v", c.ipLen, c.caps != nil)
		if c.caps != nil {
			name += fmt.Sprintf("/mtu=%d", c.caps.MTU)
		}
		caps := map[string]*model.DevCaps{"a0": c.caps}
		switch {
		case c.over:
			rows = append(rows, pass(name, "a0", in, overMTU, caps))
		case c.ipLen-4 > b0.mtu: // measured, not over: the FIB has its say
			rows = append(rows, pass(name, "a0", in, bpf.RelayReasonREASON_FIB_FRAG_NEEDED, caps))
		default:
			rows = append(rows, relay(name, "a0", in, xdpRedirect, bpf.RelayReasonREASON_RELAY_C2P_REDIRECT,
				toPeer(in, redirect, b0.mac, peerMAC, data(n)), caps))
		}
		p := fromPeer(redirect, data(c.ipLen-packet.IPv4Len-packet.UDPLen))
		if c.over {
			rows = append(rows, pass("p2c"+name[3:], "b0", p, overMTU, map[string]*model.DevCaps{"b0": c.caps}))
		} else {
			// The reply is 4 bytes longer: over a0's MTU of 1500.
			rows = append(rows, pass("p2c"+name[3:], "b0", p, bpf.RelayReasonREASON_FIB_FRAG_NEEDED,
				map[string]*model.DevCaps{"b0": c.caps}))
		}
	}
	for _, r := range rows {
		t.Run(r.name, func(t *testing.T) {
			for name, caps := range r.caps {
				e.setCaps(t, m, name, caps)
			}
			for run := 0; run < 2; run++ { // the second from the cached next hop
				runRow(t, e, m, r.golden)
			}
		})
	}
}

// TestEgressCapsRedecideCachedHop: a next hop cached while the egress took XDP
// frames is decided again once its dev_caps entry changes (the loader bumps
// the FIB generation with every change): nothing is redirected into a device
// that stopped transmitting them, and relaying resumes when it starts again.
func TestEgressCapsRedecideCachedHop(t *testing.T) {
	e := newEnv(t)
	m := e.install(t)
	b := bindings["redirect"]
	in := fromClient(b, "10.100.0.1", packet.ChannelData(b.Channel, data(50), nil)).Marshal()
	want := func(reason bpf.RelayReason) {
		t.Helper()
		for run := 0; run < 2; run++ {
			if got, _ := e.check(t, m, "a0", in); got.reason != reason {
				t.Fatalf("run %d: %s, want %s", run, reasonName(got.reason), reasonName(reason))
			}
		}
	}
	want(bpf.RelayReasonREASON_RELAY_C2P_REDIRECT)
	t.Run("no-xmit", func(t *testing.T) {
		e.setCaps(t, m, "b0", noXmit(1500))
		want(bpf.RelayReasonREASON_EGRESS_NO_XDP_XMIT)
	})
	want(bpf.RelayReasonREASON_RELAY_C2P_REDIRECT)
}
