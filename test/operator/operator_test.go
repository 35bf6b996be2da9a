// Package operator runs STUNner's gateway operator (v1.2.1) against the real
// API server of test/kubeapi and keeps what it rendered for this project's
// Dataplane (deploy/stunner) as a fixture, which the API server's own Pod
// Security admission then judges; it judges the pods of deploy/gateway's
// DaemonSets (one per Gateway, in place of the operator's pods) the same way.
package operator

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"

	"github.com/l7mp/stunnerd-xdp/test/kubeapi"
	"github.com/l7mp/stunnerd-xdp/test/netns"
)

// fixture is the Deployment the operator rendered for deploy/stunner's
// Dataplane and testdata/gateway.yaml's Gateway.
var fixture = filepath.Join("testdata", "operator-v1.2.1", "deployment.yaml")

// TestOperatorRendersDataplane runs the operator (STUNNER_OPERATOR: its
// binary; STUNNER_OPERATOR_SRC: its v1.2.1 source, for the CRDs) against the
// API server, applies deploy/stunner and testdata/gateway.yaml, and compares
// the Deployment it renders with the fixture (UPDATE_FIXTURE=1 rewrites it).
// The operator is not on the Go module proxy, so CI cannot build it: the test
// skips without it, and the fixture it wrote is what CI checks.
func TestOperatorRendersDataplane(t *testing.T) {
	bin, src := os.Getenv("STUNNER_OPERATOR"), os.Getenv("STUNNER_OPERATOR_SRC")
	if bin == "" || src == "" {
		t.Skip("STUNNER_OPERATOR (binary) and STUNNER_OPERATOR_SRC (source) not set; see docs/testing.md")
	}
	api := kubeapi.Start(t, nil)
	admin := api.Admin()
	for _, dir := range []string{filepath.Join(src, "config", "crd", "bases"), filepath.Join(src, "config", "gateway-api-v1.0.0", "crd")} {
		files, err := filepath.Glob(filepath.Join(dir, "*.yaml"))
		if err != nil || len(files) == 0 {
			t.Fatalf("no CRDs in %s: %v", dir, err)
		}
		for _, f := range files {
			api.ApplyFile(t, f)
		}
	}
	// The CRDs' kinds are served once established.
	for gv, kind := range map[string]string{"stunner.l7mp.io/v1": "Dataplane", "gateway.networking.k8s.io/v1": "Gateway"} {
		if err := netns.Eventually(30*time.Second, 200*time.Millisecond, func() error {
			l, err := admin.Discovery().ServerResourcesForGroupVersion(gv)
			if err != nil {
				return err
			}
			if !slices.ContainsFunc(l.APIResources, func(r metav1.APIResource) bool { return r.Kind == kind }) {
				return fmt.Errorf("%s %s not served yet", gv, kind)
			}
			return nil
		}); err != nil {
			t.Fatal(err)
		}
	}
	api.ApplyFile(t, filepath.Join("testdata", "gateway.yaml"))
	api.ApplyKustomization(t, filepath.Join(netns.RepoRoot(), "deploy", "stunner"))

	op, err := netns.LaunchCmd(operatorCmd(bin, api.AdminKubeconfig()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = op.Stop()
		if t.Failed() {
			t.Logf("operator log:\n%s", op.Stderr())
		}
	})
	var dep *appsv1.Deployment
	if err := netns.Eventually(60*time.Second, 200*time.Millisecond, func() error {
		if op.Exited() {
			return netns.Abort(fmt.Errorf("operator exited: %w", op.Wait(time.Second)))
		}
		dep, err = admin.AppsV1().Deployments("stunner").Get(context.Background(), "udp-gateway", metav1.GetOptions{})
		return err
	}); err != nil {
		t.Fatalf("no Deployment rendered: %v", err)
	}
	got := clean(dep)
	b, err := yaml.Marshal(got)
	if err != nil {
		t.Fatal(err)
	}
	header := []byte("# Rendered by STUNner's gateway operator v1.2.1 against kube-apiserver v1.35.4 for\n" +
		"# deploy/stunner's Dataplane and testdata/gateway.yaml (TestOperatorRendersDataplane; UPDATE_FIXTURE=1).\n")
	if os.Getenv("UPDATE_FIXTURE") == "1" {
		if err := os.MkdirAll(filepath.Dir(fixture), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(fixture, append(header, b...), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(fixture)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(append(header, b...), want) {
		t.Errorf("the operator renders a different Deployment than %s (UPDATE_FIXTURE=1 rewrites it):\n%s", fixture, b)
	}
}

// operatorCmd runs the operator as the README of ../shared/kapi measured it,
// as the admin: its ClusterRole is not what is under test here.
func operatorCmd(bin, kubeconfig string) *exec.Cmd {
	cmd := exec.Command(bin, "--config-discovery-address=127.0.0.1:13478", "--metrics-bind-address=0",
		"--health-probe-bind-address=127.0.0.1:18081", "--dataplane-mode=managed", "--kubeconfig="+kubeconfig)
	cmd.Env = append(os.Environ(), "KUBECONFIG="+kubeconfig)
	return cmd
}

// clean keeps what the operator decided: the server's bookkeeping (UIDs,
// versions, timestamps, managed fields, status) changes on every run.
func clean(d *appsv1.Deployment) *appsv1.Deployment {
	out := &appsv1.Deployment{TypeMeta: metav1.TypeMeta{APIVersion: "apps/v1", Kind: "Deployment"},
		ObjectMeta: metav1.ObjectMeta{Name: d.Name, Namespace: d.Namespace, Labels: d.Labels, Annotations: d.Annotations},
		Spec:       d.Spec}
	for _, o := range d.OwnerReferences {
		o.UID = ""
		out.OwnerReferences = append(out.OwnerReferences, o)
	}
	return out
}

// renderedPod is the fixture's pod template as a Pod.
func renderedPod(t *testing.T, namespace string) *corev1.Pod {
	t.Helper()
	b, err := os.ReadFile(fixture)
	if err != nil {
		t.Fatal(err)
	}
	var d appsv1.Deployment
	if err := yaml.UnmarshalStrict(b, &d); err != nil {
		t.Fatalf("%s: %v", fixture, err)
	}
	return &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "dataplane", Namespace: namespace, Labels: d.Spec.Template.Labels},
		Spec: d.Spec.Template.Spec}
}

// TestRenderedDataplanePodSecurity submits the pod the operator renders for
// deploy/stunner's Dataplane to the API server's Pod Security admission (on
// by default in kube-apiserver): a namespace enforcing baseline (or
// restricted) refuses it for its host network and capabilities, one labelled
// privileged admits it: the Gateways' namespace needs that label. It also lists the host ports the pod takes (under
// hostNetwork every containerPort is one): two such pods on one node must not
// share one.
func TestRenderedDataplanePodSecurity(t *testing.T) {
	api := kubeapi.Start(t, nil)
	admin := api.Admin()
	ctx := context.Background()
	for level, wantAdmitted := range map[string]bool{"privileged": true, "baseline": false, "restricted": false} {
		ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "gw-" + level,
			Labels: map[string]string{"pod-security.kubernetes.io/enforce": level}}}
		if _, err := admin.CoreV1().Namespaces().Create(ctx, ns, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		// The ServiceAccount admission wants the pod's ServiceAccount; no
		// controller creates "default" here.
		sa := &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "default", Namespace: ns.Name}}
		if _, err := admin.CoreV1().ServiceAccounts(ns.Name).Create(ctx, sa, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		_, err := admin.CoreV1().Pods(ns.Name).Create(ctx, renderedPod(t, ns.Name), metav1.CreateOptions{})
		switch {
		case wantAdmitted && err != nil:
			t.Errorf("Pod Security %s refused the rendered dataplane pod: %v", level, err)
		case !wantAdmitted && err == nil:
			t.Errorf("Pod Security %s admitted the rendered dataplane pod (hostNetwork, added capabilities)", level)
		case !wantAdmitted && !apierrors.IsForbidden(err):
			t.Errorf("Pod Security %s: want a refusal, got %v", level, err)
		case err != nil:
			t.Logf("Pod Security %s: %v", level, firstLine(err))
		}
	}

	pod := renderedPod(t, "x")
	if !pod.Spec.HostNetwork {
		t.Fatal("the rendered pod does not run on the host network: XDP would attach to its veth")
	}
	var hostPorts []string
	for _, c := range pod.Spec.Containers {
		for _, p := range c.Ports {
			hostPorts = append(hostPorts, fmt.Sprintf("%s %d/%s", c.Name, p.ContainerPort, p.Protocol))
		}
	}
	t.Logf("host ports of the rendered pod (hostNetwork): %v", hostPorts)
	if len(hostPorts) == 0 {
		t.Error("no container ports: the fixture is not what the operator renders")
	}
}

func firstLine(err error) string {
	s, _, _ := strings.Cut(err.Error(), "\n")
	return s
}
