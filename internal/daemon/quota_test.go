package daemon

import (
	"errors"
	"net"
	"net/netip"
	"syscall"
	"testing"
	"time"

	"github.com/pion/stun/v3"
	"github.com/pion/turn/v4"

	"github.com/l7mp/stunnerd-xdp/internal/config"
	"github.com/l7mp/stunnerd-xdp/internal/loader"
	"github.com/l7mp/stunnerd-xdp/internal/logging"
	"github.com/l7mp/stunnerd-xdp/internal/quota"
	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// startQuota runs a daemon with a UDP listener of four read loops and a TCP
// listener on the same port, and three users.
func startQuota(t *testing.T, userQuota, totalQuota int) (*Daemon, netip.AddrPort) {
	t.Helper()
	return startOnLoopback(t, func(listen netip.AddrPort) Config {
		return Config{
			Listeners: []config.ResolvedListener{
				{Name: "udp", Protocol: config.UDP, Addr: listen},
				{Name: "tcp", Protocol: config.TCP, Addr: listen},
			},
			Users:        map[string]string{"alice": "a", "bob": "b", "carol": "c"},
			RelayAddress: netip.MustParseAddr("127.0.0.1"),
			MinRelayPort: 61000, MaxRelayPort: 61999,
			XDPMode:      loader.ModeOff,
			UDPThreadNum: 4,
			UserQuota:    userQuota, TotalQuota: totalQuota,
		}
	})
}

// startOnLoopback starts the daemon of cfg(listen) on a free loopback port,
// logging warnings, and closes it when the test ends.
func startOnLoopback(t *testing.T, cfg func(listen netip.AddrPort) Config) (*Daemon, netip.AddrPort) {
	t.Helper()
	lf, err := logging.New("all:WARN", "text", &testenv.LockedBuffer{})
	if err != nil {
		t.Fatal(err)
	}
	// Another test (packages run in parallel) may take the port between
	// freePort and the bind: then try another.
	for try := 1; ; try++ {
		listen := netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), freePort(t))
		c := cfg(listen)
		c.Logger = lf
		d, err := Start(c)
		if errors.Is(err, syscall.EADDRINUSE) && try < 5 {
			t.Logf("port %d taken before the daemon bound it: %v", listen.Port(), err)
			continue
		}
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { d.Close() })
		return d, listen
	}
}

// allocateAs allocates as user over a fresh UDP socket or TCP connection.
func allocateUser(t *testing.T, server netip.AddrPort, user, pass string, tcp bool) (net.PacketConn, error) {
	t.Helper()
	var conn net.PacketConn
	if tcp {
		c, err := net.Dial("tcp4", server.String())
		if err != nil {
			t.Fatal(err)
		}
		conn = turn.NewSTUNConn(c)
	} else {
		c, err := net.ListenPacket("udp4", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		conn = c
	}
	return testenv.Allocate(t, &turn.ClientConfig{
		TURNServerAddr: server.String(), STUNServerAddr: server.String(),
		Username: user, Password: pass, Realm: config.DefaultRealm, Conn: conn,
	})
}

// wantQuotaReached fails unless err is a 486 error response.
func wantQuotaReached(t *testing.T, err error, what string) {
	t.Helper()
	var te *stun.TurnError
	if !errors.As(err, &te) || te.ErrorCodeAttr.Code != stun.CodeAllocQuotaReached {
		t.Fatalf("%s: %v, want 486 Allocation Quota Reached", what, err)
	}
}

// A user over quota is refused with 486 on every listener and read loop,
// while another user allocates; when one of the user's allocations ends,
// the user allocates again.
func TestUserQuota(t *testing.T) {
	d, listen := startQuota(t, 2, 0)
	// Two sockets: the kernel's reuseport hash puts them on read loops
	// (pion servers) of its choice; the quota counts across all of them.
	first, err := allocateUser(t, listen, "alice", "a", false)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := allocateUser(t, listen, "alice", "a", true); err != nil {
		t.Fatal(err)
	}
	for range 4 {
		_, err := allocateUser(t, listen, "alice", "a", false)
		wantQuotaReached(t, err, "alice's third allocation over UDP")
	}
	_, err = allocateUser(t, listen, "alice", "a", true)
	wantQuotaReached(t, err, "alice's third allocation over TCP")
	if _, err := allocateUser(t, listen, "bob", "b", false); err != nil {
		t.Fatalf("bob, under his quota: %v", err)
	}
	if st := d.Quota(); st.Refused[quota.UserQuota] != 5 || st.Refused[quota.TotalQuota] != 0 || st.Allocations != 3 {
		t.Fatalf("quota stats %+v, want 5 refusals by the user quota and 3 allocations", st)
	}
	if n := d.AllocationCount(); n != 3 {
		t.Fatalf("pion holds %d allocations, want 3", n)
	}
	// Closing sends a Refresh with lifetime 0: pion deletes the allocation.
	first.Close()
	waitQuota(t, d, 2)
	if _, err := allocateUser(t, listen, "alice", "a", false); err != nil {
		t.Fatalf("alice after closing one: %v", err)
	}
}

// The total quota refuses anyone once the daemon holds that many.
func TestTotalQuota(t *testing.T) {
	d, listen := startQuota(t, 0, 3)
	for _, u := range []struct {
		name, pass string
		tcp        bool
	}{{"alice", "a", false}, {"alice", "a", true}, {"bob", "b", false}} {
		if _, err := allocateUser(t, listen, u.name, u.pass, u.tcp); err != nil {
			t.Fatalf("%s: %v", u.name, err)
		}
	}
	_, err := allocateUser(t, listen, "carol", "c", false)
	wantQuotaReached(t, err, "carol over the total quota")
	_, err = allocateUser(t, listen, "carol", "c", true)
	wantQuotaReached(t, err, "carol over TCP over the total quota")
	if st := d.Quota(); st.Refused[quota.TotalQuota] != 2 || st.Allocations != 3 {
		t.Fatalf("quota stats %+v", st)
	}
	// A reload lifts the quota for new allocations.
	next := *d.config()
	next.TotalQuota = 0
	if err := d.Reconfigure(next); err != nil {
		t.Fatal(err)
	}
	if _, err := allocateUser(t, listen, "carol", "c", false); err != nil {
		t.Fatalf("carol after the reload: %v", err)
	}
}

// A failed Allocate after the quota granted it (no relay port free: 508)
// gives the slot back.
func TestQuotaFailedAllocate(t *testing.T) {
	lf, err := logging.New("all:WARN", "text", &testenv.LockedBuffer{})
	if err != nil {
		t.Fatal(err)
	}
	listen := netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), freePort(t))
	port := freePort(t)
	d, err := Start(Config{
		Listen: listen, Users: map[string]string{"alice": "a"},
		RelayAddress: netip.MustParseAddr("127.0.0.1"),
		MinRelayPort: port, MaxRelayPort: port, // one relay port
		XDPMode: loader.ModeOff, UDPThreadNum: 1, UserQuota: 2, Logger: lf,
	})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if _, err := allocateUser(t, listen, "alice", "a", false); err != nil {
		t.Fatal(err)
	}
	for range 3 {
		_, err := allocateUser(t, listen, "alice", "a", false)
		var te *stun.TurnError
		if !errors.As(err, &te) || te.ErrorCodeAttr.Code != stun.CodeInsufficientCapacity {
			t.Fatalf("with the only relay port taken: %v, want 508", err)
		}
	}
	// pion reports a failed Allocate after it answered it: wait for that.
	waitQuota(t, d, 1)
	if st := d.Quota(); st.Refused[quota.UserQuota] != 0 {
		t.Fatalf("quota stats %+v: failed allocations kept their slots", st)
	}
}

func waitQuota(t *testing.T, d *Daemon, want int) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); d.Quota().Allocations != want; {
		if time.Now().After(deadline) {
			t.Fatalf("quota counts %d allocations, want %d", d.Quota().Allocations, want)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// An allocation holds permissions for at most MaxPermissions peer IPs: one
// more is refused, a refresh is not, a channel to a held IP is bound, and
// another allocation has its own. (pion's client always asks CreatePermission
// before a ChannelBind, so ChannelBind to a new IP, which pion checks with
// the same handler, is not reached from here.)
func TestMaxPermissions(t *testing.T) {
	lf, err := logging.New("all:WARN", "text", &testenv.LockedBuffer{})
	if err != nil {
		t.Fatal(err)
	}
	listen := netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), freePort(t))
	d, err := Start(Config{
		Listen: listen, Users: map[string]string{"alice": "a"},
		RelayAddress: netip.MustParseAddr("127.0.0.1"),
		MinRelayPort: 61000, MaxRelayPort: 61999,
		AllowPeers: []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")},
		XDPMode:    loader.ModeOff, UDPThreadNum: 2, MaxPermissions: 2, Logger: lf,
	})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	client := func() (*turn.Client, net.PacketConn) {
		conn, err := net.ListenPacket("udp4", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		c, err := turn.NewClient(&turn.ClientConfig{TURNServerAddr: listen.String(), STUNServerAddr: listen.String(),
			Username: "alice", Password: "a", Realm: config.DefaultRealm, Conn: conn})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close(); conn.Close() })
		if err := c.Listen(); err != nil {
			t.Fatal(err)
		}
		relay, err := c.Allocate()
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { relay.Close() })
		return c, relay
	}
	peer := func(i byte) net.Addr { return &net.UDPAddr{IP: net.IPv4(127, 0, 0, i), Port: 9} }
	c, relay := client()
	if err := c.CreatePermission(peer(2), peer(3)); err != nil {
		t.Fatal(err)
	}
	if err := c.CreatePermission(peer(4)); err == nil {
		t.Fatal("CreatePermission to a third peer IP succeeded with --max-permissions 2")
	}
	if _, err := relay.WriteTo([]byte("x"), peer(5)); err == nil {
		t.Fatal("sending to a third peer IP succeeded with --max-permissions 2")
	}
	if err := c.CreatePermission(peer(2)); err != nil {
		t.Fatalf("refreshing a held permission: %v", err)
	}
	// The client binds a channel to the peer it sends to.
	if _, err := relay.WriteTo([]byte("x"), peer(3)); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if _, chans := d.MirrorStats(); chans == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("no channel bound to a held peer IP")
		}
	}
	if c2, _ := client(); c2.CreatePermission(peer(4), peer(5)) != nil {
		t.Fatal("another allocation could not use its own permissions")
	}
	if st := d.Quota(); st.PermissionsRefused != 2 {
		t.Fatalf("%d permissions refused, want 2", st.PermissionsRefused)
	}
}
