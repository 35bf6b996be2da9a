package bpf_test

import (
	"sort"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/l7mp/stunnerd-xdp/test/packet"
)

// progRunAttr is the BPF_PROG_TEST_RUN part of union bpf_attr: cilium/ebpf's
// Run does not return the kernel's per-run duration.
type progRunAttr struct {
	progFD, retval, dataSizeIn, dataSizeOut uint32
	dataIn, dataOut                         uint64
	repeat, duration, ctxSizeIn, ctxSizeOut uint32
	ctxIn, ctxOut                           uint64
	flags, cpu, batchSize, _                uint32
}

// BenchmarkProgRun is the program's per-packet cost on the cached (hot) path
// of each relayed shape, and on a passed STUN request: the kernel's duration of
// one run per BPF_PROG_RUN (repeat=1: a rewritten frame cannot be run again),
// the median over b.N runs, reported as ns/pkt. Compare two builds by running
// each build's test binary alternately (timings on a shared machine are noisy).
func BenchmarkProgRun(b *testing.B) {
	e := newEnv(b)
	e.install(b)
	redirect, tx, v6 := bindings["redirect"], bindings["tx"], bindings["v6redirect"]
	stun := []byte{0x00, 0x01, 0x00, 0x00, 0x21, 0x12, 0xA4, 0x42, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}
	stunFrame := fromClient(redirect, "10.100.0.1", stun)
	txFrame := fromPeer(tx, data(100))
	txFrame.SrcMAC = peer2MAC
	rows := []struct {
		name, ingress string
		frame         packet.Frame
		want          uint32
	}{
		{"c2p-redirect-100B", "a0", fromClient(redirect, "10.100.0.1", packet.ChannelData(redirect.Channel, data(100), nil)), xdpRedirect},
		{"p2c-redirect-100B", "b0", fromPeer(redirect, data(100)), xdpRedirect},
		{"c2p-tx-100B", "a0", fromClient(tx, "10.100.0.1", packet.ChannelData(tx.Channel, data(100), nil)), xdpTX},
		{"p2c-tx-100B", "a0", txFrame, xdpTX},
		{"c2p-ipv6-redirect-100B", "a0", fromClient(v6, "fd00:100::1", packet.ChannelData(v6.Channel, data(100), nil)), xdpRedirect},
		{"p2c-ipv6-redirect-100B", "b0", fromPeer(v6, data(100)), xdpRedirect},
		{"stun-pass", "a0", stunFrame, xdpPass},
		// UDP that is not the relay's (a port neither a listener's, a relay
		// port nor a learned NodePort): the pass path every other datagram
		// of the node takes.
		{"not-ours-pass", "a0", toPort(fromClient(redirect, "10.100.0.1", data(100)), 8472), xdpPass},
		{"c2p-nodeport-tx-100B", "a0", toPort(fromClient(bindings["nodeport"], "10.100.0.1",
			packet.ChannelData(bindings["nodeport"].Channel, data(100), nil)), nodePort), xdpRedirect},
	}
	for _, row := range rows {
		b.Run(row.name, func(b *testing.B) {
			frame := row.frame.Marshal()
			out := make([]byte, len(frame)+512)
			ctx := xdpMD{DataEnd: uint32(len(frame)), IngressIfindex: uint32(e.ifaces[row.ingress].index)}
			durs := make([]float64, 0, b.N)
			err := e.ns.Do(func() error {
				for i := 0; i < b.N+1; i++ {
					attr := progRunAttr{progFD: uint32(e.prog.XDP().FD()), dataSizeIn: uint32(len(frame)),
						dataSizeOut: uint32(len(out)), dataIn: uint64(uintptr(unsafe.Pointer(&frame[0]))),
						dataOut: uint64(uintptr(unsafe.Pointer(&out[0]))), repeat: 1,
						ctxSizeIn: uint32(unsafe.Sizeof(ctx)), ctxIn: uint64(uintptr(unsafe.Pointer(&ctx)))}
					_, _, errno := unix.Syscall(unix.SYS_BPF, unix.BPF_PROG_TEST_RUN, uintptr(unsafe.Pointer(&attr)), unsafe.Sizeof(attr))
					if errno != 0 {
						return errno
					}
					if attr.retval != row.want {
						b.Fatalf("verdict %d, want %d", attr.retval, row.want)
					}
					if i > 0 { // the first run fills the caches
						durs = append(durs, float64(attr.duration))
					}
				}
				return nil
			})
			if err != nil {
				b.Fatal(err)
			}
			sort.Float64s(durs)
			b.ReportMetric(durs[len(durs)/2], "ns/pkt")
		})
	}
}
