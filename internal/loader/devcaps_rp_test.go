package loader_test

import (
	"io"
	"log/slog"
	"net"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/l7mp/stunnerd-xdp/bpf"
	"github.com/l7mp/stunnerd-xdp/internal/loader"
	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

const (
	flagRPStrict = bpf.RelayDevFlagDEV_RP_STRICT
	flagRPLoose  = bpf.RelayDevFlagDEV_RP_LOOSE
	flagsRP      = flagRPStrict | flagRPLoose
)

// setRPFilter writes net.ipv4.conf.<conf>.rp_filter; call it on the
// namespace's thread (/proc/sys/net is the reading thread's namespace's).
func setRPFilter(conf string, v int) error {
	return os.WriteFile("/proc/sys/net/ipv4/conf/"+conf+"/rp_filter", []byte(strconv.Itoa(v)), 0)
}

// TestDevCapsReversePathFilter: dev_caps tells the mode the stack's
// reverse-path filter applies to each device, as fib_validate_source
// computes it: the larger of conf.all and conf.<dev>, 2 on a device without
// an IPv4 address filtering as strictly as 1. Each row is a change the loader
// sees within a second (netconf and address notifications), moving the FIB
// generation so that cached decisions are taken again.
func TestDevCapsReversePathFilter(t *testing.T) {
	testenv.RequireRoot(t)
	ns := testenv.NewNSWorker(t)
	prog, err := loader.Load(testCfg, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	defer prog.Close()
	if _, err := vethPair(ns, "up0", "up1", nil); err != nil {
		t.Fatal(err)
	}
	dev, err := vethPair(ns, "d0", "d1", nil)
	if err != nil {
		t.Fatal(err)
	}
	// A new namespace inherits init_net's conf.all and conf.default: a
	// systemd host's 2 would make d0 loose from the start.
	if err := ns.Do(func() error {
		for _, c := range []string{"all", "default", "d0"} {
			if err := setRPFilter(c, 0); err != nil {
				return err
			}
		}
		_, err := prog.Attach("up0", loader.ModeGeneric)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	addr := &netlink.Addr{IPNet: &net.IPNet{IP: net.IPv4(10, 99, 0, 1), Mask: net.CIDRMask(24, 32)}}
	setAddr := func(present bool) error {
		l, err := netlink.LinkByName("d0")
		if err != nil {
			return err
		}
		if present {
			return netlink.AddrReplace(l, addr)
		}
		return netlink.AddrDel(l, addr)
	}

	rows := []struct {
		name     string
		all, dev int
		addr     bool
		want     bpf.RelayDevFlag
	}{
		{"off", 0, 0, true, 0},
		{"dev-strict", 0, 1, true, flagRPStrict},
		{"dev-loose", 0, 2, true, flagRPLoose},
		// Removing the device's only IPv4 address: no_addr, strict.
		{"dev-loose/address-removed", 0, 2, false, flagRPStrict},
		{"dev-loose/address-back", 0, 2, true, flagRPLoose},
		{"all-loose/dev-strict", 2, 1, true, flagRPLoose},
		{"all-strict/dev-off", 1, 0, true, flagRPStrict},
		{"all-off/dev-off", 0, 0, true, 0},
		{"all-loose/no-address", 2, 0, false, flagRPStrict},
	}
	for _, r := range rows {
		t.Run(r.name, func(t *testing.T) {
			before, _ := devCap(t, prog, dev)
			gen := fibGen(t, prog)
			if err := ns.Do(func() error {
				if err := setRPFilter("all", r.all); err != nil {
					return err
				}
				if err := setRPFilter("d0", r.dev); err != nil {
					return err
				}
				return setAddr(r.addr)
			}); err != nil {
				t.Fatal(err)
			}
			waitCap(t, prog, dev, "reverse-path flags "+strconv.Itoa(int(r.want)),
				func(v bpf.RelayDevCap, ok bool) bool { return ok && v.Flags&flagsRP == r.want })
			waitRPGenFlag(t, prog)
			if before.Flags&flagsRP != r.want && fibGen(t, prog) == gen {
				t.Errorf("the reverse-path flags went from %d to %d but the FIB generation stayed %d", before.Flags&flagsRP, r.want, gen)
			}
		})
	}
}

// genRPFilter is GEN_RP_FILTER (bpf/maps.h), a bit of the FIB generation.
const genRPFilter = 1 << 30

// waitRPGenFlag waits up to a second for the FIB generation to say what
// dev_caps holds: GEN_RP_FILTER set exactly when some entry has DEV_RP_*
// (without it the program does not look at them).
func waitRPGenFlag(t *testing.T, prog *loader.Program) {
	t.Helper()
	deadline := time.Now().Add(time.Second)
	for {
		var (
			k       uint32
			v       bpf.RelayDevCap
			filters bool
		)
		it := prog.Maps().DevCaps.Iterate()
		for it.Next(&k, &v) {
			filters = filters || v.Flags&flagsRP != 0
		}
		if err := it.Err(); err != nil {
			t.Fatal(err)
		}
		gen := fibGen(t, prog)
		if gen != 0 && (gen&genRPFilter != 0) == filters {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("FIB generation %#x after a second; a device filters by reverse path: %v", gen, filters)
		}
		time.Sleep(5 * time.Millisecond)
	}
}
