package operator

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/l7mp/stunnerd-xdp/test/kubeapi"
	"github.com/l7mp/stunnerd-xdp/test/netns"
)

// TestGatewayDaemonSetsPodSecurity applies deploy/gateway/example's two
// Gateways' DaemonSets with deploy/common to the API server (its validation
// takes them) and submits each DaemonSet's pod to the server's Pod Security
// admission: the namespace deploy/common labels admits them, one enforcing
// baseline refuses them. The example's Dataplane needs the operator's CRDs
// and is left out here (test/deploy decodes it).
func TestGatewayDaemonSetsPodSecurity(t *testing.T) {
	api := kubeapi.Start(t, nil)
	admin := api.Admin()
	ctx := context.Background()

	deploy := filepath.Join(netns.RepoRoot(), "deploy")
	overlay := t.TempDir()
	var resources []string
	for _, dir := range []string{"common", "gateway/example/udp-gateway", "gateway/example/tcp-gateway"} {
		rel, err := filepath.Rel(overlay, filepath.Join(deploy, dir))
		if err != nil {
			t.Fatal(err)
		}
		resources = append(resources, "  - "+rel)
	}
	if err := os.WriteFile(filepath.Join(overlay, "kustomization.yaml"),
		[]byte("resources:\n"+strings.Join(resources, "\n")+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	api.ApplyKustomization(t, overlay)

	dss, err := admin.AppsV1().DaemonSets("stunner").List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/name=stunnerd-xdp"})
	if err != nil {
		t.Fatal(err)
	}
	if len(dss.Items) != 2 {
		t.Fatalf("%d DaemonSets in stunner, want the two Gateways'", len(dss.Items))
	}

	// A namespace enforcing baseline, with the ServiceAccount the pods name
	// (else the ServiceAccount admission refuses them first).
	baseline := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "gw-baseline",
		Labels: map[string]string{"pod-security.kubernetes.io/enforce": "baseline"}}}
	if _, err := admin.CoreV1().Namespaces().Create(ctx, baseline, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	sa := &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "stunnerd-xdp", Namespace: baseline.Name}}
	if _, err := admin.CoreV1().ServiceAccounts(baseline.Name).Create(ctx, sa, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}

	for _, ds := range dss.Items {
		for ns, wantAdmitted := range map[string]bool{ds.Namespace: true, baseline.Name: false} {
			pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: ds.Name + "-pod", Namespace: ns,
				Labels: ds.Spec.Template.Labels, Annotations: ds.Spec.Template.Annotations}, Spec: ds.Spec.Template.Spec}
			_, err := admin.CoreV1().Pods(ns).Create(ctx, pod, metav1.CreateOptions{})
			switch {
			case wantAdmitted && err != nil:
				t.Errorf("%s: namespace %s refused the pod: %v", ds.Name, ns, err)
			case !wantAdmitted && err == nil:
				t.Errorf("%s: namespace %s (baseline) admitted the pod", ds.Name, ns)
			case !wantAdmitted && (!apierrors.IsForbidden(err) || !strings.Contains(err.Error(), "PodSecurity")):
				t.Errorf("%s: namespace %s: want a Pod Security refusal, got %v", ds.Name, ns, err)
			case err != nil:
				t.Logf("%s in %s: %s", ds.Name, ns, firstLine(err))
			}
		}
	}
}
