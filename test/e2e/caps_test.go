package e2e

import (
	"strings"
	"testing"
	"time"

	"github.com/l7mp/stunnerd-xdp/test/netns"
	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// TestCapabilities runs the binary as a container with drop [ALL] and a short
// add list runs it: root, with only those capabilities in its bounding set
// (so in its permitted and effective sets after exec) and no_new_privs
// (allowPrivilegeEscalation: false), through util-linux's setpriv. The
// DaemonSet's set (deploy/daemonset) attaches XDP in native mode, pins the
// steering maps and relays in the kernel; each capability left out shows what
// it is for on this kernel, and the daemon still serves from userspace.
// (SYS_RESOURCE matters only before 5.11, where BPF memory is charged to
// RLIMIT_MEMLOCK; docs/operations.md has the table by kernel.)
func TestCapabilities(t *testing.T) {
	if testenv.InNetns() {
		t.Skip("parent-only test")
	}
	for _, c := range []struct {
		name string
		caps []string
		xdp  bool // XDP attached and relaying; otherwise served from userspace
		// steering: the listener handover's maps are pinned and loaded.
		steering bool
		log      string
	}{
		{name: "BPF NET_ADMIN PERFMON", caps: []string{"bpf", "net_admin", "perfmon"}, xdp: true, steering: true},
		{name: "without BPF", caps: []string{"net_admin", "perfmon"}, log: "operation not permitted"},
		{name: "without NET_ADMIN", caps: []string{"bpf", "perfmon"}, steering: true, log: "operation not permitted"},
		// The verifier allows packet pointer arithmetic only to a loader
		// with PERFMON (or SYS_ADMIN): without it the relay program does
		// not load, while the simpler steering program does.
		{name: "without PERFMON", caps: []string{"bpf", "net_admin"}, steering: true, log: "pointer arithmetic with it prohibited"},
	} {
		t.Run(c.name, func(t *testing.T) {
			r := parentRig(t)
			startEcho(t, r.Peer, echoPeer)
			setpriv := []string{"setpriv", "--bounding-set=-all,+" + strings.Join(c.caps, ",+"), "--inh-caps=-all", "--no-new-privs", "--",
				netns.RequireBinary(t, netns.Daemon)}
			p := runCommand(t, r, nil, append(setpriv, binaryArgs("--steering-dir="+testenv.BPFFS(t))...))
			if got := p.WaitOutput("listener handover on", 2*time.Second); got != c.steering {
				t.Errorf("listener handover on: %v, want %v", got, c.steering)
			}
			relay, err := allocateFrom(t, r.Client)
			if err != nil {
				t.Fatal(err)
			}
			sent, received, _ := echoSession(t, relay, 200, 2*time.Second)
			if received < sent*99/100 {
				t.Errorf("%d of %d echoes", received, sent)
			}
			st := status(t, r.Client)
			t.Logf("%v: attached %v, %d packets in XDP, %d in userspace", c.caps, st.XDP.Attached, st.XDP.XDPPackets, st.XDP.UserspacePackets)
			if got := len(st.XDP.Attached) == len(r.ServerIfaces()) && st.XDP.XDPPackets > 0; got != c.xdp {
				t.Errorf("XDP attached and relaying: %v, want %v", got, c.xdp)
			}
			if c.log != "" && !strings.Contains(p.Stderr(), c.log) {
				t.Errorf("the log does not say %q:\n%s", c.log, p.Stderr())
			}
		})
	}
}
