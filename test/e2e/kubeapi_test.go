package e2e

import (
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"

	"github.com/l7mp/stunnerd-xdp/internal/nodelabel"
	"github.com/l7mp/stunnerd-xdp/test/netns"
)

// TestKubeAPIUnreachableAtStart: with --node-name and an API server that does
// not answer (nothing listens at the kubeconfig's address), the binary serves
// TURN and health within 5 s with its configured mode (--xdp-mode=off) and
// keeps serving past the 30 s after which it used to exit 1; when an API
// server comes up, the node's label (enabled) attaches XDP. About a minute:
// client-go's reflector backs off up to 30 s (with jitter) between lists.
func TestKubeAPIUnreachableAtStart(t *testing.T) {
	r := parentRig(t)
	netns.RequireBinary(t, netns.Daemon) // built before the clock starts
	const apiAddr = "127.0.0.1:16443"    // in the server namespace, where the daemon runs
	kubeconfig := filepath.Join(t.TempDir(), "kubeconfig")
	if err := os.WriteFile(kubeconfig, []byte(fmt.Sprintf(`apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "http://%s"}}]
users: [{name: u, user: {token: t}}]
contexts: [{name: c, context: {cluster: c, user: u}}]
current-context: c
`, apiAddr)), 0o600); err != nil {
		t.Fatal(err)
	}
	startEcho(t, r.Peer, echoPeer)
	start := time.Now()
	p := startBinary(t, r, "--xdp-mode=off", "--grace-period=1s", "--node-name=media-1", "--kubeconfig="+kubeconfig)
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

	// The API server comes up, in the daemon's namespace.
	var ln net.Listener
	if err := r.Server.Do(func() (err error) { ln, err = net.Listen("tcp", apiAddr); return err }); err != nil {
		t.Fatal(err)
	}
	node := &corev1.Node{TypeMeta: metav1.TypeMeta{Kind: "Node", APIVersion: "v1"},
		ObjectMeta: metav1.ObjectMeta{Name: "media-1", ResourceVersion: "7", Labels: map[string]string{nodelabel.OffloadLabel: "enabled"}}}
	srv := &http.Server{Handler: fakeNodeAPI(t, node), ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { srv.Close() })
	if err := netns.Eventually(90*time.Second, 200*time.Millisecond, func() error {
		if p.Exited() {
			return netns.Abort(fmt.Errorf("daemon exited: %w", p.Wait(time.Second)))
		}
		if st := status(t, r.Server); len(st.XDP.Attached) == 0 {
			return fmt.Errorf("not attached: %+v", st.XDP)
		}
		return nil
	}); err != nil {
		t.Fatalf("the label did not apply when the API answered: %v", err)
	}
	t.Logf("label applied %v after the start", time.Since(start).Round(time.Millisecond))
	_ = p.Stop()
}

// fakeNodeAPI answers a node informer: the list of one node, and a watch that
// sends it (for watch-list clients, with the bookmark that ends the initial
// events) and stays open. Everything else, Service CIDRs included, is 404.
func fakeNodeAPI(t *testing.T, node *corev1.Node) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("/api/v1/nodes", func(w http.ResponseWriter, req *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		if req.URL.Query().Get("watch") != "true" {
			_ = json.NewEncoder(w).Encode(corev1.NodeList{TypeMeta: metav1.TypeMeta{Kind: "NodeList", APIVersion: "v1"},
				ListMeta: metav1.ListMeta{ResourceVersion: node.ResourceVersion}, Items: []corev1.Node{*node}})
			return
		}
		enc := json.NewEncoder(w)
		_ = enc.Encode(metav1.WatchEvent{Type: "ADDED", Object: rawJSON(t, node)})
		if req.URL.Query().Get("sendInitialEvents") == "true" {
			bookmark := &corev1.Node{TypeMeta: node.TypeMeta, ObjectMeta: metav1.ObjectMeta{ResourceVersion: node.ResourceVersion,
				Annotations: map[string]string{metav1.InitialEventsAnnotationKey: "true"}}}
			_ = enc.Encode(metav1.WatchEvent{Type: "BOOKMARK", Object: rawJSON(t, bookmark)})
		}
		w.(http.Flusher).Flush()
		<-req.Context().Done()
	})
	return mux
}

func rawJSON(t *testing.T, v any) (r runtime.RawExtension) {
	b, err := json.Marshal(v)
	if err != nil {
		t.Error(err)
	}
	r.Raw = b
	return r
}
