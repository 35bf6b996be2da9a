package bpf_test

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"testing"
	"time"
	"unsafe"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/l7mp/stunnerd-xdp/bpf"
	"github.com/l7mp/stunnerd-xdp/internal/channelmap"
	"github.com/l7mp/stunnerd-xdp/internal/loader"
	"github.com/l7mp/stunnerd-xdp/test/packet"
	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// TestTCLiveL3Ingress: real traffic through a device without a link-layer
// header, as an overlay's decapsulated media enter a node on Calico's tunl0
// or a WireGuard device (which this kernel may lack: the kernel matrix runs
// those node shapes). A tun device (IFF_TUN: ARPHRD_NONE, no header_ops)
// stands for it: what the test writes to its file enters the node at the
// tun's ingress as an skb that starts at the IP header, and what the node
// routes into it the test reads back. The loader attaches the engine's L3
// program there by the device's type, and the Ethernet one on the NIC.
// peer->client: 500 IPv4 datagrams written to the tun, relayed by the L3
// program into the NIC, must reach the client as ChannelData from the
// listener, intact, UDP checksums verified by the client's stack;
// client->peer: 500 ChannelData messages, passed by XDP (a tun takes no XDP
// frames) and relayed by TC into the tun, must come out of it with valid
// IPv4 and UDP checksums, from the relay address.
func TestTCLiveL3Ingress(t *testing.T) {
	if testing.Short() {
		t.Skip("network namespaces: not in -short mode")
	}
	testenv.RequireRoot(t)
	for _, noKfunc := range tcSkbReads() {
		t.Run(skbReadName(noKfunc), func(t *testing.T) { liveL3Ingress(t, noKfunc) })
	}
}

func liveL3Ingress(t *testing.T, noKfunc bool) {
	client, node := testenv.NewNSWorker(t), testenv.NewNSWorker(t)
	const (
		clientAddr, listenerAddr, wildcard = "10.1.0.2:40000", "10.1.0.1:3478", "0.0.0.0:3478"
		relayAddr, peerAddr                = "10.1.0.1:50000", "10.2.0.2:5000"
	)
	var (
		clientMAC net.HardwareAddr
		tun       *os.File
		prog      *loader.Program
		tc        *loader.TC
	)
	err := node.Do(func() error {
		if err := os.WriteFile("/proc/sys/net/ipv4/conf/all/forwarding", []byte("1"), 0); err != nil {
			return err
		}
		la := netlink.NewLinkAttrs()
		la.Name = "n0"
		if err := netlink.LinkAdd(&netlink.Veth{LinkAttrs: la, PeerName: "c0"}); err != nil {
			return err
		}
		n0, _ := netlink.LinkByName("n0")
		c0, _ := netlink.LinkByName("c0")
		if err := netlink.LinkSetNsFd(c0, int(client.NS)); err != nil {
			return err
		}
		a, _ := netlink.ParseAddr("10.1.0.1/24")
		if err := netlink.AddrAdd(n0, a); err != nil {
			return err
		}
		if err := netlink.LinkSetUp(n0); err != nil {
			return err
		}
		var err error
		if tun, err = openTun("tun0"); err != nil {
			return err
		}
		l, err := netlink.LinkByName("tun0")
		if err != nil {
			return err
		}
		if l.Attrs().EncapType != "none" {
			return fmt.Errorf("tun0's link type is %q, want none (no link-layer header)", l.Attrs().EncapType)
		}
		if err := netlink.LinkSetUp(l); err != nil {
			return err
		}
		// The peer is behind the tunnel.
		return netlink.RouteAdd(&netlink.Route{LinkIndex: l.Attrs().Index, Dst: mustPrefix("10.2.0.0/24")})
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tun.Close() })
	if err := client.Do(func() error {
		l, err := netlink.LinkByName("c0")
		if err != nil {
			return err
		}
		a, _ := netlink.ParseAddr("10.1.0.2/24")
		if err := netlink.AddrAdd(l, a); err != nil {
			return err
		}
		if err := netlink.LinkSetUp(l); err != nil {
			return err
		}
		clientMAC = l.Attrs().HardwareAddr
		return netlink.RouteAdd(&netlink.Route{Gw: net.ParseIP("10.1.0.1")})
	}); err != nil {
		t.Fatal(err)
	}
	cfg := loader.Config{ListenerPorts: []uint16{3478}, MinRelayPort: 49152, MaxRelayPort: 65535, MaxBindings: 1024, TCNoKfunc: noKfunc}
	err = node.Do(func() error {
		n0, _ := netlink.LinkByName("n0")
		if err := netlink.NeighAdd(&netlink.Neigh{LinkIndex: n0.Attrs().Index, State: netlink.NUD_PERMANENT,
			IP: net.ParseIP("10.1.0.2"), HardwareAddr: clientMAC}); err != nil {
			return err
		}
		var err error
		if prog, err = loader.Load(cfg, slog.New(slog.NewTextHandler(io.Discard, nil))); err != nil {
			return err
		}
		if _, err := prog.Attach("n0", loader.ModeNative); err != nil {
			return err
		}
		if tc, err = prog.LoadTC(); err != nil {
			return err
		}
		for _, dev := range []string{"n0", "tun0"} {
			if err := tc.Attach(dev); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = node.Do(func() error { tc.Close(); return prog.Close() })
	})
	maps := channelmap.New(prog.Maps())
	if err := maps.SetDestinations(map[netip.AddrPort]netip.AddrPort{ap(listenerAddr): ap(wildcard)}); err != nil {
		t.Fatal(err)
	}
	b := channelmap.Binding{Client: ap(clientAddr), Listener: ap(wildcard), Channel: liveChannel, Peer: ap(peerAddr), Relay: ap(relayAddr)}
	if err := maps.Upsert(b); err != nil {
		t.Fatal(err)
	}
	var clientConn *net.UDPConn
	if err := client.Do(func() error {
		var err error
		clientConn, err = net.ListenUDP("udp4", net.UDPAddrFromAddrPort(ap(clientAddr)))
		return err
	}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { clientConn.Close() })
	testenv.ReadBuffer(t, clientConn, 4<<20)

	// The node has talked to the peer: the stack made the tun's neighbour
	// entry (NUD_NOARP), which bpf_fib_lookup needs to answer.
	if err := node.Do(func() error {
		c, err := net.Dial("udp4", "10.2.0.2:9")
		if err != nil {
			return err
		}
		defer c.Close()
		_, err = c.Write([]byte("hello"))
		return err
	}); err != nil {
		t.Fatal(err)
	}
	if _, err := readTun(t, tun); err != nil {
		t.Fatalf("the node's datagram to the peer: %v", err)
	}

	stats := liveBPFStats(t)
	before := stats.read(t, prog, tc)
	payload := func(dir string, i int) []byte {
		return fmt.Appendf(nil, "%s %04d %s", dir, i, bytes.Repeat([]byte("y"), i%200))
	}

	// peer->client: IPv4 datagrams from the peer into the tun (as
	// decapsulated), ChannelData at the client. The client's learned reply
	// source is the listener: a ChannelData message from the client first.
	if _, err := clientConn.WriteToUDPAddrPort(channelData(payload("hello", 0)), ap(listenerAddr)); err != nil {
		t.Fatal(err)
	}
	if _, err := readTun(t, tun); err != nil {
		t.Fatalf("the first client->peer message: %v", err)
	}
	got := 0
	buf := make([]byte, 2048)
	for i := range liveN {
		f := packet.Frame{TTL: 63, ID: uint16(i), Src: ap(peerAddr), Dst: ap(relayAddr), Payload: payload("p2c", i)}
		if _, err := tun.Write(f.Marshal()[packet.EthLen:]); err != nil {
			t.Fatalf("write to the tun: %v", err)
		}
		// Read as it is written: the client's socket buffer is not the test.
		if err := clientConn.SetReadDeadline(time.Now().Add(testenv.Timeout(2 * time.Second))); err != nil {
			t.Fatal(err)
		}
		n, from, err := clientConn.ReadFromUDPAddrPort(buf)
		if err != nil {
			t.Errorf("peer->client %d: %v", i, err)
			break
		}
		d := payload("p2c", i)
		msg := buf[:n]
		if from != ap(listenerAddr) || len(msg) != 4+len(d) || binary.BigEndian.Uint16(msg) != liveChannel ||
			int(binary.BigEndian.Uint16(msg[2:])) != len(d) || !bytes.Equal(msg[4:], d) {
			t.Errorf("peer->client %d: from %v: %x", i, from, msg)
			continue
		}
		got++
	}
	if got != liveN {
		t.Errorf("peer->client: %d of %d arrived", got, liveN)
	}

	// client->peer: ChannelData to the listener, IPv4 out of the tun.
	got = 0
	for i := range liveN {
		if _, err := clientConn.WriteToUDPAddrPort(channelData(payload("c2p", i)), ap(listenerAddr)); err != nil {
			t.Fatal(err)
		}
		ip, err := readTun(t, tun)
		if err != nil {
			t.Errorf("client->peer %d: %v", i, err)
			break
		}
		p, err := packet.Parse(append(make([]byte, 12), append([]byte{0x08, 0x00}, ip...)...))
		if err != nil {
			t.Errorf("client->peer %d: %v: %x", i, err, ip)
			continue
		}
		if p.Src != ap(relayAddr) || p.Dst != ap(peerAddr) || !bytes.Equal(p.Payload, payload("c2p", i)) || p.UDPChecksum == 0 {
			t.Errorf("client->peer %d: %v -> %v, checksum %#04x: %q", i, p.Src, p.Dst, p.UDPChecksum, p.Payload)
			continue
		}
		got++
	}
	if got != liveN {
		t.Errorf("client->peer: %d of %d came out of the tun", got, liveN)
	}

	after := stats.read(t, prog, tc)
	tcv := diff(after.tc, before.tc)
	if tcv[bpf.RelayReasonREASON_RELAY_P2C_REDIRECT] != liveN || tcv[bpf.RelayReasonREASON_RELAY_C2P_REDIRECT] != liveN+1 {
		t.Errorf("TC relayed %d p2c, %d c2p; want %d and %d (TC verdicts %v)", tcv[bpf.RelayReasonREASON_RELAY_P2C_REDIRECT],
			tcv[bpf.RelayReasonREASON_RELAY_C2P_REDIRECT], liveN, liveN+1, nonZero(tcv))
	}
	t.Logf("XDP verdicts %v; TC verdicts %v", nonZero(diff(after.xdp, before.xdp)), nonZero(tcv))
	if n := udpCsumErrors(t, client); n != 0 {
		t.Errorf("client: %d UDP checksum errors", n)
	}
}

// channelData is a ChannelData message on the live tests' channel, padded.
func channelData(d []byte) []byte {
	m := make([]byte, 4+len(d)+(4-len(d)%4)%4)
	binary.BigEndian.PutUint16(m, liveChannel)
	binary.BigEndian.PutUint16(m[2:], uint16(len(d)))
	copy(m[4:], d)
	return m
}

// openTun makes a tun device (IFF_TUN, no packet information: its file reads
// and writes bare IP packets) in the calling thread's network namespace.
func openTun(name string) (*os.File, error) {
	fd, err := unix.Open("/dev/net/tun", unix.O_RDWR|unix.O_CLOEXEC|unix.O_NONBLOCK, 0)
	if errors.Is(err, unix.ENOENT) {
		// A minimal /dev (the kernel matrix's guests) has no node until the
		// module is in: load it, or make the node (misc 10:200), whose
		// opening asks the kernel to load it.
		_ = exec.Command("modprobe", "tun").Run()
		if _, serr := os.Stat("/dev/net/tun"); serr != nil {
			_ = os.MkdirAll("/dev/net", 0o755)
			_ = unix.Mknod("/dev/net/tun", unix.S_IFCHR|0o666, int(unix.Mkdev(10, 200)))
		}
		fd, err = unix.Open("/dev/net/tun", unix.O_RDWR|unix.O_CLOEXEC|unix.O_NONBLOCK, 0)
	}
	if err != nil {
		return nil, fmt.Errorf("open /dev/net/tun: %w", err)
	}
	var req [unix.IFNAMSIZ + 64]byte
	copy(req[:], name)
	binary.NativeEndian.PutUint16(req[unix.IFNAMSIZ:], unix.IFF_TUN|unix.IFF_NO_PI)
	if _, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), unix.TUNSETIFF, uintptr(unsafe.Pointer(&req[0]))); errno != 0 {
		unix.Close(fd)
		return nil, fmt.Errorf("TUNSETIFF %s: %w", name, errno)
	}
	return os.NewFile(uintptr(fd), "/dev/net/tun"), nil
}

// readTun reads the next IPv4 UDP packet the node routed into the tun,
// skipping anything else (IPv6 router solicitations and the like).
func readTun(t *testing.T, tun *os.File) ([]byte, error) {
	t.Helper()
	buf := make([]byte, 2048)
	deadline := time.Now().Add(testenv.Timeout(2 * time.Second))
	for {
		if err := tun.SetReadDeadline(deadline); err != nil {
			return nil, err
		}
		n, err := tun.Read(buf)
		if errors.Is(err, os.ErrDeadlineExceeded) {
			return nil, errors.New("nothing came out of the tun")
		}
		if err != nil {
			return nil, err
		}
		if n >= 28 && buf[0]>>4 == 4 && buf[9] == unix.IPPROTO_UDP {
			return buf[:n], nil
		}
	}
}

func mustPrefix(s string) *net.IPNet {
	_, n, err := net.ParseCIDR(s)
	if err != nil {
		panic(err)
	}
	return n
}
