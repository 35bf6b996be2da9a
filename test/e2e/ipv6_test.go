package e2e

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/pion/transport/v4/stdnet"
	"github.com/pion/turn/v4"

	"github.com/l7mp/stunnerd-xdp/bpf"
	"github.com/l7mp/stunnerd-xdp/internal/channelmap"
	"github.com/l7mp/stunnerd-xdp/internal/config"
	"github.com/l7mp/stunnerd-xdp/internal/daemon"
	"github.com/l7mp/stunnerd-xdp/internal/loader"
	"github.com/l7mp/stunnerd-xdp/internal/nodelabel"
	"github.com/l7mp/stunnerd-xdp/test/netns"
)

// The IPv6 side of a rig built with netns.WithIPv6: the client's cl0 and the
// server's srv0. Relay and peer stay IPv4.
var (
	client6  = netip.MustParseAddr("fd00:100::2")
	listen6  = netip.MustParseAddrPort("[fd00:100::1]:3478")
	echoPeer = netip.MustParseAddrPort(peerAddr + ":5002")
)

const (
	ipv6Rate     = 2000 // datagrams per second
	ipv6Duration = 5 * time.Second
	minEchoed    = 0.999
)

// inIPv6Rig is inRig for a rig whose client side also has IPv6
// (netns.WithIPv6()): body runs in the server namespace of a fresh rig.
func inIPv6Rig(t *testing.T, bridged bool, body func(t *testing.T, r rig)) {
	inRigWith(t, bridged, true, 2*time.Minute, body)
}

// startDualStackDaemon runs stunnerd-xdp in this (the server) namespace with a
// UDP listener on 10.100.0.1:3478 and one on [fd00:100::1]:3478; relays are
// IPv4 on 10.200.0.1.
func startDualStackDaemon(t *testing.T, mode loader.Mode, ifaces []string) *daemon.Daemon {
	t.Helper()
	return startDaemon(t, mode, ifaces, func(c *daemon.Config) {
		c.Listeners = []config.ResolvedListener{
			{Name: "udp4", Protocol: config.UDP, Addr: listenAddr},
			{Name: "udp6", Protocol: config.UDP, Addr: listen6},
		}
	})
}

// udp6Net is pion's standard network, except that a TURN or STUN server given
// as "[v6]:port" resolves: pion/turn's client resolves them as "udp4".
type udp6Net struct{ *stdnet.Net }

func (n udp6Net) ResolveUDPAddr(network, address string) (*net.UDPAddr, error) {
	if network == "udp4" {
		network = "udp"
	}
	return n.Net.ResolveUDPAddr(network, address)
}

// allocate6 makes a pion/turn allocation over IPv6 from [fd00:100::2] in ns to
// the daemon's IPv6 listener. It returns the (IPv4) relayed connection and the
// client's own address. Closing the relayed connection sends Refresh(0).
func allocate6(t *testing.T, ns *netns.NS) (net.PacketConn, netip.AddrPort) {
	t.Helper()
	sn, err := stdnet.NewNet()
	if err != nil {
		t.Fatal(err)
	}
	cfg := &turn.ClientConfig{TURNServerAddr: listen6.String(), Username: user, Password: password, Realm: config.DefaultRealm, Net: udp6Net{sn}}
	relay, err := ns.Allocate(t, "udp6", netip.AddrPortFrom(client6, 0).String(), cfg)
	if err != nil {
		t.Fatalf("allocate over IPv6: %v", err)
	}
	local := cfg.Conn.LocalAddr().(*net.UDPAddr).AddrPort()
	ra, ok := relay.LocalAddr().(*net.UDPAddr)
	if !ok || ra.AddrPort().Addr().Unmap() != relayAddr {
		t.Fatalf("relayed address %v, want %v:PORT", relay.LocalAddr(), relayAddr)
	}
	return relay, local
}

// taggedStats is what a tagged echo session saw.
type taggedStats struct {
	sent, received, duplicates, foreign int
	firstForeign                        string
}

func (s taggedStats) String() string {
	return fmt.Sprintf("sent %d, echoed %d (%.3f%%), %d duplicates, %d foreign", s.sent, s.received,
		100*float64(s.received)/float64(max(s.sent, 1)), s.duplicates, s.foreign)
}

// taggedEcho sends datagrams through the relay to the echo peer at rate for
// dur and counts the echoes. Each datagram carries a random session tag, its
// sequence number and a filler derived from both, paced to rate over dur
// (at most 1 s late); sizes cycle through 60-63
// bytes so that every ChannelData padding (0-3 bytes) occurs. An echo counts
// only if it comes from the peer with the tag, a sequence number that was sent
// and an intact filler; anything else is foreign. The reader stops once no echo
// has come for 1 s after the last send, and never later than 5 s after it.
func taggedEcho(t *testing.T, relay net.PacketConn, rate int, dur time.Duration) taggedStats {
	t.Helper()
	var tag [8]byte
	_, _ = rand.Read(tag[:])
	payload := func(seq uint64) []byte {
		b := make([]byte, 60+seq%4)
		copy(b, tag[:])
		binary.BigEndian.PutUint64(b[8:], seq)
		for i := 16; i < len(b); i++ {
			b[i] = byte(seq) ^ byte(i) ^ tag[i%8]
		}
		return b
	}
	peer := net.UDPAddrFromAddrPort(echoPeer)
	total := rate * int(dur/time.Second)

	type result struct {
		seen                          []bool
		received, duplicates, foreign int
		firstForeign                  string
	}
	sendDone := make(chan struct{})
	got := make(chan result, 1)
	go func() {
		res := result{seen: make([]bool, total)}
		buf := make([]byte, 1500)
		var stopped, last time.Time // when the sender finished; the last echo after that
		for {
			select {
			case <-sendDone:
				now := time.Now()
				if stopped.IsZero() {
					stopped, last = now, now
				}
				if now.Sub(last) > time.Second || now.Sub(stopped) > 5*time.Second {
					got <- res
					return
				}
			default:
			}
			_ = relay.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
			n, from, err := relay.ReadFrom(buf)
			if err != nil {
				if !errors.Is(err, os.ErrDeadlineExceeded) {
					time.Sleep(10 * time.Millisecond) // closed: do not spin until the stop
				}
				continue
			}
			if !stopped.IsZero() {
				last = time.Now()
			}
			ua, _ := from.(*net.UDPAddr)
			ok := ua != nil && netip.AddrPortFrom(ua.AddrPort().Addr().Unmap(), ua.AddrPort().Port()) == echoPeer && n >= 16
			var seq uint64
			if ok {
				seq = binary.BigEndian.Uint64(buf[8:16])
				want := payload(seq)
				ok = seq < uint64(total) && n == len(want) && string(buf[:n]) == string(want)
			}
			switch {
			case !ok:
				res.foreign++
				if res.firstForeign == "" {
					res.firstForeign = fmt.Sprintf("%d bytes from %v: %x", n, from, buf[:min(n, 32)])
				}
			case res.seen[seq]:
				res.duplicates++
			default:
				res.seen[seq] = true
				res.received++
			}
		}
	}()

	// Paced by the clock rather than a ticker, which drops ticks at 2000/s on
	// this VM: every millisecond, send what is due.
	var sent int
	start := time.Now()
	for sent < total && time.Since(start) < dur+time.Second {
		due := min(total, int(time.Since(start)*time.Duration(rate)/time.Second)+1)
		for ; sent < due; sent++ {
			if _, err := relay.WriteTo(payload(uint64(sent)), peer); err != nil {
				t.Errorf("write to the peer through the relay: %v", err)
				close(sendDone)
				<-got
				return taggedStats{sent: sent}
			}
		}
		time.Sleep(time.Millisecond)
	}
	close(sendDone)
	res := <-got
	return taggedStats{sent: sent, received: res.received, duplicates: res.duplicates, foreign: res.foreign, firstForeign: res.firstForeign}
}

// checkEchoes asserts that at least minEchoed of the session came back intact
// and nothing foreign or duplicated arrived.
func checkEchoes(t *testing.T, s taggedStats, wantSent int) {
	t.Helper()
	if s.sent < wantSent*95/100 {
		t.Errorf("sent only %d of %d datagrams", s.sent, wantSent)
	}
	if float64(s.received) < minEchoed*float64(s.sent) {
		t.Errorf("%d of %d echoes came back, want at least %.1f%%", s.received, s.sent, 100*minEchoed)
	}
	if s.foreign != 0 || s.duplicates != 0 {
		t.Errorf("%d foreign (first: %s) and %d duplicate datagrams, want none", s.foreign, s.firstForeign, s.duplicates)
	}
}

// checkClientUDP6 asserts that the client's kernel dropped no IPv6 UDP
// datagram between two snapshots of its /proc/net/snmp6: a wrong checksum
// from the XDP program's IPv4->IPv6 rewrite would show as Udp6InCsumErrors.
func checkClientUDP6(t *testing.T, before, after map[string]int64) {
	t.Helper()
	var parts []string
	for _, k := range []string{"Udp6InDatagrams", "Udp6OutDatagrams", "Udp6InErrors", "Udp6InCsumErrors", "Udp6RcvbufErrors", "Udp6NoPorts", "Icmp6InMsgs", "Icmp6OutMsgs"} {
		parts = append(parts, fmt.Sprintf("%s +%d", k, after[k]-before[k]))
	}
	t.Logf("client snmp6: %s", strings.Join(parts, ", "))
	for _, k := range []string{"Udp6InErrors", "Udp6InCsumErrors", "Udp6RcvbufErrors"} {
		if d := after[k] - before[k]; d != 0 {
			t.Errorf("client %s grew by %d during the session", k, d)
		}
	}
}

// verdictLog renders the verdicts that grew between two snapshots.
func verdictLog(before, after []uint64) string {
	var parts []string
	for i := range after {
		var b uint64
		if i < len(before) {
			b = before[i]
		}
		if d := after[i] - b; d != 0 {
			name, ok := channelmap.ReasonNames[bpf.RelayReason(i)]
			if !ok {
				name = fmt.Sprintf("reason_%d", i)
			}
			parts = append(parts, fmt.Sprintf("%s=%d", name, d))
		}
	}
	sort.Strings(parts)
	return strings.Join(parts, " ")
}

// findBinding returns the maps' binding of the given client, and how many
// bindings the maps hold.
func findBinding(t *testing.T, d *daemon.Daemon, client netip.AddrPort) (channelmap.Binding, bool, int) {
	t.Helper()
	dump, err := d.Maps().Dump()
	if err != nil {
		t.Fatal(err)
	}
	for k, b := range dump {
		if k.Client == client {
			return b, true, len(dump)
		}
	}
	return channelmap.Binding{}, false, len(dump)
}

// TestIPv6ClientXDP: a pion/turn client on IPv6 ([fd00:100::2] -> listener
// [fd00:100::1]:3478) allocates an IPv4 relay and echoes tagged datagrams off
// an IPv4 peer at 2000/s for 5 s with XDP native on srv0 and srv1 (routed
// rig: the program redirects both ways). See ipv6XDPSession for what it checks.
func TestIPv6ClientXDP(t *testing.T) {
	inIPv6Rig(t, false, func(t *testing.T, r rig) { ipv6XDPSession(t, r, false) })
}

// TestIPv6ClientBridgedXDPTX: the same through the bridged rig, where client
// and peer sit behind srv0 alone, so the program answers both ways with XDP_TX.
func TestIPv6ClientBridgedXDPTX(t *testing.T) {
	inIPv6Rig(t, true, func(t *testing.T, r rig) { ipv6XDPSession(t, r, true) })
}

// ipv6XDPSession runs the IPv6 echo session with XDP native and checks that
// nearly every echo comes back intact, XDP carries at least 99 % of both
// directions (IPv6 -> IPv4 and back) with the expected verdict (XDP_TX when
// tx, else redirect), the client's kernel drops nothing (no bad checksums),
// the binding in the maps holds the IPv6 client and listener addresses, an
// IPv4 client on the IPv4 listener is relayed alongside and stored
// IPv4-mapped, and a Refresh(0) takes each client's binding out of the maps
// within a second.
func ipv6XDPSession(t *testing.T, r rig, tx bool) {
	d := startDualStackDaemon(t, loader.ModeNative, r.serverIfaces)
	startEcho(t, r.peer, echoPeer)
	relay, local := allocate6(t, r.client)
	t.Logf("client %v allocated relay %v through %v", local, relay.LocalAddr(), listen6)

	clBefore := r.client.Snmp6(t)
	before := snapshot(t, d)
	s := taggedEcho(t, relay, ipv6Rate, ipv6Duration)
	after := snapshot(t, d)
	checkClientUDP6(t, clBefore, r.client.Snmp6(t))
	xdpC2P := after.xdp.ClientToPeerPackets - before.xdp.ClientToPeerPackets
	xdpP2C := after.xdp.PeerToClientPackets - before.xdp.PeerToClientPackets
	userC2P, userP2C := after.userC2P-before.userC2P, after.userP2C-before.userP2C
	t.Logf("echo: %v", s)
	t.Logf("relayed: %v", paths{xdp: channelmap.Stats{ClientToPeerPackets: xdpC2P, PeerToClientPackets: xdpP2C}, userC2P: userC2P, userP2C: userP2C})
	t.Logf("verdicts: %s", verdictLog(before.verdicts, after.verdicts))
	checkEchoes(t, s, ipv6Rate*int(ipv6Duration/time.Second))

	for _, dir := range []struct {
		name      string
		xdp, user uint64
	}{{"client->peer", xdpC2P, userC2P}, {"peer->client", xdpP2C, userP2C}} {
		if sh := share(dir.xdp, dir.user); sh < minXDPShare {
			t.Errorf("XDP relayed %.2f%% of %s (%d of %d), want at least %.0f%%", 100*sh, dir.name, dir.xdp, dir.xdp+dir.user, 100*minXDPShare)
		}
		if dir.xdp+dir.user < uint64(s.received) {
			t.Errorf("the paths counted %d %s packets, %d echoes came back", dir.xdp+dir.user, dir.name, s.received)
		}
	}
	c2pReason, p2cReason := bpf.RelayReasonREASON_RELAY_C2P_REDIRECT, bpf.RelayReasonREASON_RELAY_P2C_REDIRECT
	if tx {
		c2pReason, p2cReason = bpf.RelayReasonREASON_RELAY_C2P_TX, bpf.RelayReasonREASON_RELAY_P2C_TX
	}
	c2p := after.verdicts[c2pReason] - before.verdicts[c2pReason]
	p2c := after.verdicts[p2cReason] - before.verdicts[p2cReason]
	if c2p < xdpC2P || p2c < xdpP2C {
		t.Errorf("%s=%d %s=%d, below what XDP relayed (c2p=%d p2c=%d)", channelmap.ReasonNames[c2pReason], c2p,
			channelmap.ReasonNames[p2cReason], p2c, xdpC2P, xdpP2C)
	}

	b, ok, n := findBinding(t, d, local)
	if !ok {
		t.Fatalf("no binding of client %v in the maps (%d bindings)", local, n)
	}
	t.Logf("binding: %v reply source=%v", b, b.ReplySource)
	if n != 1 {
		t.Errorf("%d bindings in the maps, want 1", n)
	}
	if !b.Client.Addr().Is6() || b.Client.Addr().Is4In6() || b.ReplySource != listen6.Addr() || b.Listener.Port() != listen6.Port() {
		t.Errorf("binding %v reply source %v: want client %v and listener %v", b, b.ReplySource, local, listen6)
	}
	if b.Peer != echoPeer || b.Relay.Addr() != relayAddr || b.Relay.String() != relay.LocalAddr().String() {
		t.Errorf("binding %v: want peer %v and relay %v", b, echoPeer, relay.LocalAddr())
	}

	// An IPv4 client on the IPv4 listener, alongside.
	relay4, err := allocateWith(t, r.client, listenAddr.String(), user, password, false)
	if err != nil {
		t.Fatalf("IPv4 allocation next to the IPv6 one: %v", err)
	}
	before4 := snapshot(t, d)
	s4 := taggedEcho(t, relay4, 1000, time.Second)
	after4 := snapshot(t, d)
	t.Logf("IPv4 client alongside: echo %v; xdp c2p=%d p2c=%d", s4, after4.xdp.ClientToPeerPackets-before4.xdp.ClientToPeerPackets,
		after4.xdp.PeerToClientPackets-before4.xdp.PeerToClientPackets)
	checkEchoes(t, s4, 1000)
	dump, err := d.Maps().Dump()
	if err != nil {
		t.Fatal(err)
	}
	var v4 []channelmap.Binding
	for _, b := range dump {
		if b.Client.Addr().Is4() {
			v4 = append(v4, b)
		}
	}
	if len(dump) != 2 || len(v4) != 1 || v4[0].ReplySource != listenAddr.Addr() {
		t.Errorf("maps hold %v, want the IPv6 binding and one IPv4 one with listener %v", dump, listenAddr.Addr())
	}

	// Refresh(0) of the IPv6 allocation: its binding goes, the IPv4 one stays.
	start := time.Now()
	if err := relay.Close(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the IPv6 binding leaves the maps after the Refresh(0)", removalDeadline, func() bool {
		_, ok, _ := findBinding(t, d, local)
		return !ok
	})
	t.Logf("the IPv6 binding left the maps %v after the Refresh(0) was sent", time.Since(start))
	if _, _, n := findBinding(t, d, local); n != 1 {
		t.Errorf("%d bindings left, want the IPv4 one", n)
	}
	if err := relay4.Close(); err != nil {
		t.Fatal(err)
	}
	took := waitEmpty(t, d, removalDeadline)
	t.Logf("the maps were empty %v after the IPv4 client's Refresh(0)", took)
	waitFor(t, "no allocation left after the Refresh(0)s", time.Second, func() bool { return d.AllocationCount() == 0 })
}

// TestIPv6ClientUserspace: the same IPv6 session with --xdp-mode=off: pion/turn
// relays both directions, between an IPv6 client and an IPv4 peer.
func TestIPv6ClientUserspace(t *testing.T) {
	inIPv6Rig(t, false, func(t *testing.T, r rig) {
		d := startDualStackDaemon(t, loader.ModeOff, r.serverIfaces)
		startEcho(t, r.peer, echoPeer)
		relay, local := allocate6(t, r.client)
		t.Logf("client %v allocated relay %v through %v", local, relay.LocalAddr(), listen6)

		clBefore := r.client.Snmp6(t)
		s := taggedEcho(t, relay, ipv6Rate, ipv6Duration)
		checkClientUDP6(t, clBefore, r.client.Snmp6(t))
		after := snapshot(t, d)
		t.Logf("echo: %v; relayed: %v", s, after)
		checkEchoes(t, s, ipv6Rate*int(ipv6Duration/time.Second))
		if d.Maps() != nil || len(d.Attached()) != 0 {
			t.Errorf("XDP in use with --xdp-mode=off: attached %v", d.Attached())
		}
		if after.userC2P < uint64(s.received) || after.userP2C < uint64(s.received) {
			t.Errorf("userspace relayed c2p=%d p2c=%d, %d echoes came back", after.userC2P, after.userP2C, s.received)
		}
	})
}

// TestIPv6ClientSwitch: an IPv6 session keeps flowing while the relay goes
// from XDP native to userspace and back: both paths carry it, and nearly every
// echo comes back.
func TestIPv6ClientSwitch(t *testing.T) {
	inIPv6Rig(t, false, func(t *testing.T, r rig) {
		d := startDualStackDaemon(t, loader.ModeNative, r.serverIfaces)
		startEcho(t, r.peer, echoPeer)
		relay, local := allocate6(t, r.client)
		t.Logf("client %v allocated relay %v through %v", local, relay.LocalAddr(), listen6)

		const dur = 6 * time.Second
		done := make(chan taggedStats, 1)
		go func() { done <- taggedEcho(t, relay, ipv6Rate, dur) }()

		// Two seconds of the session in the kernel, its binding in the maps.
		time.Sleep(2 * time.Second)
		if err := netns.Eventually(10*time.Second, 20*time.Millisecond, func() error {
			if _, ok, _ := findBinding(t, d, local); !ok {
				return fmt.Errorf("no binding of client %v in the maps before the switch", local)
			}
			return nil
		}); err != nil {
			t.Error(err)
		}
		native := snapshot(t, d)
		if err := d.FollowNode(context.Background(), nodelabel.Detach); err != nil {
			t.Fatalf("switch off: %v", err)
		}
		off := snapshot(t, d)
		if len(d.Attached()) != 0 || off.offloadSize != 0 {
			t.Errorf("after switching off: attached %v, %d bindings", d.Attached(), off.offloadSize)
		}
		time.Sleep(2 * time.Second)
		user := snapshot(t, d)
		if err := d.FollowNode(context.Background(), nodelabel.Default); err != nil { // --xdp-mode=native
			t.Fatalf("switch back to native: %v", err)
		}
		if _, ok, _ := findBinding(t, d, local); !ok {
			t.Errorf("no binding of client %v in the maps after switching back", local)
		}
		back := snapshot(t, d)
		s := <-done
		end := snapshot(t, d)
		t.Logf("echo: %v", s)
		t.Logf("native 2 s: %v | off 2 s: userspace c2p=%d p2c=%d | native again: %v", native, user.userC2P-off.userC2P,
			user.userP2C-off.userP2C, paths{xdp: channelmap.Stats{
				ClientToPeerPackets: end.xdp.ClientToPeerPackets - back.xdp.ClientToPeerPackets,
				PeerToClientPackets: end.xdp.PeerToClientPackets - back.xdp.PeerToClientPackets,
			}, userC2P: end.userC2P - back.userC2P, userP2C: end.userP2C - back.userP2C})
		checkEchoes(t, s, ipv6Rate*int(dur/time.Second))
		if native.xdp.ClientToPeerPackets < ipv6Rate || native.xdp.PeerToClientPackets < ipv6Rate {
			t.Errorf("XDP carried little before the switch: %v", native)
		}
		if c2p, p2c := user.userC2P-off.userC2P, user.userP2C-off.userP2C; c2p < ipv6Rate || p2c < ipv6Rate {
			t.Errorf("userspace carried c2p=%d p2c=%d in the 2 s off, want at least %d each", c2p, p2c, ipv6Rate)
		}
		if c2p := end.xdp.ClientToPeerPackets - back.xdp.ClientToPeerPackets; c2p < ipv6Rate {
			t.Errorf("XDP carried %d client->peer packets after switching back, want at least %d", c2p, ipv6Rate)
		}
	})
}
