package daemon

import (
	"fmt"
	"net/netip"
	"testing"
	"time"

	"github.com/l7mp/stunnerd-xdp/internal/config"
	"github.com/l7mp/stunnerd-xdp/internal/loader"
	"github.com/l7mp/stunnerd-xdp/internal/quota"
)

// startDefaultQuotas runs a daemon with the default quotas (AutoQuota) and
// the credentials and relay port range given.
func startDefaultQuotas(t *testing.T, users map[string]string, secret string, minPort, maxPort uint16) (*Daemon, netip.AddrPort) {
	t.Helper()
	return startOnLoopback(t, func(listen netip.AddrPort) Config {
		return Config{
			Listeners:    []config.ResolvedListener{{Name: "udp", Protocol: config.UDP, Addr: listen}},
			Users:        users,
			Secret:       secret,
			RelayAddress: netip.MustParseAddr("127.0.0.1"),
			MinRelayPort: minPort, MaxRelayPort: maxPort,
			XDPMode:   loader.ModeOff,
			UserQuota: AutoQuota, TotalQuota: AutoQuota,
		}
	})
}

// With the default quotas, one ephemeral user-id holds at most
// quota.DefaultPerUser allocations, however many fresh credentials (either
// username order, any expiry) it uses; another user-id still allocates.
func TestDefaultUserQuota(t *testing.T) {
	d, listen := startDefaultQuotas(t, nil, "s3cret", 61000, 61999)
	if l := d.quota.Limits(); l.PerUser != quota.DefaultPerUser || l.Total != 1000 {
		t.Fatalf("default limits %+v, want %d per user and 1000 (the relay ports) in total", l, quota.DefaultPerUser)
	}
	exp := time.Now().Add(time.Hour).Unix()
	name := func(i int, user string) string {
		if i%2 == 0 {
			return fmt.Sprintf("%d:%s", exp+int64(i), user)
		}
		return fmt.Sprintf("%s:%d", user, exp+int64(i))
	}
	for i := range quota.DefaultPerUser {
		n := name(i, "mallory")
		if _, err := allocateUser(t, listen, n, restPassword("s3cret", n), false); err != nil {
			t.Fatalf("mallory's allocation %d: %v", i+1, err)
		}
	}
	n := name(quota.DefaultPerUser, "mallory")
	_, err := allocateUser(t, listen, n, restPassword("s3cret", n), false)
	wantQuotaReached(t, err, "mallory's allocation over the default quota")
	n = name(0, "alice")
	if _, err := allocateUser(t, listen, n, restPassword("s3cret", n), false); err != nil {
		t.Fatalf("alice, while mallory holds her quota: %v", err)
	}
	if st := d.Quota(); st.Refused[quota.UserQuota] != 1 || st.Allocations != quota.DefaultPerUser+1 {
		t.Fatalf("quota stats %+v", st)
	}
}

// With the default quotas and one static username (every client is that
// user: no per-user quota), the total quota follows the memory limit when it
// allows fewer allocations than the relay ports: the one over it gets 486,
// not the 508 of an exhausted port range.
func TestDefaultTotalQuotaFollowsMemory(t *testing.T) {
	defer func(f func() (uint64, error)) { memoryLimit = f }(memoryLimit)
	memoryLimit = func() (uint64, error) { return 8 * quota.MemoryShare * quota.AllocationBytes, nil }
	d, listen := startDefaultQuotas(t, map[string]string{"user1": "p"}, "", 61000, 61999)
	if l := d.quota.Limits(); l.PerUser != 0 || l.Total != 8 {
		t.Fatalf("default limits %+v, want none per user and 8 in total", l)
	}
	for i := range 8 {
		if _, err := allocateUser(t, listen, "user1", "p", false); err != nil {
			t.Fatalf("allocation %d: %v", i+1, err)
		}
	}
	_, err := allocateUser(t, listen, "user1", "p", false)
	wantQuotaReached(t, err, "the allocation over the memory's default total quota")
}
