package servicecidr_test

import (
	"context"
	"log/slog"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"
	networkingv1 "k8s.io/api/networking/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	"github.com/l7mp/stunnerd-xdp/internal/kube/kubetest"
	"github.com/l7mp/stunnerd-xdp/internal/servicecidr"
	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

func serviceCIDR(name string, cidrs ...string) *networkingv1.ServiceCIDR {
	return &networkingv1.ServiceCIDR{ObjectMeta: metav1.ObjectMeta{Name: name}, Spec: networkingv1.ServiceCIDRSpec{CIDRs: cidrs}}
}

type cidrRecorder struct {
	mu    sync.Mutex
	calls [][]netip.Prefix
}

func (r *cidrRecorder) fn(p []netip.Prefix) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.calls = append(r.calls, p)
}

func (r *cidrRecorder) get() [][]netip.Prefix {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.calls)
}

func prefixes(s ...string) []netip.Prefix {
	var out []netip.Prefix
	for _, p := range s {
		out = append(out, netip.MustParsePrefix(p))
	}
	return out
}

func TestFollowServiceCIDRs(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	client := fake.NewClientset(
		serviceCIDR("kubernetes", "10.96.0.0/16", "fd00:10:96::/112"),
		serviceCIDR("extra", "10.97.0.0/24", "not-a-cidr"),
	)
	var logs testenv.LockedBuffer
	var rec cidrRecorder
	stop := servicecidr.Follow(context.Background(), kubetest.FromClientset(client), slog.New(slog.NewTextHandler(&logs, nil)), rec.fn)
	defer stop()

	// The first list is delivered before Follow returns.
	want := [][]netip.Prefix{prefixes("10.96.0.0/16", "10.97.0.0/24", "fd00:10:96::/112")}
	if got := rec.get(); len(got) != 1 || !slices.Equal(got[0], want[0]) {
		t.Fatalf("first delivery %v, want %v", got, want)
	}
	if !strings.Contains(logs.String(), "not-a-cidr") {
		t.Errorf("the invalid CIDR is not logged:\n%s", logs.String())
	}

	ctx := context.Background()
	if _, err := client.NetworkingV1().ServiceCIDRs().Create(ctx, serviceCIDR("more", "10.98.0.0/24"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	want = append(want, prefixes("10.96.0.0/16", "10.97.0.0/24", "10.98.0.0/24", "fd00:10:96::/112"))
	waitFor(t, func() bool { return len(rec.get()) >= 2 }, "no delivery after a ServiceCIDR was added")
	if err := client.NetworkingV1().ServiceCIDRs().Delete(ctx, "extra", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	want = append(want, prefixes("10.96.0.0/16", "10.98.0.0/24", "fd00:10:96::/112"))
	waitFor(t, func() bool { return len(rec.get()) >= 3 }, "no delivery after a ServiceCIDR was deleted")
	stop()
	// The informer's initial adds repeat the first list: no extra calls.
	got := rec.get()
	if len(got) != len(want) {
		t.Fatalf("deliveries %v, want %v", got, want)
	}
	for i := range want {
		if !slices.Equal(got[i], want[i]) {
			t.Fatalf("delivery %d: %v, want %v", i, got[i], want[i])
		}
	}
}

// A cluster without the resource, or RBAC without list on it: one INFO line,
// no retries, no deliveries.
func TestFollowServiceCIDRsUnavailable(t *testing.T) {
	gr := schema.GroupResource{Group: "networking.k8s.io", Resource: "servicecidrs"}
	for name, err := range map[string]error{
		"not served": apierrors.NewNotFound(gr, ""),
		"forbidden":  apierrors.NewForbidden(gr, "", nil),
	} {
		t.Run(name, func(t *testing.T) {
			defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
			client := fake.NewClientset()
			lists := 0
			client.PrependReactor("*", "servicecidrs", func(a k8stesting.Action) (bool, runtime.Object, error) {
				lists++
				return true, nil, err
			})
			var logs testenv.LockedBuffer
			var rec cidrRecorder
			stop := servicecidr.Follow(context.Background(), kubetest.FromClientset(client), slog.New(slog.NewTextHandler(&logs, nil)), rec.fn)
			stop()
			if lines := strings.Count(logs.String(), "\n"); lines != 1 || !strings.Contains(logs.String(), "level=INFO") {
				t.Errorf("want one INFO line, have:\n%s", logs.String())
			}
			if lists != 1 || len(rec.get()) != 0 {
				t.Errorf("%d requests, %d deliveries; want 1 and 0", lists, len(rec.get()))
			}
		})
	}
}

// waitFor polls cond until it holds; the fake clientset delivers events in
// milliseconds, the bound is for a loaded machine.
func waitFor(t *testing.T, cond func() bool, what string) {
	t.Helper()
	err := wait.PollUntilContextTimeout(context.Background(), 2*time.Millisecond, 10*time.Second, true,
		func(context.Context) (bool, error) { return cond(), nil })
	if err != nil {
		t.Fatal(what)
	}
}
