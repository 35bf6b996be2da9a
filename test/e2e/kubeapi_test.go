package e2e

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/l7mp/stunnerd-xdp/internal/nodelabel"
	"github.com/l7mp/stunnerd-xdp/test/kubeapi"
	"github.com/l7mp/stunnerd-xdp/test/netns"
)

// The tests here run the stunnerd-xdp binary against a real kube-apiserver
// (test/kubeapi) in the rig's server namespace, as a DaemonSet pod runs in a
// cluster: --node-name, a kubeconfig holding a ServiceAccount token minted by
// TokenRequest for the ServiceAccount deploy/daemonset ships, and that
// kustomization's RBAC applied as rendered, so the server enforces the
// shipped ClusterRole on every request the daemon makes.

// nodeName is the rig's node, as the API server knows it.
const nodeName = "media-1"

// kubeNode starts the API server in the rig's server namespace, applies
// deploy/daemonset, creates the Node with the offload label set to label
// ("" for none), and returns the server and a kubeconfig for the daemon's
// ServiceAccount.
func kubeNode(t *testing.T, r *netns.Rig, label string) (*kubeapi.Server, string) {
	t.Helper()
	api := kubeapi.Start(t, r.Server)
	api.ApplyKustomization(t, filepath.Join(netns.RepoRoot(), "deploy", "daemonset"))
	n := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: nodeName}}
	if label != "" {
		n.Labels = map[string]string{nodelabel.OffloadLabel: label}
	}
	if _, err := api.Admin().CoreV1().Nodes().Create(context.Background(), n, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	return api, api.WriteKubeconfig(t, "stunnerd-xdp", api.ServiceAccountToken(t, "stunner", "stunnerd-xdp"))
}

// waitAttached waits until /status shows XDP attached (or not).
func waitAttached(t *testing.T, r *netns.Rig, p *netns.Proc, want bool, limit time.Duration, what string) {
	t.Helper()
	start := time.Now()
	if err := netns.Eventually(limit, 100*time.Millisecond, func() error {
		if p.Exited() {
			return netns.Abort(fmt.Errorf("daemon exited: %w", p.Wait(time.Second)))
		}
		if st := status(t, r.Server); (len(st.XDP.Attached) > 0) != want {
			return fmt.Errorf("attached %v, want attached=%v", st.XDP.Attached, want)
		}
		return nil
	}); err != nil {
		t.Fatalf("%s: %v", what, err)
	}
	t.Logf("%s: after %v", what, time.Since(start).Round(time.Millisecond))
}

// TestKubeAPIUnreachableAtStart: with --node-name and an API server that does
// not answer (it is down when the daemon starts: a node rebooting during an
// outage), the binary serves TURN and health within 5 s with its configured
// mode (--xdp-mode=off) and keeps serving past the 30 s after which it used to
// exit 1; when the API server comes back, the node's label (enabled) attaches
// XDP. About a minute: client-go's reflector backs off up to 30 s (with
// jitter) between lists.
func TestKubeAPIUnreachableAtStart(t *testing.T) {
	r := parentRig(t)
	netns.RequireBinary(t, netns.Daemon) // built before the clock starts
	api, kubeconfig := kubeNode(t, r, "enabled")
	api.StopAPIServer()
	startEcho(t, r.Peer, echoPeer)
	start := time.Now()
	p := startBinary(t, r, "--xdp-mode=off", "--grace-period=1s", "--node-name="+nodeName, "--kubeconfig="+kubeconfig)
	relay, err := allocateFrom(t, r.Client)
	if err != nil {
		t.Fatal(err)
	}
	sent, received, _ := echoSession(t, relay, 200, time.Second)
	serving := time.Since(start)
	t.Logf("serving %v after the start: %d of %d echoes", serving.Round(time.Millisecond), received, sent)
	if serving > 5*time.Second+time.Second /* the echo session */ || received < sent*9/10 {
		t.Fatalf("not serving within 5 s: %v, %d of %d echoes", serving, received, sent)
	}
	if st := status(t, r.Server); len(st.XDP.Attached) != 0 {
		t.Fatalf("XDP attached with --xdp-mode=off and no label: %+v", st.XDP)
	}
	// Past the old give-up time, still serving.
	time.Sleep(time.Until(start.Add(33 * time.Second)))
	if p.Exited() {
		t.Fatalf("daemon exited while the API was unreachable: %v", p.Wait(time.Second))
	}
	if _, err := allocateFrom(t, r.Client); err != nil {
		t.Fatalf("33 s into the outage: %v", err)
	}

	if err := api.StartAPIServer(); err != nil {
		t.Fatal(err)
	}
	waitAttached(t, r, p, true, 90*time.Second, "the label applies once the API server is back")
	t.Logf("label applied %v after the start", time.Since(start).Round(time.Millisecond))
}

// TestKubeAPIOutage: the API server stops while a session is relayed in the
// kernel (the label said enabled). The daemon keeps the offload and the
// session loses nothing; when the API server is back, the daemon follows the
// label again (disabled detaches, enabled attaches).
func TestKubeAPIOutage(t *testing.T) {
	r := parentRig(t)
	netns.RequireBinary(t, netns.Daemon)
	api, kubeconfig := kubeNode(t, r, "enabled")
	startEcho(t, r.Peer, echoPeer)
	p := startBinary(t, r, "--xdp-mode=off", "--grace-period=1s", "--node-name="+nodeName, "--kubeconfig="+kubeconfig,
		"--metrics-addr=10.100.0.1:8080")
	waitAttached(t, r, p, true, 10*time.Second, "label enabled at start")
	relay, err := allocateFrom(t, r.Client)
	if err != nil {
		t.Fatal(err)
	}

	type result struct{ sent, received int }
	done := make(chan result, 1)
	go func() {
		s, n, _ := echoSession(t, relay, 500, 18*time.Second)
		done <- result{s, n}
	}()
	time.Sleep(time.Second)
	before := scrape(t, r.Server)
	api.StopAPIServer()
	// 15 s down: the informer's watch broke, its relists fail and back off
	// (client-go retries at 0.8, 1.6, 3.2, 6.4 s ...). XDP stays attached
	// all along: an unreachable API is no reason to change the offload.
	for end := time.Now().Add(15 * time.Second); time.Now().Before(end); time.Sleep(200 * time.Millisecond) {
		if st := status(t, r.Server); len(st.XDP.Attached) == 0 {
			t.Fatalf("the API outage detached XDP: %+v", st.XDP)
		}
	}
	wantKernelShare(t, before, scrape(t, r.Server), "during the API outage")
	res := <-done
	t.Logf("session across the outage: %d of %d echoes", res.received, res.sent)
	if float64(res.received) < 0.99*float64(res.sent) {
		t.Errorf("%d of %d echoes across the API outage", res.received, res.sent)
	}

	if err := api.StartAPIServer(); err != nil {
		t.Fatal(err)
	}
	admin := api.Admin()
	setNodeLabel(t, admin, nodeName, "disabled")
	// As long as the label's first application after an outage above: the
	// informer relists on client-go's backoff, which had grown during the
	// outage (21.7 s here alone; over 60 s once in a CI run).
	waitAttached(t, r, p, false, 90*time.Second, "label disabled after the outage")
	sent, received, _ := echoSession(t, relay, 200, time.Second)
	if received < sent*99/100 {
		t.Errorf("after detaching: %d of %d echoes", received, sent)
	}
	setNodeLabel(t, admin, nodeName, "enabled")
	waitAttached(t, r, p, true, 10*time.Second, "label enabled again")
}

// TestKubeRBAC runs the daemon on exactly the permissions deploy/daemonset
// grants and checks every use it makes of them: the Node's label is listed
// (enabled at start attaches) and watched (flips follow), and the cluster's
// ServiceCIDRs are listed and watched: a peer inside one (a ClusterIP range,
// here one made to cover the rig's peer) is kept on the userspace path. A
// verb missing from the shipped ClusterRole fails one of these.
func TestKubeRBAC(t *testing.T) {
	r := parentRig(t)
	netns.RequireBinary(t, netns.Daemon)
	api, kubeconfig := kubeNode(t, r, "enabled")
	admin := api.Admin()
	const peers = "10.200.0.0/24" // holds peerAddr
	sc := &networkingv1.ServiceCIDR{ObjectMeta: metav1.ObjectMeta{Name: "media-peers"}, Spec: networkingv1.ServiceCIDRSpec{CIDRs: []string{peers}}}
	if _, err := admin.NetworkingV1().ServiceCIDRs().Create(context.Background(), sc, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	startEcho(t, r.Peer, echoPeer)
	p := startBinary(t, r, "--xdp-mode=off", "--grace-period=1s", "--node-name="+nodeName, "--kubeconfig="+kubeconfig,
		"--metrics-addr=10.100.0.1:8080")
	waitAttached(t, r, p, true, 10*time.Second, "nodes list: the label at start")
	setNodeLabel(t, admin, nodeName, "disabled")
	waitAttached(t, r, p, false, 10*time.Second, "nodes watch: label disabled")
	setNodeLabel(t, admin, nodeName, "enabled")
	waitAttached(t, r, p, true, 10*time.Second, "nodes watch: label enabled")

	if err := netns.Eventually(10*time.Second, 100*time.Millisecond, func() error {
		if !strings.Contains(p.Stderr(), peers) {
			return fmt.Errorf("the daemon did not report the ServiceCIDR %s", peers)
		}
		return nil
	}); err != nil {
		t.Fatalf("servicecidrs list/watch: %v\n%s", err, p.Stderr())
	}
	relay, err := allocateFrom(t, r.Client)
	if err != nil {
		t.Fatal(err)
	}
	before := scrape(t, r.Server)
	sent, received, _ := echoSession(t, relay, 300, 2*time.Second)
	after := scrape(t, r.Server)
	xdp := after.grew(t, before, relayed("xdp", "client_to_peer"))
	user := after.grew(t, before, relayed("userspace", "client_to_peer"))
	t.Logf("peer in ServiceCIDR %s: %d of %d echoes; client->peer xdp=%v userspace=%v", peers, received, sent, xdp, user)
	if received < sent*99/100 {
		t.Errorf("%d of %d echoes", received, sent)
	}
	if xdp != 0 || user == 0 {
		t.Errorf("a peer inside a ServiceCIDR was relayed by the kernel (xdp=%v userspace=%v): the daemon did not learn the Service CIDRs", xdp, user)
	}
	// client-go logs a refused list or watch (the daemon's "k8s" scope) and
	// retries, falling back to relists: slower, not broken. None may appear.
	if refused := kubeapi.Refused(p.Stderr()); len(refused) > 0 {
		t.Errorf("the API server refused the daemon's requests:\n%s", strings.Join(refused, "\n"))
	}
}
