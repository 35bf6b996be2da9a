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

// TestEveryTCReasonHasAName: the TC engine's own reasons have labels of their
// own, and its counter indices name the shared reasons as the XDP program's.
func TestEveryTCReasonHasAName(t *testing.T) {
	seen := map[string]bool{}
	for _, name := range ReasonNames {
		seen[name] = true
	}
	for r := bpf.RelayTcTcReasonTC_REASON_GSO; r < bpf.RelayTcTcReasonTC_REASON_MAX; r++ {
		name := TCReasonName(int(r))
		if name == "" {
			t.Errorf("TC reason %d has no metric label", r)
		}
		if seen[name] {
			t.Errorf("label %q is used twice", name)
		}
		seen[name] = true
	}
	if len(TCReasonNames) != int(bpf.RelayTcTcReasonTC_REASON_MAX-bpf.RelayTcTcReasonTC_REASON_GSO) {
		t.Errorf("%d names for %d TC reasons", len(TCReasonNames), bpf.RelayTcTcReasonTC_REASON_MAX-bpf.RelayTcTcReasonTC_REASON_GSO)
	}
	for r := bpf.RelayReason(0); r < bpf.RelayReasonREASON_MAX; r++ {
		if TCReasonName(int(r)) != ReasonNames[r] {
			t.Errorf("TC index %d is %q, the shared reason is %q", r, TCReasonName(int(r)), ReasonNames[r])
		}
	}
	for i := int(bpf.RelayReasonREASON_MAX); i < int(bpf.RelayTcTcReasonTC_REASON_GSO); i++ {
		if name := TCReasonName(i); name != "" {
			t.Errorf("unused TC index %d named %q", i, name)
		}
	}
}
