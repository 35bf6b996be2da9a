package loader

import (
	"errors"
	"fmt"
	"strings"

	"github.com/cilium/ebpf"

	"github.com/l7mp/stunnerd-xdp/bpf"
)

// loadCharge loads the charge program (bpf/charge.c) over the relay program's
// rate-limit maps: userspace charges an allocation's datagrams to the bucket
// the engines charge theirs to (channelmap.Maps.Charge).
func loadCharge(maps *bpf.RelayMaps) (*ebpf.Program, error) {
	spec, err := bpf.LoadCharge()
	if err != nil {
		return nil, fmt.Errorf("read charge program spec: %w", err)
	}
	repl := map[string]*ebpf.Map{}
	for name, m := range map[string]*ebpf.Map{bpf.ChargeMapAllocRates: maps.AllocRates, bpf.ChargeMapRateLimits: maps.RateLimits} {
		spec.Maps[name].MaxEntries = m.MaxEntries() // sized by the loader
		repl[name] = m
	}
	var progs bpf.ChargePrograms
	opts := &ebpf.CollectionOptions{MapReplacements: repl, Programs: ebpf.ProgramOptions{LogLevel: verifierLogLevel}}
	if err := spec.LoadAndAssign(&progs, opts); err != nil {
		var ve *ebpf.VerifierError
		if errors.As(err, &ve) {
			return nil, fmt.Errorf("load charge program: %w\n%s", err, strings.Join(ve.Log, "\n"))
		}
		return nil, fmt.Errorf("load charge program: %w", err)
	}
	return progs.Charge, nil
}
