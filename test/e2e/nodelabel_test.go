package e2e

import (
	"context"
	"fmt"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/l7mp/stunnerd-xdp/internal/daemon"
	"github.com/l7mp/stunnerd-xdp/internal/kube/kubetest"
	"github.com/l7mp/stunnerd-xdp/internal/loader"
	"github.com/l7mp/stunnerd-xdp/internal/nodelabel"
	"github.com/l7mp/stunnerd-xdp/test/netns"
)

// TestNodeLabelToggle drives the real switch through the node label. There is
// no cluster here: client-go's fake clientset plays the API server, and the
// daemon's informer, callback and switch are the production ones. A session
// keeps flowing while the label attaches and detaches XDP.
func TestNodeLabelToggle(t *testing.T) {
	inRig(t, false, func(t *testing.T, r rig) {
		d := startDaemon(t, loader.ModeOff, r.serverIfaces, nil)
		node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "media-1", Labels: map[string]string{}}}
		client := fake.NewSimpleClientset(node,
			&corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "media-2", Labels: map[string]string{nodelabel.OffloadLabel: "enabled"}}})
		if err := d.WatchNode(kubetest.FromClientset(client), "media-1", 5*time.Second); err != nil {
			t.Fatal(err)
		}
		startEcho(t, r.peer, echoPeer)
		relay, err := allocateFrom(t, r.client)
		if err != nil {
			t.Fatal(err)
		}
		type result struct{ sent, received int }
		done := make(chan result, 1)
		go func() {
			s, n, _ := echoSession(t, relay, 1000, 6*time.Second)
			done <- result{s, n}
		}()

		setLabel := func(value string) {
			n, err := client.CoreV1().Nodes().Get(context.Background(), "media-1", metav1.GetOptions{})
			if err != nil {
				t.Fatal(err)
			}
			if value == "" {
				delete(n.Labels, nodelabel.OffloadLabel)
			} else {
				n.Labels[nodelabel.OffloadLabel] = value
			}
			if _, err := client.CoreV1().Nodes().Update(context.Background(), n, metav1.UpdateOptions{}); err != nil {
				t.Fatal(err)
			}
		}
		waitAttached := func(want bool, label string) {
			waitFor(t, fmt.Sprintf("label %q: attached=%v", label, want), 3*time.Second, func() bool { return (len(d.Attached()) > 0) == want })
			if got := labelMetric(t, d); got != label {
				t.Errorf("stunnerd_xdp_offload_label says %q, want %q", got, label)
			}
		}
		time.Sleep(time.Second)
		if len(d.Attached()) != 0 {
			t.Fatal("another node's label attached XDP here")
		}
		for _, step := range []struct {
			value, state string
			attached     bool
		}{
			{"enabled", "enabled", true},
			{"disabled", "disabled", false},
			{"enabled", "enabled", true},
			{"bogus", "invalid", false}, // invalid counts as absent: --xdp-mode=off
			{"enabled", "enabled", true},
			{"", "absent", false},
		} {
			setLabel(step.value)
			waitAttached(step.attached, step.state)
			if step.attached && d.Attached()["srv0"] != loader.ModeNative {
				t.Errorf("label enabled: %v, want native (auto) on srv0", d.Attached())
			}
			time.Sleep(700 * time.Millisecond)
		}
		res := <-done
		after := snapshot(t, d)
		t.Logf("session across the label flips: %d sent, %d echoed; %v", res.sent, res.received, after)
		if float64(res.received) < 0.99*float64(res.sent) {
			t.Errorf("%d of %d echoes across the flips", res.received, res.sent)
		}
		if after.xdp.ClientToPeerPackets == 0 || after.userC2P == 0 {
			t.Errorf("both paths should have carried the session: %v", after)
		}
	})
}

// labelMetric returns the state stunnerd_xdp_offload_label reports as 1.
func labelMetric(t *testing.T, d *daemon.Daemon) string {
	t.Helper()
	mfs, err := d.Registry().Gather()
	if err != nil {
		t.Fatal(err)
	}
	m := netns.Metrics{}
	for _, mf := range mfs {
		m[mf.GetName()] = mf
	}
	for _, state := range []string{"enabled", "disabled", "invalid", "absent"} {
		if v, _ := m.Sum("stunnerd_xdp_offload_label", "state", state); v == 1 {
			return state
		}
	}
	return ""
}
