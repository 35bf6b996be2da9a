package daemon

import (
	"context"
	"fmt"
	"time"

	"k8s.io/client-go/kubernetes"

	"github.com/l7mp/stunnerd-xdp/internal/nodelabel"
)

// FollowNode hands the node label's wish to the offload manager, which weighs
// it against the other inputs (see internal/offload); sessions move between
// paths without loss. It is the label watcher's callback.
func (d *Daemon) FollowNode(_ context.Context, want nodelabel.Offload) error {
	d.log.Info("node label", "offload", want.String())
	err := d.xdp.SetLabel(want)
	d.syncDestinations()
	if err != nil {
		return fmt.Errorf("node label %s: %w", want, err)
	}
	return nil
}

// WatchNode follows the node's stunner.l7mp.io/xdp-offload label until the
// daemon closes. It returns once the node was first listed, or with an error
// when that takes longer than timeout.
func (d *Daemon) WatchNode(client kubernetes.Interface, node string, timeout time.Duration) error {
	w := nodelabel.NewWatcher(client, node, d.FollowNode, d.config().Logger.Slog("k8s"))
	ctx, cancel := context.WithCancel(context.Background())
	started := make(chan error, 1)
	go func() { started <- w.Start(ctx) }()
	select {
	case err := <-started:
		if err != nil {
			cancel()
			return fmt.Errorf("watch node %q: %w", node, err)
		}
	case <-time.After(timeout):
		cancel()
		w.Stop()
		return fmt.Errorf("watch node %q: no answer from the Kubernetes API in %v", node, timeout)
	}
	d.nodeWatcher.Store(w)
	d.followServiceCIDRs(client, timeout)
	d.wg.Add(1)
	go func() {
		defer d.wg.Done()
		<-d.stop
		w.Stop()
		cancel()
	}()
	return nil
}
