package daemon

import (
	"fmt"
	"net"
	"net/netip"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/pion/stun/v3"

	"github.com/l7mp/stunnerd-xdp/internal/config"
	"github.com/l7mp/stunnerd-xdp/test/packet"
	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// TestShortcutTwin plays one client's script of ChannelData against the
// daemon in userspace, once with pion/turn handling every datagram and once
// with the shortcut (userspace.Channels): the peer must get the same data
// from the same relay address at each step, and the counters must agree.
// With the shortcut, pion's handler must not see the relayed datagrams.
func TestShortcutTwin(t *testing.T) {
	const bindTimeout = 2 * time.Second
	type outcome struct {
		steps    []string
		packets  uint64
		bytes    uint64
		shortcut uint64 // datagrams the shortcut relayed
	}
	play := func(t *testing.T, shortcut bool) outcome {
		listen := netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), freePort(t))
		d, err := startThreadsErr(t, listen, "", 1, func(c *Config) {
			c.NoShortcut, c.ChannelBindTimeout = !shortcut, bindTimeout
		})
		if err != nil {
			t.Fatal(err)
		}
		peer, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
		if err != nil {
			t.Fatal(err)
		}
		defer peer.Close()
		cc, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
		if err != nil {
			t.Fatal(err)
		}
		defer cc.Close()
		server := net.UDPAddrFromAddrPort(listen)
		c := &testenv.RawTURN{T: t, Conn: cc, Server: server, User: "u", Key: stun.NewLongTermIntegrity("u", config.DefaultRealm, "p")}
		relay := c.Allocate(10 * time.Minute)
		pa := peer.LocalAddr().(*net.UDPAddr)
		bind := func(ch uint16) {
			t.Helper()
			num := stun.RawAttribute{Type: stun.AttrChannelNumber, Value: []byte{byte(ch >> 8), byte(ch), 0, 0}}
			if res := c.Do(stun.MethodChannelBind, num, testenv.PeerAddress(stun.XORMappedAddress{IP: pa.IP, Port: pa.Port})); res.Type.Class != stun.ClassSuccessResponse {
				t.Fatalf("ChannelBind %#x: %v", ch, res)
			}
		}
		// send sends p and returns what the peer got from where (with a
		// short wait when nothing is expected).
		send := func(p []byte, wait time.Duration) string {
			t.Helper()
			if _, err := cc.WriteTo(p, server); err != nil {
				t.Fatal(err)
			}
			var got []string
			buf := make([]byte, 2048)
			_ = peer.SetReadDeadline(time.Now().Add(wait))
			for {
				n, from, err := peer.ReadFrom(buf)
				if err != nil {
					break
				}
				src := "relay"
				if from.String() != relay.String() {
					src = from.String()
				}
				got = append(got, fmt.Sprintf("%q from %s", buf[:n], src))
				_ = peer.SetReadDeadline(time.Now().Add(100 * time.Millisecond))
			}
			return strings.Join(got, ", ")
		}
		var o outcome
		step := func(name string, p []byte) {
			t.Helper()
			o.steps = append(o.steps, name+": "+send(p, 300*time.Millisecond))
		}
		bind(0x4000)
		step("bound", packet.ChannelData(0x4000, []byte("one"), nil))
		bind(0x4000) // a refresh: the channel outlives the steps that wait
		step("padded", append(packet.ChannelData(0x4000, []byte("two"), nil), 0))
		bind(0x4000)
		step("length past the end", []byte{0x40, 0x00, 0x00, 0x08, 'x', 'y', 'z'})
		step("unbound channel", packet.ChannelData(0x4001, []byte("nope"), nil))
		time.Sleep(bindTimeout + time.Second)
		step("expired channel", packet.ChannelData(0x4000, []byte("three"), nil))
		bind(0x4000)
		step("bound again", packet.ChannelData(0x4000, []byte("four"), nil))
		if res := c.Do(stun.MethodRefresh, stun.RawAttribute{Type: stun.AttrLifetime, Value: []byte{0, 0, 0, 0}}); res.Type.Class != stun.ClassSuccessResponse {
			t.Fatalf("Refresh 0: %v", res)
		}
		step("deallocated", packet.ChannelData(0x4000, []byte("five"), nil))
		counters := d.UserspaceCounters()
		o.packets, o.bytes = counters.ClientToPeerPackets.Load(), counters.ClientToPeerBytes.Load()
		o.shortcut = counters.ShortcutPackets.Load()
		return o
	}
	pion := play(t, false)
	short := play(t, true)
	want := []string{
		`bound: "one" from relay`,
		`padded: "two" from relay`,
		"length past the end: ",
		"unbound channel: ",
		"expired channel: ",
		`bound again: "four" from relay`,
		"deallocated: ",
	}
	if !reflect.DeepEqual(pion.steps, want) {
		t.Errorf("pion/turn alone:\n%s\nwant\n%s", strings.Join(pion.steps, "\n"), strings.Join(want, "\n"))
	}
	if !reflect.DeepEqual(short.steps, pion.steps) {
		t.Errorf("with the shortcut:\n%s\npion/turn alone:\n%s", strings.Join(short.steps, "\n"), strings.Join(pion.steps, "\n"))
	}
	if short.packets != pion.packets || short.bytes != pion.bytes || pion.packets != 3 || pion.bytes != 10 {
		t.Errorf("client->peer counters: %d packets, %d bytes with the shortcut; %d, %d without; want 3, 10",
			short.packets, short.bytes, pion.packets, pion.bytes)
	}
	if pion.shortcut != 0 || short.shortcut != 3 {
		t.Errorf("the shortcut relayed %d datagrams (%d when off), want 3", short.shortcut, pion.shortcut)
	}
}
