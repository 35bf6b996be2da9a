package e2e

import (
	"fmt"
	"testing"

	"github.com/l7mp/stunnerd-xdp/test/netns"
	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// Traffic control keeps its say on the kernel path (issue 35): a node shape
// with the policy in place, in the daemon's default mode beside its
// --xdp-mode=off twin; the kernel path may carry no more than pion/turn and
// the node's kernel do.

// bandwidthPlugin shapes what the pod sends as the CNI bandwidth plugin does
// for kubernetes.io/egress-bandwidth: an ingress qdisc on the pod's
// host-side veth, a u32 filter matching everything with a mirred redirect to
// an ifb device, and a TBF on the ifb at the pod's rate (40 kbit: 500 echoes
// of the shape's session at 250 a second are far over it).
func bandwidthPlugin(t *testing.T, r *netns.NodeRig) {
	t.Helper()
	ifb := "bwp" + r.EgressIf[len(r.EgressIf)-4:]
	for _, cmd := range [][]string{
		{"ip", "link", "add", ifb, "type", "ifb"},
		{"ip", "link", "set", ifb, "up"},
		{"tc", "qdisc", "add", "dev", ifb, "root", "tbf", "rate", "40kbit", "burst", "2kb", "latency", "25ms"},
		{"tc", "qdisc", "add", "dev", r.EgressIf, "ingress"},
		{"tc", "filter", "add", "dev", r.EgressIf, "parent", "ffff:", "protocol", "all", "u32", "match", "u32", "0", "0",
			"action", "mirred", "egress", "redirect", "dev", ifb},
	} {
		r.Node.Run(t, cmd[0], cmd[1:]...)
	}
}

// TestBandwidthPluginTwins: a Calico pod peer whose egress the bandwidth
// plugin limits. With --xdp-mode=off its echoes are shaped (most dropped by
// the TBF); the TC engine, a cls_bpf filter after the plugin's u32 (clsact
// on every kernel), sees none of them: the plugin's filter steals them to
// the ifb, which hands them to the stack and pion/turn after shaping. With
// a tcx engine (before 6.6 there is none) every echo came back.
func TestBandwidthPluginTwins(t *testing.T) {
	if testenv.InNetns() {
		t.Skip("parent-only test")
	}
	netns.RequirePrivileged(t, "iptables", "conntrack", "bridge", "ethtool", "tc")
	c := shapeCase{name: "calico-pod+bandwidth", shape: netns.CalicoPod, policy: bandwidthPlugin}
	echoed := map[string]int64{}
	for _, mode := range []string{"off", "default"} {
		t.Run(mode, func(t *testing.T) {
			row := runShape(t, c, mode)
			echoed[mode] = row.echoed
			if row.echoed == row.sent {
				t.Errorf("%s", fmt.Sprintf("all %d echoes came back: the plugin's TBF shaped nothing (%s)", row.sent, row))
			}
		})
	}
	off, kernel := echoed["off"], echoed["default"]
	t.Logf("echoes back: %d with --xdp-mode=off, %d by default", off, kernel)
	if float64(kernel) > 1.2*float64(off)+10 {
		t.Errorf("the kernel path carried %d echoes past the pod's bandwidth limit, pion/turn and the node %d", kernel, off)
	}
}
