package e2e

import (
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/l7mp/stunnerd-xdp/bpf"
	"github.com/l7mp/stunnerd-xdp/internal/loader"
	"github.com/l7mp/stunnerd-xdp/test/netns"
)

const (
	iperfRate     = 20000 // datagrams per second
	iperfSize     = 100   // bytes
	iperfSeconds  = 10
	maxLoss       = 0.1  // percent, at the iperf server
	minXDPShare   = 0.99 // of the relayed client->peer packets
	iperfPeerPort = 5001
)

// iperfThroughTurncat is the user's own benchmark from STUNner's simple-tunnel
// guide: iperf2 -> turncat -> TURN -> iperf2 server.
func iperfThroughTurncat(t *testing.T, r rig) netns.IperfResult {
	t.Helper()
	return iperfThroughTurncatAt(t, r, iperfRate, iperfSeconds)
}

// iperfThroughTurncatAt is iperfThroughTurncat at rate datagrams per second
// for seconds.
func iperfThroughTurncatAt(t *testing.T, r rig, rate, seconds int) netns.IperfResult {
	t.Helper()
	clBefore, peerBefore := r.client.Snmp(t), r.peer.Snmp(t)
	defer func() {
		clAfter, peerAfter := r.client.Snmp(t), r.peer.Snmp(t)
		for _, k := range []string{"Udp.InDatagrams", "Udp.RcvbufErrors", "Udp.InErrors", "Udp.NoPorts"} {
			t.Logf("%s: client ns +%d, peer ns +%d", k, clAfter[k]-clBefore[k], peerAfter[k]-peerBefore[k])
		}
	}()
	server := r.peer.StartIperfServer(t, iperfPeerPort, "-e", "-i", "1", "-w", "4M")
	startTurncat(t, r, iperfPeerPort)
	out := r.client.Run(t, "iperf", "-c", "127.0.0.1", "-p", "5000", "-u", "-l", strconv.Itoa(iperfSize),
		"-b", fmt.Sprintf("%dpps", rate), "-t", strconv.Itoa(seconds), "-e")
	t.Logf("iperf client:\n%s", out)
	res, err := server.IperfReport(5 * time.Second)
	if err != nil {
		t.Fatalf("no iperf server report: %v\n%s", err, server.Stderr())
	}
	t.Logf("iperf server: %+v\n%s", res, server.Stdout())
	return res
}

func checkLoss(t *testing.T, res netns.IperfResult) {
	t.Helper()
	want := int64(iperfRate * iperfSeconds * 95 / 100)
	if res.Total < want {
		t.Errorf("iperf offered %d datagrams, want at least %d", res.Total, want)
	}
	if res.LossPercent > maxLoss {
		t.Errorf("loss %.3f%% at the iperf server, want at most %.1f%%", res.LossPercent, maxLoss)
	}
}

// TestIperfXDPNative: 100-byte datagrams at 20,000/s for 10 s through turncat and
// stunnerd-xdp with XDP native on the server's veths.
func TestIperfXDPNative(t *testing.T) {
	inRig(t, false, func(t *testing.T, r rig) {
		d := startDaemon(t, loader.ModeNative, r.serverIfaces, nil)
		before := snapshot(t, d)
		res := iperfThroughTurncat(t, r)
		after := snapshot(t, d)
		t.Logf("relayed: %v", after)
		checkLoss(t, res)
		xdp := after.xdp.ClientToPeerPackets - before.xdp.ClientToPeerPackets
		user := after.userC2P - before.userC2P
		if s := share(xdp, user); s < minXDPShare {
			t.Errorf("XDP relayed %.2f%% of client->peer packets (%d of %d), want at least %.0f%%", 100*s, xdp, xdp+user, 100*minXDPShare)
		}
		if got := after.verdicts[bpf.RelayReasonREASON_RELAY_C2P_REDIRECT]; got < xdp {
			t.Errorf("redirect verdicts %d < relayed %d", got, xdp)
		}
	})
}

// TestIperfUserspace: the same with --xdp-mode=off: pion/turn relays it all.
func TestIperfUserspace(t *testing.T) {
	inRig(t, false, func(t *testing.T, r rig) {
		d := startDaemon(t, loader.ModeOff, r.serverIfaces, nil)
		res := iperfThroughTurncat(t, r)
		after := snapshot(t, d)
		t.Logf("relayed: %v", after)
		checkLoss(t, res)
		if after.xdp.ClientToPeerPackets != 0 || after.xdp.PeerToClientPackets != 0 || d.Maps() != nil {
			t.Errorf("XDP path relayed packets with --xdp-mode=off: %v", after)
		}
		if len(d.Attached()) != 0 {
			t.Errorf("XDP attached with --xdp-mode=off: %v", d.Attached())
		}
		if after.userC2P < uint64(res.Received) {
			t.Errorf("userspace relayed %d client->peer packets, the peer received %d", after.userC2P, res.Received)
		}
	})
}

// TestIperfBridgedXDPTX: client and peer behind one server interface, so the
// program forwards with XDP_TX.
func TestIperfBridgedXDPTX(t *testing.T) {
	inRig(t, true, func(t *testing.T, r rig) {
		d := startDaemon(t, loader.ModeNative, r.serverIfaces, nil)
		res := iperfThroughTurncat(t, r)
		after := snapshot(t, d)
		t.Logf("relayed: %v", after)
		checkLoss(t, res)
		if s := share(after.xdp.ClientToPeerPackets, after.userC2P); s < minXDPShare {
			t.Errorf("XDP relayed %.2f%% of client->peer packets, want at least %.0f%%", 100*s, 100*minXDPShare)
		}
		tx := after.verdicts[bpf.RelayReasonREASON_RELAY_C2P_TX]
		if tx < after.xdp.ClientToPeerPackets || after.verdicts[bpf.RelayReasonREASON_RELAY_C2P_REDIRECT] != 0 {
			t.Errorf("want every client->peer packet XDP_TXed: tx=%d redirect=%d relayed=%d", tx,
				after.verdicts[bpf.RelayReasonREASON_RELAY_C2P_REDIRECT], after.xdp.ClientToPeerPackets)
		}
	})
}

// TestEchoBothDirectionsXDP: a UDP echo peer sends every datagram back, so both
// directions are relayed, and both must go through XDP. The client is
// pion/turn's (turncat v1.1.0's client sometimes stays on Send indications for
// a whole session: its binding state machine does not retry a failed
// ChannelBind, and then no client->peer packet can be ChannelData).
func TestEchoBothDirectionsXDP(t *testing.T) {
	inRig(t, false, func(t *testing.T, r rig) {
		d, relay := startEchoSession(t, r, loader.ModeNative)
		s := &taggedSession{}
		s.run(t, relay, 0xEC40, 5000, 4*time.Second)
		after := snapshot(t, d)
		sent, got := s.sent.Load(), s.received.Load()
		t.Logf("echo: %d sent, %d echoed, %d foreign; relayed: %v", sent, got, s.foreign.Load(), after)
		if s.foreign.Load() != 0 {
			t.Errorf("%d echoes that were not ours", s.foreign.Load())
		}
		if float64(got) < 0.999*float64(sent) {
			t.Errorf("%d of %d echoes came back, want at least 99.9%%", got, sent)
		}
		if x := after.xdp.PeerToClientPackets + after.userP2C; x < uint64(got) {
			t.Errorf("the paths counted %d peer->client packets, the client received %d", x, got)
		}
		if sh := share(after.xdp.ClientToPeerPackets, after.userC2P); sh < minXDPShare {
			t.Errorf("XDP relayed %.2f%% client->peer, want at least %.0f%%", 100*sh, 100*minXDPShare)
		}
		if sh := share(after.xdp.PeerToClientPackets, after.userP2C); sh < minXDPShare {
			t.Errorf("XDP relayed %.2f%% peer->client, want at least %.0f%%", 100*sh, 100*minXDPShare)
		}
	})
}
