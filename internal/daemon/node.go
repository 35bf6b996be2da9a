package daemon

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/l7mp/stunnerd-xdp/internal/kube"
	"github.com/l7mp/stunnerd-xdp/internal/nodelabel"
)

// ErrNodeNotListed: the Kubernetes API did not list the node in time. With
// WatchNodePatiently the watch keeps trying in the background.
var ErrNodeNotListed = errors.New("no answer from the Kubernetes API")

// ErrClosed: the daemon closed before the call could take effect.
var ErrClosed = errors.New("daemon closed")

// FollowNode hands the node label's wish to the offload manager, which weighs
// it against the other inputs (see internal/offload); sessions move between
// paths without loss. It is the label watcher's callback.
func (d *Daemon) FollowNode(_ context.Context, want nodelabel.Offload) error {
	d.log.Info("node label", "offload", want.String())
	err := d.xdp.SetLabel(want)
	if err != nil {
		return fmt.Errorf("node label %s: %w", want, err)
	}
	return nil
}

// WatchNode follows the node's stunner.l7mp.io/xdp-offload label until the
// daemon closes. It returns once the node was first listed, or gives up with
// ErrNodeNotListed when that takes longer than timeout.
func (d *Daemon) WatchNode(api kube.API, node string, timeout time.Duration) error {
	return d.watchNode(api, node, timeout, false)
}

// WatchNodePatiently is WatchNode for an API server that may not answer yet
// (a node that reboots during an API outage): the daemon serves with the
// configured mode meanwhile (the label counts as absent). After wait it
// returns ErrNodeNotListed and keeps the watch trying in the background (the
// informer retries with backoff); the label applies when the API answers.
func (d *Daemon) WatchNodePatiently(api kube.API, node string, wait time.Duration) error {
	return d.watchNode(api, node, wait, true)
}

func (d *Daemon) watchNode(api kube.API, node string, wait time.Duration, patient bool) error {
	w := nodelabel.NewWatcher(api, node, d.FollowNode, d.config().Logger.Slog("k8s"))
	// ctx bounds the first list: the daemon's life when patient.
	ctx, cancel := context.WithCancel(context.Background())
	started := make(chan error, 1)
	go func() { started <- w.Start(ctx) }()
	listed := func(err error) error {
		if err != nil {
			cancel()
			return fmt.Errorf("watch node %q: %w", node, err)
		}
		if !d.track(func() {
			<-d.stop
			w.Stop()
			cancel()
		}) {
			w.Stop()
			cancel()
			return fmt.Errorf("watch node %q: %w", node, ErrClosed)
		}
		d.nodeWatcher.Store(w)
		d.followServiceCIDRs(api, 30*time.Second)
		return nil
	}
	timer := time.NewTimer(wait)
	defer timer.Stop()
	select {
	case err := <-started:
		return listed(err)
	case <-timer.C:
	case <-d.stop:
		cancel()
		w.Stop()
		return fmt.Errorf("watch node %q: %w", node, ErrClosed)
	}
	if !patient {
		cancel()
		w.Stop()
		return fmt.Errorf("watch node %q: %w in %v", node, ErrNodeNotListed, wait)
	}
	if !d.track(func() {
		select {
		case err := <-started:
			if err = listed(err); err != nil {
				d.log.Error("not following the node label", "node", node, "error", err)
				return
			}
			d.log.Info("the Kubernetes API answered: following the node label", "node", node, "label", nodelabel.OffloadLabel)
		case <-d.stop:
			cancel() // Start stops the watcher and returns ctx's error
			if err := <-started; err != nil && !errors.Is(err, context.Canceled) {
				d.log.Debug("node label watch ended before the API answered", "error", err)
			}
		}
	}) {
		cancel()
		w.Stop()
		return fmt.Errorf("watch node %q: %w", node, ErrClosed)
	}
	return fmt.Errorf("watch node %q: %w in %v; serving with the configured XDP mode, retrying", node, ErrNodeNotListed, wait)
}
