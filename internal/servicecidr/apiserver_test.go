package servicecidr_test

import (
	"context"
	"log/slog"
	"net/netip"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"

	"github.com/l7mp/stunnerd-xdp/internal/servicecidr"
	"github.com/l7mp/stunnerd-xdp/test/kubeapi"
	"github.com/l7mp/stunnerd-xdp/test/netns"
	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// TestFollowServiceCIDRsAPIServer discovers the Service CIDRs from a real
// kube-apiserver (1.35 serves networking.k8s.io/v1 ServiceCIDR and creates
// the default one, "kubernetes", from --service-cluster-ip-range=10.96.0.0/16)
// as the daemon's ServiceAccount, bound to the ClusterRole deploy/daemonset
// ships; a ServiceAccount without the binding is refused by RBAC, which
// Follow reports once and does not retry.
func TestFollowServiceCIDRsAPIServer(t *testing.T) {
	clientLogs := kubeapi.ClientLogs(t)
	s := kubeapi.Start(t, nil)
	admin := s.Admin()
	ctx := context.Background()
	// The default ServiceCIDR is written by a controller of the API server,
	// shortly after /readyz.
	if err := wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		_, err := admin.NetworkingV1().ServiceCIDRs().Get(ctx, "kubernetes", metav1.GetOptions{})
		return err == nil, nil
	}); err != nil {
		t.Fatal("the API server did not create the default ServiceCIDR")
	}

	// The DaemonSet's ServiceAccount (deploy/daemonset), then the operator's
	// dataplane pods, which run as their namespace's default ServiceAccount
	// (deploy/stunner/rbac.yaml binds it). Both ship a ClusterRole named
	// stunnerd-xdp: each is applied just before its own check.
	deploy := filepath.Join(netns.RepoRoot(), "deploy")
	more := serviceCIDR("more", "10.98.0.0/24", "fd00:98::/112")
	for _, c := range []struct {
		sa    string
		apply func()
	}{
		{"stunnerd-xdp", func() { s.ApplyKustomization(t, filepath.Join(deploy, "daemonset")) }},
		{"default", func() { s.ApplyFile(t, filepath.Join(deploy, "stunner", "rbac.yaml")) }},
	} {
		c.apply()
		t.Run("bound to the shipped ClusterRole as "+c.sa, func(t *testing.T) {
			logStart := len(clientLogs.String())
			client := s.API(s.ServiceAccountToken(t, "stunner", c.sa))
			var logs testenv.LockedBuffer
			var rec cidrRecorder
			stop := servicecidr.Follow(ctx, client, slog.New(slog.NewTextHandler(&logs, nil)), rec.fn)
			defer stop()
			want := [][]netip.Prefix{prefixes("10.96.0.0/16"), prefixes("10.96.0.0/16", "10.98.0.0/24", "fd00:98::/112"), prefixes("10.96.0.0/16")}
			if got := rec.get(); len(got) != 1 || !slices.Equal(got[0], want[0]) {
				t.Fatalf("first delivery %v, want %v\n%s", got, want[0], logs.String())
			}
			if _, err := admin.NetworkingV1().ServiceCIDRs().Create(ctx, more, metav1.CreateOptions{}); err != nil {
				t.Fatal(err)
			}
			waitFor(t, func() bool { return len(rec.get()) >= 2 }, "no delivery after a ServiceCIDR was created")
			deleteServiceCIDR(t, admin, more.Name)
			waitFor(t, func() bool { return len(rec.get()) >= 3 }, "no delivery after a ServiceCIDR was deleted")
			stop()
			if got := rec.get(); len(got) != len(want) || !slices.Equal(got[1], want[1]) || !slices.Equal(got[2], want[2]) {
				t.Fatalf("deliveries %v, want %v", got, want)
			}
			// The informer watched: a refused watch only logs and falls
			// back to relists, so the server must have refused nothing.
			if refused := kubeapi.Refused(clientLogs.String()[logStart:]); len(refused) > 0 {
				t.Errorf("the API server refused requests of a bound ServiceAccount:\n%s", strings.Join(refused, "\n"))
			}
		})
	}

	t.Run("not bound", func(t *testing.T) {
		client := s.API(s.ServiceAccountToken(t, "elsewhere", "unbound"))
		var logs testenv.LockedBuffer
		var rec cidrRecorder
		stop := servicecidr.Follow(ctx, client, slog.New(slog.NewTextHandler(&logs, nil)), rec.fn)
		stop()
		if len(rec.get()) != 0 || !strings.Contains(logs.String(), "level=INFO") || !strings.Contains(logs.String(), "forbidden") {
			t.Errorf("want no delivery and one INFO line naming the refusal; %d deliveries, logs:\n%s", len(rec.get()), logs.String())
		}
	})
}

// deleteServiceCIDR deletes a ServiceCIDR and waits until it is gone. Its
// finalizer waits for a controller-manager this API server lacks: the test
// removes it, as that controller would once no Service used the range.
func deleteServiceCIDR(t *testing.T, client kubernetes.Interface, name string) {
	t.Helper()
	ctx := context.Background()
	if err := client.NetworkingV1().ServiceCIDRs().Delete(ctx, name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	err := wait.PollUntilContextTimeout(ctx, 50*time.Millisecond, 10*time.Second, true, func(ctx context.Context) (bool, error) {
		sc, err := client.NetworkingV1().ServiceCIDRs().Get(ctx, name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return true, nil
		}
		if err == nil && len(sc.Finalizers) > 0 {
			sc.Finalizers = nil
			_, _ = client.NetworkingV1().ServiceCIDRs().Update(ctx, sc, metav1.UpdateOptions{})
		}
		return false, nil
	})
	if err != nil {
		t.Fatalf("ServiceCIDR %s not deleted", name)
	}
}
