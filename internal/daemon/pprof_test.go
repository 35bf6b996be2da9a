package daemon

import (
	"io"
	"net/netip"
	"testing"

	"github.com/l7mp/stunnerd-xdp/internal/logging"
)

func TestPprofLoopbackOnly(t *testing.T) {
	lf, err := logging.New("all:WARN", "text", io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		addr string
		ok   bool
	}{{"127.0.0.1:6060", true}, {"[::1]:6060", true}, {"0.0.0.0:6060", false}, {"10.0.0.1:6060", false}, {":6060", false}, {"localhost:6060", false}} {
		cfg := Config{Listen: netip.MustParseAddrPort("127.0.0.1:3478"), Users: map[string]string{"u": "p"}, PprofAddr: c.addr, Logger: lf}
		if err := cfg.validate(); (err == nil) != c.ok {
			t.Errorf("pprof on %q: %v, want ok=%v", c.addr, err, c.ok)
		}
	}
}
