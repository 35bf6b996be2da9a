package e2e

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"net"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/l7mp/stunnerd-xdp/bpf"
	"github.com/l7mp/stunnerd-xdp/internal/loader"
	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// taggedSession is a good flow: it sends datagrams carrying its own tag and a
// sequence number through its allocation to the echo peer (peer, or the rig's
// echo peer at peerAddr:5002 when nil) and checks that every echo it gets is
// its own and comes from that peer.
type taggedSession struct {
	peer                    *net.UDPAddr
	limit                   int64 // when not 0, the session sends this many datagrams at most
	sent, received, foreign atomic.Int64
	last                    atomic.Int64 // when the last echo came, in Unix ns
	sending                 atomic.Bool  // run is still sending
}

// allIn says whether every datagram sent so far has its answer, and nothing
// more is to be sent.
func (s *taggedSession) allIn() bool {
	return !s.sending.Load() && s.received.Load()+s.foreign.Load() >= s.sent.Load()
}

// taggedSize is the datagram a tagged session sends: the tag and a sequence number.
const taggedSize = 16

func (s *taggedSession) run(t *testing.T, relay net.PacketConn, tag uint64, rate int, d time.Duration) {
	peer := s.peer
	if peer == nil {
		peer = &net.UDPAddr{IP: net.ParseIP(peerAddr), Port: 5002}
	}
	readDone := make(chan struct{})
	s.sending.Store(true)
	go func() {
		defer close(readDone)
		buf := make([]byte, 1500)
		for {
			// Done when every echo is in; else the last echoes get a second
			// (scaled: in a slow guest, waiting it out cost every row 18 s).
			if s.allIn() {
				return
			}
			_ = relay.SetReadDeadline(time.Now().Add(testenv.Timeout(time.Second))) // the last echoes
			n, from, err := relay.ReadFrom(buf)
			if err != nil {
				return
			}
			if n != taggedSize || binary.BigEndian.Uint64(buf) != tag || from.String() != peer.String() {
				s.foreign.Add(1)
				continue
			}
			s.received.Add(1)
			s.last.Store(time.Now().UnixNano())
		}
	}()
	msg := make([]byte, taggedSize)
	binary.BigEndian.PutUint64(msg, tag)
	// Paced against the clock: a ticker this fast falls behind on this VM.
	interval := time.Second / time.Duration(rate)
	start := time.Now()
	for i := 0; time.Since(start) < d && (s.limit == 0 || s.sent.Load() < s.limit); i++ {
		if wait := time.Until(start.Add(time.Duration(i) * interval)); wait > 0 {
			time.Sleep(wait)
		}
		binary.BigEndian.PutUint64(msg[8:], uint64(s.sent.Load()))
		if _, err := relay.WriteTo(msg, peer); err != nil {
			t.Errorf("tagged session %d: %v", tag, err)
			return
		}
		s.sent.Add(1)
	}
	s.sending.Store(false)
	if s.allIn() {
		_ = relay.SetReadDeadline(time.Now()) // wake the reader blocked on its deadline
	}
	<-readDone
}

// TestChurnWhileTrafficFlows creates and deletes allocations and channel
// bindings from several goroutines while tagged sessions flow on others: no
// session gets a packet that is not its own, churned clients (whose peer never
// answers) get nothing at all, and no map entry survives its allocation.
func TestChurnWhileTrafficFlows(t *testing.T) {
	inRig(t, false, func(t *testing.T, r rig) {
		d := startDaemon(t, loader.ModeNative, r.serverIfaces, nil)
		startEcho(t, r.peer, echoPeer)
		// The churned clients send to a port where nothing listens.
		sink := &net.UDPAddr{IP: net.ParseIP(peerAddr), Port: 5009}

		const sessions = 4
		good := make([]*taggedSession, sessions)
		var wg sync.WaitGroup
		for i := range good {
			relay, err := allocateFrom(t, r.client)
			if err != nil {
				t.Fatal(err)
			}
			good[i] = &taggedSession{}
			wg.Add(1)
			go func(i int) {
				defer wg.Done()
				good[i].run(t, relay, uint64(0xC0FFEE00+i), 500, 8*time.Second)
			}(i)
		}

		const workers, perWorker = 4, 500
		var churned, strayData atomic.Int64
		var cwg sync.WaitGroup
		for w := 0; w < workers; w++ {
			cwg.Add(1)
			go func(w int) {
				defer cwg.Done()
				for i := 0; i < perWorker; i++ {
					relay, err := allocateFrom(t, r.client)
					if err != nil {
						t.Errorf("churn allocation: %v", err)
						return
					}
					// Permission, then a channel, to a peer that never answers.
					for k := 0; k < 3; k++ {
						_, _ = relay.WriteTo([]byte(fmt.Sprintf("churn %d/%d", w, i)), sink)
					}
					_ = relay.SetReadDeadline(time.Now().Add(time.Duration(rand.IntN(20)) * time.Millisecond))
					if _, _, err := relay.ReadFrom(make([]byte, 1500)); err == nil {
						strayData.Add(1)
					}
					_ = relay.Close()
					churned.Add(1)
				}
			}(w)
		}
		cwg.Wait()
		wg.Wait()
		st := d.Mirror().Stats()
		t.Logf("%d allocations churned; %d bindings installed and %d removed in the maps, which now hold %d",
			churned.Load(), st.Installs, st.Removals, d.Maps().Len())
		if st.Installs < 500 || st.Removals+sessions < st.Installs {
			t.Errorf("the churn did not go through the maps: %+v", st)
		}
		for i, s := range good {
			t.Logf("session %d: sent %d, echoed %d, foreign %d", i, s.sent.Load(), s.received.Load(), s.foreign.Load())
			if s.foreign.Load() != 0 {
				t.Errorf("session %d received %d datagrams that were not its own", i, s.foreign.Load())
			}
			if float64(s.received.Load()) < 0.99*float64(s.sent.Load()) {
				t.Errorf("session %d: %d of %d echoes", i, s.received.Load(), s.sent.Load())
			}
		}
		if strayData.Load() != 0 {
			t.Errorf("%d churned clients received data from a peer that never sends", strayData.Load())
		}
		// The good sessions' allocations are still there: their bindings and
		// nothing else. Then close everything: the maps must be empty.
		waitFor(t, fmt.Sprintf("after the churn: %d bindings and %d allocations", sessions, sessions), 3*time.Second, func() bool {
			return d.Maps().Len() == sessions && d.AllocationCount() == sessions
		})
		kernel, err := d.Maps().Dump()
		if err != nil || len(kernel) != sessions {
			t.Fatalf("kernel holds %d client->peer entries (%v), want %d", len(kernel), err, sessions)
		}
		if n, _ := d.Maps().DumpPeerToClient(); n != sessions {
			t.Fatalf("kernel holds %d peer->client entries, want %d", n, sessions)
		}
		p := snapshot(t, d)
		var sent int64
		for _, s := range good {
			sent += s.sent.Load()
		}
		// Every packet a session sent was relayed by one path or the other, and
		// the churned clients' few sends on top.
		if relayed := int64(p.xdp.ClientToPeerPackets + p.userC2P); relayed < sent {
			t.Errorf("counters: %d client->peer packets relayed, the sessions sent %d", relayed, sent)
		}
	})
}

// TestJunkFlood floods the listener with junk UDP and malformed ChannelData at
// the generator's full rate for 10 s while a session flows through XDP: the
// session keeps flowing, the daemon's memory stays bounded, and the junk is
// counted by reason (the listener shield's drops, and the passed Binding
// requests).
func TestJunkFlood(t *testing.T) {
	inRig(t, false, func(t *testing.T, r rig) {
		d, relay := startEchoSession(t, r, loader.ModeNative)
		good := &taggedSession{}
		done := make(chan struct{})
		go func() {
			defer close(done)
			good.run(t, relay, 0xBEEF, 500, 12*time.Second)
		}()
		time.Sleep(time.Second)
		before := snapshot(t, d)
		var ms runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&ms)
		heapBefore := ms.HeapInuse

		// The junk generator: one socket in the client namespace, bounded in
		// time, as fast as it goes.
		var sentJunk int64
		if err := r.client.Do(func() error {
			c, err := net.DialUDP("udp4", nil, &net.UDPAddr{IP: net.ParseIP("10.100.0.1"), Port: 3478})
			if err != nil {
				return err
			}
			defer c.Close()
			junk := [][]byte{
				{0x40, 0x00, 0x00, 0x10, 1, 2},                     // ChannelData longer than the datagram
				append([]byte{0x4f, 0xff, 0x00, 0x04}, 1, 2, 3, 4), // unbound channel
				{0x40, 0x00},                   // too short
				bytes.Repeat([]byte{0x41}, 64), // channel 0x4141, length 0x4141
				append([]byte{0x00, 0x01, 0x00, 0x00, 0x21, 0x12, 0xa4, 0x42}, make([]byte, 12)...), // unauthenticated Binding request
				{0x80, 0, 0, 0}, // neither STUN nor ChannelData
			}
			for end := time.Now().Add(10 * time.Second); time.Now().Before(end); {
				for i := 0; i < 1000; i++ {
					if _, err := c.Write(junk[i%len(junk)]); err == nil {
						sentJunk++
					}
				}
			}
			return nil
		}); err != nil {
			t.Fatal(err)
		}
		<-done
		after := snapshot(t, d)
		runtime.GC()
		runtime.ReadMemStats(&ms)
		t.Logf("junk: %d datagrams in 10 s (%.0f/s); heap in use %d -> %d KiB", sentJunk, float64(sentJunk)/10, heapBefore>>10, ms.HeapInuse>>10)
		t.Logf("session: sent %d, echoed %d, foreign %d", good.sent.Load(), good.received.Load(), good.foreign.Load())
		if float64(good.received.Load()) < 0.99*float64(good.sent.Load()) || good.foreign.Load() != 0 {
			t.Errorf("the session suffered under the flood: %d of %d echoes, %d foreign", good.received.Load(), good.sent.Load(), good.foreign.Load())
		}
		if ms.HeapInuse > heapBefore+64<<20 {
			t.Errorf("heap grew from %d to %d KiB under the flood", heapBefore>>10, ms.HeapInuse>>10)
		}
		counted := int64(0)
		// The listener shield drops what pion/turn would discard (the
		// ChannelData of a client without an allocation, what is not TURN);
		// the Binding request passes to pion.
		for _, reason := range []bpf.RelayReason{bpf.RelayReasonREASON_NOT_TURN, bpf.RelayReasonREASON_NO_ALLOCATION, bpf.RelayReasonREASON_STUN} {
			n := int64(after.verdicts[reason] - before.verdicts[reason])
			t.Logf("verdict %d: +%d", reason, n)
			if n == 0 {
				t.Errorf("no junk counted as reason %d", reason)
			}
			counted += n
		}
		// Nearly everything sent reached the program: under a flood the veth
		// ring drops a little before XDP sees it.
		if float64(counted) < 0.99*float64(sentJunk) {
			t.Errorf("the program counted %d junk datagrams by reason, %d were sent", counted, sentJunk)
		}
	})
}
