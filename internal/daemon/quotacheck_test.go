package daemon

import (
	"net"
	"testing"

	"github.com/l7mp/stunnerd-xdp/internal/quota"
)

// TestQuotaCountCheck: the periodic check warns of a server whose quota
// count exceeds what pion holds, once the excess has lasted two checks, and
// not of live allocations counted right.
func TestQuotaCountCheck(t *testing.T) {
	d, listen := startQuota(t, 0, 0)
	conn, err := allocateUser(t, listen, "alice", "a", false)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	seen := map[quota.Server][2]int{}
	for i := range 2 {
		if w := d.listeners.CheckQuotaCounts(seen); len(w) != 0 {
			t.Fatalf("check %d warned of %v with the counts right", i, w)
		}
	}
	// A slot the counter holds for an allocation no pion server has.
	qs := d.listeners.QuotaServers("udp")[0]
	d.quota.Created(qs, &net.UDPAddr{IP: net.IPv4(192, 0, 2, 1), Port: 9}, "alice")
	if w := d.listeners.CheckQuotaCounts(seen); len(w) != 0 {
		t.Fatalf("first check warned of %v: the excess may be a deletion half-reported", w)
	}
	if w := d.listeners.CheckQuotaCounts(seen); len(w) != 1 || w[0] != "udp" {
		t.Fatalf("second check warned of %v, want [udp]", w)
	}
}
