package loader

import (
	"errors"
	"path"
	"testing"
)

// The TC engine's interface patterns match names, link kinds after "kind:",
// and link kinds of devices whose other end is in another namespace after
// "pod:": the defaults take every pod's host-side veth whatever the CNI names
// it, flannel's VXLAN device by its kind, and no veth whose peer is in the
// node's own namespace.
func TestMatchIface(t *testing.T) {
	defaults := DefaultTCPatterns
	names := []string{"lxc*", "cali*", "veth*"}
	pod := func(name string) IfaceInfo { return IfaceInfo{Name: name, Kind: "veth", PeerElsewhere: true} }
	for _, tc := range []struct {
		patterns []string
		ifc      IfaceInfo
		want     bool
	}{
		{defaults, IfaceInfo{Name: "flannel.1", Kind: "vxlan"}, true},
		{defaults, IfaceInfo{Name: "vxlan.calico", Kind: "vxlan"}, true},
		{defaults, IfaceInfo{Name: "cilium_geneve", Kind: "geneve"}, true},
		{defaults, pod("veth1234"), true},
		{defaults, pod("cali0ab"), true},
		{defaults, pod("lxc12ab"), true},
		{defaults, pod("eni1a2b3c4d"), true},                      // EKS VPC CNI
		{defaults, pod("azv1234abcd"), true},                      // AKS Azure CNI
		{defaults, pod("antrea-gw0x"), true},                      // Antrea: from the pod's name
		{defaults, pod("6f1e2d3c4b5a69"), true},                   // OVN-Kubernetes: from the container ID
		{defaults, IfaceInfo{Name: "veth0", Kind: "veth"}, false}, // both ends on the node
		{defaults, IfaceInfo{Name: "eth0"}, false},
		{defaults, IfaceInfo{Name: "cni0", Kind: "bridge"}, false},
		{defaults, IfaceInfo{Name: "wireguard.cali", Kind: "wireguard"}, true}, // L3: tc_turn_relay_l3
		{defaults, IfaceInfo{Name: "tunl0", Kind: "ipip"}, true},
		{defaults, IfaceInfo{Name: "gre1", Kind: "gre"}, false},
		{defaults, IfaceInfo{Name: "vx0", Kind: "vxlan", PeerElsewhere: true}, true},
		// Names narrow the default, for an operator who wants that: a pod's
		// veth named otherwise is not taken, a node's own veth named so is.
		{names, pod("eni1a2b3c4d"), false},
		{names, IfaceInfo{Name: "veth0", Kind: "veth"}, true},
		{names, pod("cali0ab"), true},
		// A kind pattern never matches a name, nor a name pattern a kind.
		{[]string{"kind:vxlan"}, IfaceInfo{Name: "vxlan", Kind: "veth"}, false},
		{[]string{"vxlan"}, IfaceInfo{Name: "flannel.1", Kind: "vxlan"}, false},
		{[]string{"pod:veth"}, IfaceInfo{Name: "veth", Kind: "vxlan", PeerElsewhere: true}, false},
		{[]string{"kind:veth"}, IfaceInfo{Name: "veth0", Kind: "veth"}, true},
		{[]string{"kind:*"}, IfaceInfo{Name: "lo"}, false}, // no kind: not a device of any kind
		{[]string{"pod:*"}, IfaceInfo{Name: "x", PeerElsewhere: true}, false},
		{[]string{"flannel.*"}, IfaceInfo{Name: "flannel.1", Kind: "vxlan"}, true},
		{nil, IfaceInfo{Name: "flannel.1", Kind: "vxlan"}, false},
	} {
		if got := MatchIface(tc.patterns, tc.ifc); got != tc.want {
			t.Errorf("MatchIface(%q, %+v) = %v, want %v", tc.patterns, tc.ifc, got, tc.want)
		}
	}
}

func TestCheckIfacePatterns(t *testing.T) {
	if err := CheckIfacePatterns([]string{"lxc*", "kind:vxlan", "kind:gen*", "pod:veth"}); err != nil {
		t.Fatal(err)
	}
	for _, bad := range []string{"kind:", "[", "kind:[", "pod:", "pod:["} {
		if err := CheckIfacePatterns([]string{bad}); !errors.Is(err, path.ErrBadPattern) {
			t.Errorf("pattern %q: %v, want path.ErrBadPattern", bad, err)
		}
	}
}
