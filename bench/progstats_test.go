package bench

import (
	"fmt"
	"io"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// progStats is a reading of the kernel's run-time statistics of the relay
// program attached to the server's client-facing interface.
type progStats struct {
	runTime time.Duration
	runs    uint64
}

func (s progStats) nsPerRunSince(before progStats) float64 {
	if s.runs <= before.runs {
		return 0
	}
	return float64(s.runTime-before.runTime) / float64(s.runs-before.runs)
}

// enableBPFStats turns on kernel.bpf_stats_enabled until the returned closer
// is closed (it is reference-counted by the kernel: other holders keep it on).
func enableBPFStats(t *testing.T) io.Closer {
	t.Helper()
	c, err := ebpf.EnableStats(uint32(unix.BPF_STATS_RUN_TIME))
	if err != nil {
		t.Fatalf("enable BPF run-time statistics: %v", err)
	}
	return c
}

// relayProgStats reads the statistics of the XDP program on the server's
// client-facing interface (the daemon attaches the same program to both).
func (h *harness) relayProgStats(t *testing.T) progStats {
	t.Helper()
	var s progStats
	err := h.rig.Server.Do(func() error {
		l, err := netlink.LinkByName(h.rig.ServerClientIf.Name)
		if err != nil {
			return err
		}
		x := l.Attrs().Xdp
		if x == nil || !x.Attached || x.ProgId == 0 {
			return fmt.Errorf("no XDP program on %s", h.rig.ServerClientIf.Name)
		}
		prog, err := ebpf.NewProgramFromID(ebpf.ProgramID(x.ProgId))
		if err != nil {
			return err
		}
		defer prog.Close()
		st, err := prog.Stats()
		if err != nil {
			return err
		}
		s = progStats{runTime: st.Runtime, runs: st.RunCount}
		return nil
	})
	if err != nil {
		t.Fatalf("read the relay program's statistics: %v", err)
	}
	return s
}
