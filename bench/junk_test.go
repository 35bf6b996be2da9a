package bench

import (
	"crypto/rand"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pion/stun/v3"
	"github.com/pion/turn/v4"

	"github.com/l7mp/stunnerd-xdp/test/netns"
	"github.com/l7mp/stunnerd-xdp/test/packet"
)

// The junk stage (issue 39): a listener under junk. From junkSources
// addresses of the client's network, junkSockets sockets send a mix of what a
// TURN server on the internet receives and pion/turn discards or refuses:
// ChannelData on a channel nobody bound, unauthenticated Allocate requests and
// random bytes, at a rising rate. Meanwhile a real session, allocated before
// the junk starts, echoes junkEchoes datagrams through the relay, and
// junkAllocates new clients allocate. Each server takes every rung fresh.

const (
	junkSources   = 8
	junkSockets   = 32
	junkAllocates = 10
)

// Junk servers: stunnerd-xdp with default flags (the shield on, XDP native)
// and with --xdp-mode=off, coturn beside them.
var junkSpecs = []serverSpec{specXDPNative, specXDPOff, specCoturn}

// junkPayloads are one socket's cycle: ChannelData on an unbound channel, an
// unauthenticated Allocate (its own transaction), random bytes that are
// neither STUN nor ChannelData.
func junkPayloads() [][]byte {
	allocate := stun.MustBuild(stun.TransactionID, stun.NewType(stun.MethodAllocate, stun.ClassRequest),
		stun.RawAttribute{Type: stun.AttrRequestedTransport, Value: []byte{17, 0, 0, 0}}, stun.Fingerprint)
	random := make([]byte, 100)
	_, _ = rand.Read(random)
	random[0] |= 0x80
	return [][]byte{packet.ChannelData(0x4123, make([]byte, 100), nil), allocate.Raw, random}
}

func (h *harness) stageJunk(t *testing.T) {
	// The junk's source addresses, beside the client's.
	for i := range junkSources {
		h.rig.Client.IP(t, "addr", "add", fmt.Sprintf("10.100.0.%d/24", 20+i), "dev", h.rig.ClientIf.Name)
	}
	t.Cleanup(func() {
		for i := range junkSources {
			_, _ = netns.Exec("ip", "-n", h.rig.Client.Name, "addr", "del", fmt.Sprintf("10.100.0.%d/24", 20+i), "dev", h.rig.ClientIf.Name)
		}
	})
	for round := 1; round <= h.cfg.junkRounds; round++ {
		for _, rate := range h.cfg.junkLadder {
			for i := range junkSpecs {
				spec := junkSpecs[(i+round-1)%len(junkSpecs)]
				t.Run(fmt.Sprintf("round%d/%s/%s", round, junkLabel(rate), spec.name), func(t *testing.T) {
					h.junkOne(t, spec, rate, round)
				})
			}
		}
	}
}

// junkOne runs one rung: the server fresh, the session, then the junk at rate
// (-1: none; 0: as fast as the generator goes) for the echoes' time.
func (h *harness) junkOne(t *testing.T, spec serverSpec, rate float64, round int) {
	rs := h.startServer(t, spec)
	defer h.stopServer(t, rs)
	sess := newSession(t, h, listenAddr)
	defer sess.close()

	var streams []*stream
	payloads := junkPayloads()
	for i := range junkSockets {
		ip := net.IPv4(10, 100, 0, byte(20+i%junkSources)).To4()
		fd, _ := rawSocket(t, h.rig.Client, ip, 0, 0)
		// Each socket starts its cycle elsewhere: the mix is even at any
		// instant.
		p := append(append([][]byte(nil), payloads[i%3:]...), payloads[:i%3]...)
		streams = append(streams, &stream{fd: fd, dst: sockaddr(listenIP, listenPort), payloads: p})
	}
	before, err := h.junkCounts(spec)
	if err != nil {
		t.Fatal(err)
	}
	cpu0, err := takeCPU(rs.proc.PID())
	if err != nil {
		t.Fatal(err)
	}
	dur := h.cfg.junkEcho + time.Second
	start := time.Now()
	var gen genResult
	var wg sync.WaitGroup
	if rate >= 0 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			gen = generate(streams, rate, dur, 1)
		}()
	}
	// The Allocates, spread over the junk's time, each from a new socket
	// of the client's address.
	var allocated atomic.Int32
	var allocErrs []string
	var mu sync.Mutex
	for i := range junkAllocates {
		wg.Add(1)
		go func() {
			defer wg.Done()
			time.Sleep(500*time.Millisecond + time.Duration(i)*h.cfg.junkEcho/junkAllocates)
			if err := h.allocateOnce(); err != nil {
				mu.Lock()
				allocErrs = append(allocErrs, err.Error())
				mu.Unlock()
				return
			}
			allocated.Add(1)
		}()
	}
	time.Sleep(500 * time.Millisecond) // the junk flows before the echoes start
	echo := sess.latency(t, spec.name, float64(h.cfg.junkEchoes)/h.cfg.junkEcho.Seconds(), h.cfg.junkEcho, 100)
	wg.Wait()
	elapsed := time.Since(start)
	cpu1, err := takeCPU(rs.proc.PID())
	if err != nil {
		t.Fatal(err)
	}
	after, err := h.junkCounts(spec)
	if err != nil {
		t.Fatal(err)
	}
	row := JunkRow{Server: spec.name, Round: round, TargetPPS: rate, Seconds: dur.Seconds(),
		JunkSent: gen.sent, EchoesSent: echo.Sent, Echoes: echo.Received,
		AllocatesTried: junkAllocates, Allocates: int(allocated.Load()),
		ServerCores:   float64(cpu1.proc-cpu0.proc) / float64(clockTick) / elapsed.Seconds(),
		KernelDropped: after.kernel - before.kernel, UserDropped: after.user - before.user,
		Counted: spec.xdpMode != ""}
	if gen.elapsed > 0 {
		row.JunkPPS = float64(gen.sent) / gen.elapsed.Seconds()
	}
	h.rep.Junk = append(h.rep.Junk, row)
	t.Logf("round %d: %s junk %s: sent %.0f pps; echoes %d/%d, allocates %d/%d, server %.2f cores, shield dropped %d in the kernel, %d in userspace%s",
		round, spec.name, junkLabel(rate), row.JunkPPS, row.Echoes, row.EchoesSent, row.Allocates, row.AllocatesTried,
		row.ServerCores, row.KernelDropped, row.UserDropped, strings.Join(append([]string{""}, allocErrs...), "; "))
}

// allocateOnce allocates from a new socket of the client's address and
// releases it.
func (h *harness) allocateOnce() error {
	var conn net.PacketConn
	if err := h.rig.Client.Do(func() (err error) {
		conn, err = net.ListenPacket("udp4", clientIP.String()+":0")
		return err
	}); err != nil {
		return err
	}
	defer conn.Close()
	c, err := turn.NewClient(&turn.ClientConfig{STUNServerAddr: listenAddr.String(), TURNServerAddr: listenAddr.String(),
		Username: user, Password: password, Conn: conn, LoggerFactory: quietLogger()})
	if err != nil {
		return err
	}
	defer c.Close()
	if err := c.Listen(); err != nil {
		return err
	}
	relay, err := c.Allocate()
	if err != nil {
		return err
	}
	return relay.Close()
}

// junkCounts are what the shield dropped so far: in the kernel and in the
// read loops (stunnerd-xdp only).
type junkCount struct{ kernel, user uint64 }

func (h *harness) junkCounts(spec serverSpec) (junkCount, error) {
	if spec.xdpMode == "" {
		return junkCount{}, nil
	}
	m, err := h.scrape()
	if err != nil {
		return junkCount{}, err
	}
	var c junkCount
	for _, r := range []string{"drop_shield_no_allocation", "drop_shield_not_turn", "drop_shield_stun_unhandled", "drop_shield_admission"} {
		if v, ok := m.Sum("stunnerd_xdp_verdicts_total", "reason", r); ok {
			c.kernel += uint64(v)
		}
		if v, ok := m.Sum("stunnerd_xdp_tc_verdicts_total", "reason", r); ok {
			c.kernel += uint64(v)
		}
		if v, ok := m.Sum("stunnerd_xdp_userspace_shield_dropped_total", "reason", r); ok {
			c.user += uint64(v)
		} else {
			return c, errors.New("no stunnerd_xdp_userspace_shield_dropped_total")
		}
	}
	return c, nil
}
