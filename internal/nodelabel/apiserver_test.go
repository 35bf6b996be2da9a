package nodelabel_test

import (
	"context"
	"path/filepath"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/l7mp/stunnerd-xdp/internal/nodelabel"
	"github.com/l7mp/stunnerd-xdp/test/kubeapi"
	"github.com/l7mp/stunnerd-xdp/test/netns"
	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// TestNodeWatcherAPIServer follows the label through a real kube-apiserver,
// as the daemon does in a cluster: authenticated with a ServiceAccount token
// bound to the ClusterRole deploy/daemonset ships (RBAC enforced), the field
// selector applied by the server, the watch resumed after the API server
// restarted (an outage), the node deleted and recreated; no request refused.
func TestNodeWatcherAPIServer(t *testing.T) {
	const (
		attach = nodelabel.Attach
		detach = nodelabel.Detach
		dflt   = nodelabel.Default
	)
	clientLogs := kubeapi.ClientLogs(t)
	s := kubeapi.Start(t, nil)
	admin := s.Admin()
	s.ApplyKustomization(t, filepath.Join(netns.RepoRoot(), "deploy", "daemonset"))
	ctx := context.Background()
	for _, n := range []string{"n1", "n2"} {
		if _, err := admin.CoreV1().Nodes().Create(ctx, node(n, nil), metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	// The daemon's identity: the ServiceAccount the DaemonSet runs as.
	client := s.API(s.ServiceAccountToken(t, "stunner", "stunnerd-xdp"))

	rec := &recorder{}
	logs := &testenv.LockedBuffer{}
	w := startWatcher(t, client, "n1", rec, logs)

	setLabel(t, admin, "n1", nodelabel.OffloadLabel, "enabled")
	rec.expect(t, attach)
	// Another node's label and an unrelated label of its own: no call.
	setLabel(t, admin, "n2", nodelabel.OffloadLabel, "disabled")
	setLabel(t, admin, "n1", "unrelated", "x")
	setLabel(t, admin, "n1", nodelabel.OffloadLabel, "disabled")
	rec.expect(t, attach, detach)
	setLabel(t, admin, "n1", nodelabel.OffloadLabel, "bogus")
	rec.expect(t, attach, detach, dflt)
	waitFor(t, func() bool { return w.State() == nodelabel.Invalid }, "label state invalid")

	// A verb missing from the ClusterRole may only slow the watcher down (a
	// refused watch falls back to relists): the server must have refused
	// nothing, except while it restarts (its RBAC cache fills after it
	// answers: a cluster's API server does the same).
	noRefusals := func(log string) {
		t.Helper()
		if refused := kubeapi.Refused(log); len(refused) > 0 {
			t.Errorf("the API server refused the watcher's requests:\n%s", strings.Join(refused, "\n"))
		}
	}
	noRefusals(clientLogs.String())

	// An outage: the informer's watch breaks, it relists and rewatches when
	// the API server is back, and follows the label again.
	s.StopAPIServer()
	if err := s.StartAPIServer(); err != nil {
		t.Fatal(err)
	}
	setLabel(t, admin, "n1", nodelabel.OffloadLabel, "enabled")
	rec.expectWithin(t, time.Minute, attach, detach, dflt, attach)
	afterRestart := len(clientLogs.String())

	if err := admin.CoreV1().Nodes().Delete(ctx, "n1", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	rec.expect(t, attach, detach, dflt, attach, dflt)
	if _, err := admin.CoreV1().Nodes().Create(ctx, node("n1", map[string]string{nodelabel.OffloadLabel: "disabled"}), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	rec.expect(t, attach, detach, dflt, attach, dflt, detach)
	noRefusals(clientLogs.String()[afterRestart:])
}
