package daemon

import (
	"errors"
	"net/netip"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/l7mp/stunnerd-xdp/internal/config"
	"github.com/l7mp/stunnerd-xdp/internal/kube/kubetest"
	"github.com/l7mp/stunnerd-xdp/internal/loader"
	"github.com/l7mp/stunnerd-xdp/internal/logging"
)

// TestWatchNodeAfterClose: a label watch whose first list answers after
// Close (the $STUNNER_NODENAME watcher runs beside the daemon and the API may
// answer late) must not start goroutines Close no longer waits for, nor hand
// the label to the closed offload manager.
func TestWatchNodeAfterClose(t *testing.T) {
	lf, err := logging.New("all:ERROR", "text", t.Output())
	if err != nil {
		t.Fatal(err)
	}
	d, err := Start(Config{
		Listeners:    []config.ResolvedListener{{Name: "udp", Protocol: config.UDP, Addr: netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), freePort(t))}},
		Users:        map[string]string{"u": "p"},
		RelayAddress: netip.MustParseAddr("127.0.0.1"),
		MinRelayPort: 61000, MaxRelayPort: 61999,
		XDPMode: loader.ModeOff,
		Logger:  lf,
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	client := fake.NewClientset(&corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "n1"}})
	for name, watch := range map[string]func() error{
		"once":      func() error { return d.WatchNode(kubetest.FromClientset(client), "n1", 5*time.Second) },
		"patiently": func() error { return d.WatchNodePatiently(kubetest.FromClientset(client), "n1", 5*time.Second) },
	} {
		if err := watch(); !errors.Is(err, ErrClosed) {
			t.Errorf("%s: watch after Close: %v, want ErrClosed", name, err)
		}
	}
	if d.track(func() {}) {
		t.Error("track started a goroutine after Close")
	}
	if d.nodeWatcher.Load() != nil {
		t.Error("a node watcher was kept after Close")
	}
}
