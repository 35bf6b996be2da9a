package loader

import (
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/l7mp/stunnerd-xdp/bpf"
	"github.com/l7mp/stunnerd-xdp/internal/xdpfeatures"
)

// SetVerifierStats has the relay and charge programs loaded with the
// verifier's statistics in their VerifierLog ("processed N insns"), for
// kernels that do not report the count in the program's info (before 5.16).
// It returns the function that turns that off again.
func SetVerifierStats() func() {
	verifierLogLevel = ebpf.LogLevelStats
	return func() { verifierLogLevel = 0 }
}

// LoadTCStats loads the TC engine over p's maps as LoadTC does, with the
// verifier's statistics in its programs' VerifierLog: the Ethernet one and
// the L3 one.
func LoadTCStats(p *Program) (*ebpf.Program, *ebpf.Program, error) {
	spec, err := bpf.LoadRelayTc()
	if err != nil {
		return nil, nil, err
	}
	var c bpf.RelayConfig
	if err := p.objs.Cfg.Get(&c); err != nil {
		return nil, nil, err
	}
	if err := spec.Variables[bpf.RelayTcVarCfg].Set(bpf.RelayTcConfig(c)); err != nil {
		return nil, nil, err
	}
	shared := mapsByName(&p.objs.RelayMaps)
	repl := map[string]*ebpf.Map{}
	for name, ms := range spec.Maps {
		if m, ok := shared[name]; ok {
			ms.MaxEntries = m.MaxEntries()
			repl[name] = m
		}
	}
	var objs bpf.RelayTcObjects
	if err := spec.LoadAndAssign(&objs, &ebpf.CollectionOptions{MapReplacements: repl,
		Programs: ebpf.ProgramOptions{LogLevel: ebpf.LogLevelStats}}); err != nil {
		return nil, nil, err
	}
	objs.TcVerdicts.Close()
	objs.TcScratch.Close()
	return objs.TcTurnRelay, objs.TcTurnRelayL3, nil
}

// SetSettle sets how long discovery waits before it attaches a device that
// appeared (clsact): the tests' devices need no seconds.
func SetSettle(t *TC, d time.Duration) {
	if t.settle > 0 {
		t.settle = d
	}
}

// ClsactHandleBase is the first of the handles the engines' filters take.
const ClsactHandleBase = clsactHandleBase

// WithoutXDPFeatures makes the programs loaded until t ends see a kernel
// without xdp-features (before 6.3): dev_caps comes from the fallback, which
// reads every device again every 50 ms.
func WithoutXDPFeatures(t testing.TB) {
	dial, poll := dialXDPFeatures, fallbackPoll
	dialXDPFeatures = func() (*xdpfeatures.Client, error) { return nil, xdpfeatures.ErrUnsupported }
	fallbackPoll = 50 * time.Millisecond
	t.Cleanup(func() { dialXDPFeatures, fallbackPoll = dial, poll })
}
