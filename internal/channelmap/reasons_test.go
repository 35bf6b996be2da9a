package channelmap

import (
	"testing"

	"github.com/l7mp/stunnerd-xdp/bpf"
)

func TestEveryReasonHasAName(t *testing.T) {
	seen := map[string]bool{}
	for r := bpf.RelayReason(0); r < bpf.RelayReasonREASON_MAX; r++ {
		name, ok := ReasonNames[r]
		if !ok || name == "" {
			t.Errorf("reason %d has no metric label", r)
		}
		if seen[name] {
			t.Errorf("label %q is used twice", name)
		}
		seen[name] = true
	}
	if len(ReasonNames) != int(bpf.RelayReasonREASON_MAX) {
		t.Errorf("%d names for %d reasons", len(ReasonNames), bpf.RelayReasonREASON_MAX)
	}
}
