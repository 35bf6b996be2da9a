package bench

import (
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"sort"
	"testing"
	"time"
	"unsafe"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"golang.org/x/sys/unix"

	"github.com/l7mp/stunnerd-xdp/bpf"
	"github.com/l7mp/stunnerd-xdp/internal/channelmap"
	"github.com/l7mp/stunnerd-xdp/internal/loader"
	"github.com/l7mp/stunnerd-xdp/internal/xdpfeatures"
	"github.com/l7mp/stunnerd-xdp/test/packet"
)

// XDP verdicts.
const (
	xdpPass     = 2
	xdpTX       = 3
	xdpRedirect = 4
)

var verdictNames = map[uint32]string{1: "XDP_DROP", xdpPass: "XDP_PASS", xdpTX: "XDP_TX", xdpRedirect: "XDP_REDIRECT"}

// Rows of stage 1.
const (
	rowFloor  = "floor: trivial XDP_TX program"
	rowC2P    = "relay client→peer, 100 B ChannelData"
	rowP2C    = "relay peer→client, 100 B datagram"
	rowSTUN   = "relay, STUN Binding request (PASS pass_stun)"
	rowIPv6   = "relay client→peer, IPv6 client, 100 B ChannelData (IPv6 in, IPv4 out)"
	rowIPv6P  = "relay peer→client, IPv6 client, 100 B datagram (IPv4 in, IPv6 out)"
	rowC2PBad = "relay client→peer with repeat=N"
)

var progRunNames = []string{rowFloor, rowC2P, rowP2C, rowSTUN, rowIPv6, rowIPv6P}

// progRunAttr is the BPF_PROG_TEST_RUN part of union bpf_attr. cilium/ebpf's
// Run does not return the kernel's per-run duration, so the bench makes the
// syscall itself.
type progRunAttr struct {
	progFD      uint32
	retval      uint32
	dataSizeIn  uint32
	dataSizeOut uint32
	dataIn      uint64
	dataOut     uint64
	repeat      uint32
	duration    uint32
	ctxSizeIn   uint32
	ctxSizeOut  uint32
	ctxIn       uint64
	ctxOut      uint64
	flags       uint32
	cpu         uint32
	batchSize   uint32
	_           uint32
}

// xdpMD is struct xdp_md, the context of an XDP program run.
type xdpMD struct {
	Data, DataEnd, DataMeta, IngressIfindex, RxQueueIndex, EgressIfindex uint32
}

// progRun runs prog once per syscall on frame as if it arrived on ifindex and
// returns the kernel's run time in ns and the verdict.
func progRun(fd int, frame, out []byte, ifindex int, repeat uint32) (uint32, uint32, error) {
	ctx := xdpMD{DataEnd: uint32(len(frame)), IngressIfindex: uint32(ifindex)}
	attr := progRunAttr{
		progFD: uint32(fd), dataSizeIn: uint32(len(frame)), dataSizeOut: uint32(len(out)),
		dataIn: uint64(uintptr(unsafe.Pointer(&frame[0]))), dataOut: uint64(uintptr(unsafe.Pointer(&out[0]))),
		repeat: repeat, ctxSizeIn: uint32(unsafe.Sizeof(ctx)), ctxIn: uint64(uintptr(unsafe.Pointer(&ctx))),
	}
	_, _, errno := unix.Syscall(unix.SYS_BPF, unix.BPF_PROG_TEST_RUN, uintptr(unsafe.Pointer(&attr)), unsafe.Sizeof(attr))
	if errno != 0 {
		return 0, 0, errno
	}
	return attr.retval, attr.duration, nil
}

// stageProgRun measures the program's per-packet cost with BPF_PROG_RUN in the
// server namespace, where bpf_fib_lookup finds routes and permanent neighbours.
func (h *harness) stageProgRun(t *testing.T) {
	prog, err := loader.Load(loader.Config{ListenerPorts: []uint16{uint16(listenPort)}, MinRelayPort: 49152, MaxRelayPort: 65535, MaxBindings: 1024},
		slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})))
	if err != nil {
		t.Fatal(err)
	}
	defer prog.Close()
	floor, err := ebpf.NewProgram(&ebpf.ProgramSpec{Name: "xdp_tx_floor", Type: ebpf.XDP, License: "MIT",
		Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, xdpTX), asm.Return()}})
	if err != nil {
		t.Fatal(err)
	}
	defer floor.Close()

	b, b6 := rigBindings(40000, 5001, 50000)
	listen, listen6 := b.Listener, b6.Listener
	maps := channelmap.New(prog.Maps())
	if err := maps.SetDestinations(map[netip.AddrPort]netip.AddrPort{listen: listen, listen6: listen6}); err != nil {
		t.Fatal(err)
	}
	for _, bb := range []channelmap.Binding{b, b6} {
		if err := maps.Upsert(bb); err != nil {
			t.Fatal(err)
		}
	}
	r := h.rig
	var srv0, srv1 int
	err = r.Server.Do(func() error {
		for _, i := range []struct {
			name string
			idx  *int
		}{{r.ServerClientIf.Name, &srv0}, {r.ServerPeerIf.Name, &srv1}} {
			ifc, err := net.InterfaceByName(i.name)
			if err != nil {
				return err
			}
			*i.idx = ifc.Index
			// The devmap resolves the ifindex in the writer's namespace.
			if err := prog.Maps().TxPorts.Put(uint32(ifc.Index), uint32(ifc.Index)); err != nil {
				return err
			}
			// What the loader writes for a native attachment: the
			// kernel's word on whether the veth transmits XDP frames
			// (its far end runs XDP_PASS, so it does), and the MTU.
			feat, err := xdpfeatures.Dial()
			if err != nil {
				return err
			}
			act, err := feat.Get(ifc.Index)
			_ = feat.Close()
			if err != nil {
				return err
			}
			flags := bpf.RelayDevFlagDEV_ATTACHED_NATIVE
			if act&xdpfeatures.NDOXmit != 0 {
				flags |= bpf.RelayDevFlagDEV_XDP_XMIT | bpf.RelayDevFlagDEV_XDP_TX
			}
			if err := prog.Maps().DevCaps.Put(uint32(ifc.Index), bpf.RelayDevCap{Flags: flags, Mtu: uint32(ifc.MTU)}); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}

	mac := func(hw net.HardwareAddr) (m [6]byte) { copy(m[:], hw); return }
	data := make([]byte, 100)
	c2p := packet.Frame{DstMAC: mac(r.ServerClientIf.MAC), SrcMAC: mac(r.ClientIf.MAC), TTL: 64, ID: 1, FragOff: 0x4000,
		Src: b.Client, Dst: listen, Payload: packet.ChannelData(b.Channel, data, nil)}.Marshal()
	p2c := packet.Frame{DstMAC: mac(r.ServerPeerIf.MAC), SrcMAC: mac(r.PeerIf.MAC), TTL: 64, ID: 2,
		Src: b.Peer, Dst: b.Relay, Payload: data}.Marshal()
	stunReq := packet.Frame{DstMAC: mac(r.ServerClientIf.MAC), SrcMAC: mac(r.ClientIf.MAC), TTL: 64, ID: 3,
		Src: b.Client, Dst: listen,
		Payload: []byte{0x00, 0x01, 0x00, 0x00, 0x21, 0x12, 0xA4, 0x42, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}}.Marshal()
	ipv6 := packet.Frame{DstMAC: mac(r.ServerClientIf.MAC), SrcMAC: mac(r.ClientIf.MAC), TTL: 64,
		Src: b6.Client, Dst: listen6, Payload: packet.ChannelData(b6.Channel, data, nil)}.Marshal()
	ipv6p2c := packet.Frame{DstMAC: mac(r.ServerPeerIf.MAC), SrcMAC: mac(r.PeerIf.MAC), TTL: 64, ID: 4,
		Src: b6.Peer, Dst: b6.Relay, Payload: data}.Marshal()

	rows := []struct {
		name, frameDesc string
		prog            *ebpf.Program
		frame           []byte
		ifindex         int
		want            uint32
		repeat          uint32
	}{
		{rowFloor, fmt.Sprintf("%d-byte frame", len(c2p)), floor, c2p, srv0, xdpTX, 1},
		{rowC2P, fmt.Sprintf("%d-byte frame in on srv0", len(c2p)), prog.XDP(), c2p, srv0, xdpRedirect, 1},
		{rowP2C, fmt.Sprintf("%d-byte frame in on srv1", len(p2c)), prog.XDP(), p2c, srv1, xdpRedirect, 1},
		{rowSTUN, fmt.Sprintf("%d-byte frame in on srv0", len(stunReq)), prog.XDP(), stunReq, srv0, xdpPass, 1},
		{rowIPv6, fmt.Sprintf("%d-byte frame in on srv0", len(ipv6)), prog.XDP(), ipv6, srv0, xdpRedirect, 1},
		{rowIPv6P, fmt.Sprintf("%d-byte frame in on srv1", len(ipv6p2c)), prog.XDP(), ipv6p2c, srv1, xdpRedirect, 1},
		// The pitfall: iterations 2..N see the frame the first one rewrote.
		{rowC2PBad, fmt.Sprintf("%d-byte frame in on srv0", len(c2p)), prog.XDP(), c2p, srv0, xdpRedirect, 1000000},
	}
	var floorMedian, floorWall float64
	out := make([]byte, 4096)
	for _, row := range rows {
		runs := h.cfg.progRuns
		if row.repeat > 1 {
			runs = 5
		}
		durs := make([]float64, 0, runs)
		wrong := 0
		var lastRet uint32
		var wall time.Duration
		err := r.Server.Do(func() error {
			begin := time.Now()
			defer func() { wall = time.Since(begin) }()
			for i := 0; i < runs; i++ {
				ret, d, err := progRun(row.prog.FD(), row.frame, out, row.ifindex, row.repeat)
				if err != nil {
					return err
				}
				lastRet = ret
				if ret != row.want {
					wrong++
				}
				durs = append(durs, float64(d))
			}
			return nil
		})
		if err != nil {
			t.Fatalf("%s: BPF_PROG_RUN: %v", row.name, err)
		}
		sort.Float64s(durs)
		var sum float64
		for _, d := range durs {
			sum += d
		}
		pr := ProgRunRow{Name: row.name, Frame: row.frameDesc, Verdict: verdictNames[row.want], Runs: runs,
			MeanNs: sum / float64(len(durs)), MedianNs: quantile(durs, 0.5), P99Ns: quantile(durs, 0.99), WrongRets: wrong, Valid: true,
			Method: "repeat=1 per syscall, kernel-reported duration"}
		if row.repeat > 1 {
			pr.Valid = false
			pr.Verdict = verdictNames[lastRet] + " (last run's verdict)"
			pr.Method = fmt.Sprintf("repeat=%d in one syscall, kernel average: only iteration 1 relays", row.repeat)
		}
		pr.WallNs = float64(wall.Nanoseconds()) / float64(runs)
		if row.name == rowFloor {
			floorMedian, floorWall = pr.MedianNs, pr.WallNs
		}
		pr.WallAboveNs = pr.WallNs - floorWall
		pr.AboveNs = pr.MedianNs - floorMedian
		pr.FloorX = pr.MedianNs / floorMedian
		if pr.Valid && wrong > 0 {
			t.Errorf("%s: %d of %d runs returned another verdict than %s (last %d)", row.name, wrong, runs, pr.Verdict, lastRet)
		}
		t.Logf("%s: mean %.1f median %.0f p99 %.0f ns (%.2f × floor)", row.name, pr.MeanNs, pr.MedianNs, pr.P99Ns, pr.FloorX)
		h.rep.ProgRun = append(h.rep.ProgRun, pr)
	}
}
