package e2e

import (
	"context"
	"fmt"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ti-mo/conntrack"
	"golang.org/x/sys/unix"

	"github.com/l7mp/stunnerd-xdp/test/netns"
	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// The node-policy twin tests (issue 35): a pion/turn client's 3,000-echo session through the
// stunnerd-xdp binary on a node rig, in the daemon's default XDP mode and with --xdp-mode=off;
// 1.5 s into it the node's policy turns against the peer. With pion alone the stack stops
// carrying the flow at once; the kernel path must stop within 300 echoes of it (the contract:
// a flow is in the kernel only while the node's stack would carry it).

// Each row's session: policyEchoes datagrams at policyRate a second, the policy applied
// policyAfter into it; the default mode may echo at most policySlack more than its off twin.
const (
	policyEchoes = 3000
	policyRate   = 500
	policyAfter  = 1500 * time.Millisecond
	policySlack  = 300
)

// policyCase is one row: how the node's policy turns against the peer, and the eviction
// reason the default mode must count for it.
type policyCase struct {
	name  string
	shape netns.Shape
	// apply changes the node's policy; it runs policyAfter into the session.
	apply func(t *testing.T, r *netns.NodeRig)
	// evicted is the stunnerd_xdp_bindings_evicted_total reason that must grow in the default mode.
	evicted string
	// held is the stunnerd_xdp_bindings_userspace reason the binding must be kept under after it.
	held string
}

// dropPeer is what a CNI or kube-proxy does on a policy change that cuts the peer off: DROP
// rules for the peer in OUTPUT, INPUT and FORWARD (one iptables-restore: applied at once), then
// the peer's conntrack entries deleted, both ways, through ctnetlink as kube-proxy deletes them
// (no conntrack process to start between the two: on a loaded machine that alone took the
// kernel path hundreds of echoes past its twin).
func dropPeer(t *testing.T, r *netns.NodeRig) {
	peer := r.PeerIP.String()
	withStdin(t, r.Node, fmt.Sprintf("*filter\n-I OUTPUT -d %[1]s -j DROP\n-I INPUT -s %[1]s -j DROP\n"+
		"-I FORWARD -d %[1]s -j DROP\n-I FORWARD -s %[1]s -j DROP\nCOMMIT\n", peer), "iptables-restore", "--noflush")
	deleted := 0
	err := r.Node.Do(func() error {
		c, err := conntrack.Dial(nil)
		if err != nil {
			return err
		}
		defer c.Close()
		flows, err := c.Dump(nil)
		if err != nil {
			return err
		}
		for _, f := range flows {
			o := f.TupleOrig
			if o.Proto.Protocol != unix.IPPROTO_UDP || o.IP.SourceAddress != r.PeerIP && o.IP.DestinationAddress != r.PeerIP {
				continue
			}
			if err := c.Delete(f); err == nil {
				deleted++
			}
		}
		return nil
	})
	if err != nil {
		t.Errorf("deleting the peer's conntrack entries: %v", err)
	}
	t.Logf("deleted %d conntrack entries of the peer %s", deleted, peer)
}

// blockPeerXfrm adds xfrm block policies between the relay address (the node IP) and the peer,
// both directions, in one ip -batch.
func blockPeerXfrm(t *testing.T, r *netns.NodeRig) {
	node, peer := r.NodeIP.String(), r.PeerIP.String()
	withStdin(t, r.Node, fmt.Sprintf("xfrm policy add src %[1]s/32 dst %[2]s/32 dir out action block\n"+
		"xfrm policy add src %[2]s/32 dst %[1]s/32 dir in action block\n", node, peer), "ip", "-batch", "-")
}

// withStdin runs a command in the namespace with stdin as its input.
func withStdin(t *testing.T, ns *netns.NS, stdin string, name string, args ...string) {
	ctx, cancel := context.WithTimeout(context.Background(), testenv.Timeout(10*time.Second))
	defer cancel()
	cmd := ns.Cmd(ctx, name, args...)
	cmd.Stdin = strings.NewReader(stdin)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Errorf("%s %s: %v: %s", name, strings.Join(args, " "), err, out)
	}
}

var policyCases = []policyCase{
	{name: "iptables-drop-flush", shape: netns.RemoteHost, apply: dropPeer, evicted: "conntrack_deleted", held: "pending"},
	{name: "iptables-drop-flush-pod", shape: netns.PodVeth, apply: dropPeer, evicted: "conntrack_deleted", held: "pending"},
	{name: "xfrm-block", shape: netns.RemoteHost, apply: blockPeerXfrm, evicted: "xfrm", held: "xfrm"},
	{name: "xfrm-block-pod", shape: netns.PodVeth, apply: blockPeerXfrm, evicted: "xfrm", held: "xfrm"},
}

// TestNodePolicyTwins runs every policyCases row in the default mode and with --xdp-mode=off
// and compares the echoes that came back.
func TestNodePolicyTwins(t *testing.T) {
	if testenv.InNetns() {
		t.Skip("parent-only test")
	}
	netns.RequirePrivileged(t, "iptables", "iptables-restore", "conntrack", "ethtool")
	var table []string
	for _, c := range policyCases {
		t.Run(c.name, func(t *testing.T) {
			echoed := map[string]int64{}
			for _, mode := range shapeModes {
				t.Run(mode, func(t *testing.T) {
					row := runPolicy(t, c, mode)
					echoed[mode] = row.echoed
					table = append(table, row.String())
				})
			}
			def, off := echoed["default"], echoed["off"]
			if _, ok := echoed["off"]; !ok || def == 0 {
				return // a mode failed (or was not run): nothing to compare
			}
			if def > off+policySlack {
				t.Errorf("the kernel path echoed %d of %d, its --xdp-mode=off twin %d: more than %d apart", def, policyEchoes, off, policySlack)
			}
		})
	}
	t.Logf("node policy applied %v into a %d-echo session at %d/s:\n%-24s %-7s %9s  %s\n%s", policyAfter, policyEchoes, policyRate,
		"row", "mode", "echoed", "before the policy: kernel's share c2p/p2c; evictions", strings.Join(table, "\n"))
}

// policyRow is what one run measured.
type policyRow struct {
	name, mode     string
	sent, echoed   int64
	share          [2]float64 // the kernel's share of each direction until the policy
	evicted        float64
	evictedReasons string
}

func (r policyRow) String() string {
	return fmt.Sprintf("%-24s %-7s %4d/%-4d  %5.1f%%/%5.1f%%; evicted %.0f %s", r.name, r.mode, r.echoed, r.sent,
		100*r.share[0], 100*r.share[1], r.evicted, r.evictedReasons)
}

// runPolicy builds the row's node, starts the daemon in mode, and runs the session with the
// policy applied policyAfter into it.
func runPolicy(t *testing.T, c policyCase, mode string) policyRow {
	r, relay, peerAddr, _ := shapeSession(t, shapeCase{shape: c.shape, engagesC2P: true, engagesP2C: true}, mode)
	node := r.NodeIP.String()
	before := scrapeAt(t, r.Node, node)
	var at samples // the metrics when the policy was applied
	var wg sync.WaitGroup
	wg.Add(1)
	policy := time.AfterFunc(policyAfter, func() {
		defer wg.Done()
		at = scrapeAt(t, r.Node, node)
		c.apply(t, r)
	})
	s := &taggedSession{peer: net.UDPAddrFromAddrPort(peerAddr), limit: policyEchoes}
	s.run(t, relay, 0x35A, policyRate, 2*time.Duration(policyEchoes/policyRate)*time.Second)
	if policy.Stop() {
		wg.Done()
		t.Fatalf("the session ended before the policy was applied")
	}
	wg.Wait()
	after := scrapeAt(t, r.Node, node)

	row := policyRow{name: c.name, mode: mode, sent: s.sent.Load(), echoed: s.received.Load()}
	for i, dir := range []string{"client_to_peer", "peer_to_client"} {
		row.share[i] = kernelShare(t, before, at, dir)
	}
	var reasons []string
	for name, v := range after {
		if reason, ok := strings.CutPrefix(name, `stunnerd_xdp_bindings_evicted_total{reason="`); ok {
			if d := v - before[name]; d > 0 {
				row.evicted += d
				reasons = append(reasons, fmt.Sprintf("%s=%.0f", strings.TrimSuffix(reason, `"}`), d))
			}
		}
	}
	row.evictedReasons = strings.Join(reasons, " ")
	t.Logf("%s", row)
	if row.sent != policyEchoes {
		t.Fatalf("the client sent %d datagrams, want %d", row.sent, policyEchoes)
	}
	if s.foreign.Load() != 0 {
		t.Errorf("%d datagrams that were not the session's echoes", s.foreign.Load())
	}
	if mode == "off" {
		return row
	}
	// The kernel carried the session until the policy came, and the binding left the maps
	// for the row's reason and is kept in userspace for it.
	for i, dir := range []string{"client->peer", "peer->client"} {
		if row.share[i] < 0.9 {
			t.Errorf("%s before the policy: the kernel relayed %.1f%%, want at least 90%%: the row measures an eviction", dir, 100*row.share[i])
		}
	}
	reason := fmt.Sprintf(`stunnerd_xdp_bindings_evicted_total{reason=%q}`, c.evicted)
	if after.grew(t, before, reason) < 1 {
		t.Errorf("%s did not grow", reason)
	}
	if n := after.get(t, "stunnerd_xdp_bindings_offloaded"); n != 0 {
		t.Errorf("%.0f bindings in the kernel's maps after the policy, want 0", n)
	}
	if n := after.get(t, fmt.Sprintf(`stunnerd_xdp_bindings_userspace{reason=%q}`, c.held)); n != 1 {
		t.Errorf("bindings kept in userspace for %s: %.0f, want 1", c.held, n)
	}
	return row
}
