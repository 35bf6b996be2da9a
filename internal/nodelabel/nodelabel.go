// Package nodelabel follows the node label (stunner.l7mp.io/xdp-offload) that
// switches the kernel path on or off on one node, live, through the
// Kubernetes API.
package nodelabel

import (
	"context"
	"errors"
	"log/slog"
	"sync"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/client-go/tools/cache"

	"github.com/l7mp/stunnerd-xdp/internal/kube"
)

// OffloadLabel is the node label that switches the XDP offload on one node.
const OffloadLabel = "stunner.l7mp.io/xdp-offload"

// Values of OffloadLabel. Anything else is invalid and counts as absent.
const (
	OffloadLabelEnabled  = "enabled"
	OffloadLabelDisabled = "disabled"
)

// Offload is what the node's label asks the daemon to do with XDP.
type Offload int

const (
	// Default: no (valid) label, or no node: do what --xdp-mode says.
	Default Offload = iota
	// Attach: the label is "enabled": attach XDP.
	Attach
	// Detach: the label is "disabled": detach XDP, relay in userspace.
	Detach
)

func (o Offload) String() string {
	switch o {
	case Attach:
		return "attach"
	case Detach:
		return "detach"
	default:
		return "default"
	}
}

// State is what the watcher last saw in OffloadLabel, for metrics
// (stunnerd_xdp_offload_label{state}).
type State int

const (
	Absent State = iota
	Enabled
	Disabled
	Invalid
)

// States lists every State, so that a gauge can export all of them
// (1 for the current one, 0 for the others).
var States = []State{Absent, Enabled, Disabled, Invalid}

func (s State) String() string {
	switch s {
	case Enabled:
		return "enabled"
	case Disabled:
		return "disabled"
	case Invalid:
		return "invalid"
	default:
		return "absent"
	}
}

// Offload is what the label state asks for: an invalid value counts as absent.
func (s State) Offload() Offload {
	switch s {
	case Enabled:
		return Attach
	case Disabled:
		return Detach
	default:
		return Default
	}
}

// parseLabel sorts a node's labels into a State; value is the raw label
// value ("" when absent), for the logs.
func parseLabel(node *corev1.Node) (state State, value string) {
	if node == nil {
		return Absent, ""
	}
	value, ok := node.Labels[OffloadLabel]
	switch {
	case !ok:
		return Absent, ""
	case value == OffloadLabelEnabled:
		return Enabled, value
	case value == OffloadLabelDisabled:
		return Disabled, value
	default:
		return Invalid, value
	}
}

// OffloadFunc is called when the node's desired offload changes. ctx is
// cancelled when the watcher stops, so a slow attach or detach can give up.
type OffloadFunc func(ctx context.Context, want Offload) error

// Watcher follows OffloadLabel on one Node and reports the desired offload:
//
//   - "enabled" → Attach, "disabled" → Detach;
//   - no label, or the Node deleted → Default (the daemon's --xdp-mode);
//   - any other value is logged as a warning with the value and treated as
//     absent (Default), so a typo never detaches a working offload
//     nor attaches one the operator did not ask for; State reports it
//     as Invalid.
//
// The watcher starts from Default, which is what the daemon does
// before it knows the label, and calls the OffloadFunc only when the desired
// offload differs from the last one it delivered: relabelling to the same
// value, other label changes and an invalid value after an absent one cause
// no call. Calls come from one goroutine, one at a time, in order; while one
// runs, newer changes are coalesced into the latest. A callback error is
// logged and the state still counts as delivered: the watcher does not retry,
// the callback decides how to fall back (the userspace path keeps working).
//
// Only the own Node is fetched (kube.API's Node source selects it by name).
// Events for other names are ignored anyway, in case a server (or a fake)
// does not apply the selector.
type Watcher struct {
	source   cache.ListerWatcher
	node     string
	onChange OffloadFunc
	log      *slog.Logger

	mu        sync.Mutex // guards the label state, shared with metrics
	state     State
	want      Offload // latest desired, maybe not delivered yet
	delivered Offload // last handed to onChange

	life     sync.Mutex // guards started, informer and cancel
	started  bool
	informer chan struct{}      // closed when the informer's Run returned; nil before Start
	cancel   context.CancelFunc // cancels the worker and a running callback
	stopOnce sync.Once

	wake    chan struct{} // cap 1: "want may have changed"
	stopped chan struct{} // closed by Stop
	done    chan struct{} // closed when the worker exits
}

// NewWatcher makes a watcher for the Node named node, listed and watched
// through api. It does nothing until Start or Run.
func NewWatcher(api kube.API, node string, onChange OffloadFunc, log *slog.Logger) *Watcher {
	return &Watcher{
		source:   api.Node(node),
		node:     node,
		onChange: onChange,
		log:      log,
		wake:     make(chan struct{}, 1),
		stopped:  make(chan struct{}),
		done:     make(chan struct{}),
	}
}

var (
	// ErrWatcherStarted is returned by a second Start or Run.
	ErrWatcherStarted = errors.New("node watcher already started")
	// ErrWatcherStopped is returned by Start or Run after (or during) Stop.
	ErrWatcherStopped = errors.New("node watcher stopped")
)

// Start starts the informer and the callback worker and waits until the
// informer has listed the Node once (the initial label, if any, is then on
// its way to the callback). If ctx ends first it stops everything and returns
// ctx's error. ctx bounds only the start; Stop ends the watch.
func (w *Watcher) Start(ctx context.Context) error {
	w.life.Lock()
	if w.started {
		w.life.Unlock()
		return ErrWatcherStarted
	}
	w.started = true
	select {
	case <-w.stopped:
		w.life.Unlock()
		return ErrWatcherStopped
	default:
	}
	informer := cache.NewSharedIndexInformer(w.source, &corev1.Node{}, 0, cache.Indexers{})
	// The informer calls a handler's funcs from one goroutine; they only
	// record the state and wake the worker, so a slow attach never holds up
	// the informer.
	if _, err := informer.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { w.observe(obj, false) },
		UpdateFunc: func(_, obj any) { w.observe(obj, false) },
		DeleteFunc: func(obj any) { w.observe(obj, true) },
	}); err != nil {
		w.life.Unlock()
		return err
	}
	workerCtx, cancel := context.WithCancel(context.Background())
	ran := make(chan struct{})
	w.informer, w.cancel = ran, cancel
	go w.worker(workerCtx)
	go func() {
		defer close(ran)
		informer.Run(w.stopped)
	}()
	w.life.Unlock()

	synced := make(chan bool, 1)
	go func() { synced <- cache.WaitForCacheSync(w.stopped, informer.HasSynced) }()
	select {
	case ok := <-synced:
		if !ok {
			return ErrWatcherStopped
		}
		return nil
	case <-ctx.Done():
		w.Stop()
		<-synced
		return ctx.Err()
	}
}

// Stop stops the informer, cancels a running callback's context and waits
// for the informer's goroutines and the worker to exit. It may be called more
// than once, concurrently with Start, and before Start (which then fails).
func (w *Watcher) Stop() {
	w.stopOnce.Do(func() { close(w.stopped) })
	w.life.Lock()
	ran, cancel := w.informer, w.cancel
	w.life.Unlock()
	if ran == nil {
		return
	}
	cancel()
	<-ran
	<-w.done
}

// Run is Start, then waiting for ctx (or Stop) to end, then Stop. Ending ctx
// is the normal shutdown, so Run returns nil for it even when the first list
// had not completed yet (an unreachable API server at boot leaves the daemon
// on --xdp-mode, which is not Run's failure); it returns an error only when
// the watcher cannot start at all.
func (w *Watcher) Run(ctx context.Context) error {
	if err := w.Start(ctx); err != nil {
		if ctx.Err() != nil && errors.Is(err, ctx.Err()) {
			return nil
		}
		return err
	}
	select {
	case <-ctx.Done():
	case <-w.stopped:
	}
	w.Stop()
	return nil
}

// State is what the label last said (for stunnerd_xdp_offload_label).
func (w *Watcher) State() State {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.state
}

// Desired is the last desired offload handed to the callback.
func (w *Watcher) Desired() Offload {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.delivered
}

// observe runs on the informer's handler goroutine.
func (w *Watcher) observe(obj any, deleted bool) {
	if tomb, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = tomb.Obj
	}
	node, ok := obj.(*corev1.Node)
	if !ok || node.Name != w.node {
		return
	}
	state, value := parseLabel(node)
	if deleted {
		state, value = Absent, ""
	}

	w.mu.Lock()
	changed := state != w.state
	w.state = state
	w.want = state.Offload()
	w.mu.Unlock()
	if !changed {
		return
	}
	if state == Invalid {
		w.log.Warn("invalid node label value, treated as absent", "node", w.node, "label", OffloadLabel,
			"value", value, "valid", []string{OffloadLabelEnabled, OffloadLabelDisabled})
	}
	w.log.Info("node offload label changed", "node", w.node, "label", OffloadLabel, "value", value,
		"state", state.String(), "desired", state.Offload().String(), "node_deleted", deleted)
	select {
	case w.wake <- struct{}{}:
	default:
	}
}

// worker is the only caller of onChange.
func (w *Watcher) worker(ctx context.Context) {
	defer close(w.done)
	for {
		select {
		case <-ctx.Done():
			return
		case <-w.wake:
		}
		w.mu.Lock()
		want, delivered := w.want, w.delivered
		w.delivered = want
		w.mu.Unlock()
		if want == delivered {
			continue
		}
		w.log.Info("node offload desired state changed", "node", w.node, "from", delivered.String(), "to", want.String())
		if err := w.onChange(ctx, want); err != nil {
			w.log.Error("applying node offload failed", "node", w.node, "desired", want.String(), "error", err)
		}
	}
}
