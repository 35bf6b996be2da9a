package loader

import (
	"errors"
	"path"
	"testing"
)

// The TC engine's interface patterns match names, or link kinds after
// "kind:": flannel's VXLAN device by either, a veth named like a tunnel by
// its name only.
func TestMatchIface(t *testing.T) {
	defaults := []string{"lxc*", "cali*", "veth*", "kind:vxlan", "kind:geneve"}
	for _, tc := range []struct {
		patterns   []string
		name, kind string
		want       bool
	}{
		{defaults, "flannel.1", "vxlan", true},
		{defaults, "vxlan.calico", "vxlan", true},
		{defaults, "cilium_geneve", "geneve", true},
		{defaults, "veth1234", "veth", true},
		{defaults, "cali0ab", "veth", true},
		{defaults, "eth0", "", false},
		{defaults, "cni0", "bridge", false},
		{defaults, "wg0", "wireguard", false},
		// A kind pattern never matches a name, nor a name pattern a kind.
		{[]string{"kind:vxlan"}, "vxlan", "veth", false},
		{[]string{"vxlan"}, "flannel.1", "vxlan", false},
		{[]string{"kind:*"}, "lo", "", false}, // no kind: not a device of any kind
		{[]string{"flannel.*"}, "flannel.1", "vxlan", true},
		{nil, "flannel.1", "vxlan", false},
	} {
		if got := MatchIface(tc.patterns, tc.name, tc.kind); got != tc.want {
			t.Errorf("MatchIface(%q, %q, %q) = %v, want %v", tc.patterns, tc.name, tc.kind, got, tc.want)
		}
	}
}

func TestCheckIfacePatterns(t *testing.T) {
	if err := CheckIfacePatterns([]string{"lxc*", "kind:vxlan", "kind:gen*"}); err != nil {
		t.Fatal(err)
	}
	for _, bad := range []string{"kind:", "[", "kind:["} {
		if err := CheckIfacePatterns([]string{bad}); !errors.Is(err, path.ErrBadPattern) {
			t.Errorf("pattern %q: %v, want path.ErrBadPattern", bad, err)
		}
	}
}
