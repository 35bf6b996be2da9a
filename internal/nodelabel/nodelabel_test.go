package nodelabel_test

import (
	"context"
	"errors"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	"github.com/l7mp/stunnerd-xdp/internal/kube"
	"github.com/l7mp/stunnerd-xdp/internal/kube/kubetest"
	"github.com/l7mp/stunnerd-xdp/internal/nodelabel"
	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// waitTimeout bounds every wait; the fake clientset delivers events in
// milliseconds, so reaching it means the event never came.
const waitTimeout = 10 * time.Second

// recorder is an OffloadFunc that keeps every call.
type recorder struct {
	mu       sync.Mutex
	calls    []nodelabel.Offload
	inFlight atomic.Int32
	overlap  atomic.Bool
	delay    time.Duration
	err      error
}

func (r *recorder) fn(_ context.Context, want nodelabel.Offload) error {
	if r.inFlight.Add(1) > 1 {
		r.overlap.Store(true)
	}
	defer r.inFlight.Add(-1)
	if r.delay > 0 {
		time.Sleep(r.delay)
	}
	r.mu.Lock()
	r.calls = append(r.calls, want)
	r.mu.Unlock()
	return r.err
}

func (r *recorder) get() []nodelabel.Offload {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.calls)
}

// expect waits until the callback has been called len(want) times and checks
// the sequence. Because calls are ordered, a spurious call (a missing dedup, a
// label on another node) shows up as a wrong element.
func (r *recorder) expect(t *testing.T, want ...nodelabel.Offload) {
	t.Helper()
	r.expectWithin(t, waitTimeout, want...)
}

// expectWithin is expect with its own bound, for a watch that resumes after an
// API outage (the reflector backs off while the server is down).
func (r *recorder) expectWithin(t *testing.T, limit time.Duration, want ...nodelabel.Offload) {
	t.Helper()
	waitForWithin(t, limit, func() bool { return len(r.get()) >= len(want) }, "callback calls %v, have %v", want, r.get)
	if got := r.get(); !slices.Equal(got, want) {
		t.Fatalf("callback calls %v, want %v", got, want)
	}
}

func waitFor(t *testing.T, cond func() bool, format string, args ...any) {
	t.Helper()
	waitForWithin(t, waitTimeout, cond, format, args...)
}

func waitForWithin(t *testing.T, limit time.Duration, cond func() bool, format string, args ...any) {
	t.Helper()
	deadline := time.Now().Add(limit)
	for !cond() {
		if time.Now().After(deadline) {
			for i, a := range args {
				if f, ok := a.(func() []nodelabel.Offload); ok {
					args[i] = f()
				}
			}
			t.Fatalf("timed out: "+format, args...)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

func node(name string, labels map[string]string) *corev1.Node {
	return &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: labels}}
}

// setLabel sets (value != "") or removes (value == "") a label on a node.
func setLabel(t *testing.T, client kubernetes.Interface, name, key, value string) {
	t.Helper()
	ctx := context.Background()
	n, err := client.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if n.Labels == nil {
		n.Labels = map[string]string{}
	}
	if value == "" {
		delete(n.Labels, key)
	} else {
		n.Labels[key] = value
	}
	if _, err := client.CoreV1().Nodes().Update(ctx, n, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
}

func startWatcher(t *testing.T, api kube.API, name string, rec *recorder, logs *testenv.LockedBuffer) *nodelabel.Watcher {
	t.Helper()
	log := slog.New(slog.NewJSONHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	w := nodelabel.NewWatcher(api, name, rec.fn, log)
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	if err := w.Start(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(w.Stop)
	return w
}

func TestNodeWatcherFollowsLabel(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	const (
		attach = nodelabel.Attach
		detach = nodelabel.Detach
		dflt   = nodelabel.Default
	)
	client := fake.NewClientset(node("n1", nil), node("n2", nil))

	// The fake tracker ignores field selectors; record what the informer
	// asked for, so the test still shows it fetches only its own node.
	var selMu sync.Mutex
	var selectors []string
	record := func(action k8stesting.Action) {
		selMu.Lock()
		defer selMu.Unlock()
		switch a := action.(type) {
		case k8stesting.ListAction:
			selectors = append(selectors, "list:"+a.GetListRestrictions().Fields.String())
		case k8stesting.WatchAction:
			selectors = append(selectors, "watch:"+a.GetWatchRestrictions().Fields.String())
		}
	}
	client.PrependReactor("list", "nodes", func(a k8stesting.Action) (bool, runtime.Object, error) {
		record(a)
		return false, nil, nil
	})
	client.PrependWatchReactor("nodes", func(a k8stesting.Action) (bool, watch.Interface, error) {
		record(a)
		return false, nil, nil
	})

	rec := &recorder{}
	logs := &testenv.LockedBuffer{}
	w := startWatcher(t, kubetest.FromClientset(client), "n1", rec, logs)

	if got := w.State(); got != nodelabel.Absent {
		t.Fatalf("label state %v at start, want absent", got)
	}

	t.Run("enabled attaches", func(t *testing.T) {
		setLabel(t, client, "n1", nodelabel.OffloadLabel, "enabled")
		rec.expect(t, attach)
		if got := w.State(); got != nodelabel.Enabled {
			t.Fatalf("label state %v, want enabled", got)
		}
	})
	t.Run("same value and other labels deduplicated", func(t *testing.T) {
		setLabel(t, client, "n1", nodelabel.OffloadLabel, "enabled")
		setLabel(t, client, "n1", "unrelated", "x")
	})
	t.Run("another node ignored", func(t *testing.T) {
		setLabel(t, client, "n2", nodelabel.OffloadLabel, "disabled")
		setLabel(t, client, "n2", nodelabel.OffloadLabel, "enabled")
	})
	t.Run("disabled detaches", func(t *testing.T) {
		setLabel(t, client, "n1", nodelabel.OffloadLabel, "disabled")
		// attach once only: the dedup and other-node cases above added nothing.
		rec.expect(t, attach, detach)
		if got := w.Desired(); got != detach {
			t.Fatalf("desired %v, want detach", got)
		}
	})
	t.Run("invalid value is absent", func(t *testing.T) {
		setLabel(t, client, "n1", nodelabel.OffloadLabel, "Enabled")
		rec.expect(t, attach, detach, dflt)
		waitFor(t, func() bool { return w.State() == nodelabel.Invalid }, "label state invalid")
		waitFor(t, func() bool {
			return strings.Contains(logs.String(), `"value":"Enabled"`) &&
				strings.Contains(logs.String(), `"level":"WARN"`)
		}, "a warning naming the bad value")
		// invalid → absent: both mean default, so no call.
		setLabel(t, client, "n1", nodelabel.OffloadLabel, "")
		waitFor(t, func() bool { return w.State() == nodelabel.Absent }, "label state absent")
	})
	t.Run("node deletion is default", func(t *testing.T) {
		setLabel(t, client, "n1", nodelabel.OffloadLabel, "disabled")
		rec.expect(t, attach, detach, dflt, detach)
		if err := client.CoreV1().Nodes().Delete(context.Background(), "n1", metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
		rec.expect(t, attach, detach, dflt, detach, dflt)
		if got := w.State(); got != nodelabel.Absent {
			t.Fatalf("label state %v after deletion, want absent", got)
		}
	})
	t.Run("recreated node", func(t *testing.T) {
		if _, err := client.CoreV1().Nodes().Create(context.Background(),
			node("n1", map[string]string{nodelabel.OffloadLabel: "enabled"}), metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		rec.expect(t, attach, detach, dflt, detach, dflt, attach)
	})

	if strings.Contains(logs.String(), `"node":"n2"`) {
		t.Errorf("the watcher of n1 logged about n2:\n%s", logs)
	}
	for _, want := range []string{`"msg":"node offload label changed"`, `"node":"n1"`, `"desired":"attach"`, `"value":"enabled"`} {
		if !strings.Contains(logs.String(), want) {
			t.Errorf("logs lack %s:\n%s", want, logs)
		}
	}
	w.Stop()
	selMu.Lock()
	defer selMu.Unlock()
	if len(selectors) == 0 {
		t.Fatal("the informer never listed or watched nodes")
	}
	for _, s := range selectors {
		if !strings.HasSuffix(s, ":metadata.name=n1") {
			t.Errorf("request %q is not restricted to metadata.name=n1", s)
		}
	}
}

func TestNodeWatcherInitialState(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	for _, tc := range []struct {
		name  string
		nodes []runtime.Object
		want  []nodelabel.Offload
		state nodelabel.State
	}{
		{"enabled at start", []runtime.Object{node("n1", map[string]string{nodelabel.OffloadLabel: "enabled"})},
			[]nodelabel.Offload{nodelabel.Attach}, nodelabel.Enabled},
		{"disabled at start", []runtime.Object{node("n1", map[string]string{nodelabel.OffloadLabel: "disabled"})},
			[]nodelabel.Offload{nodelabel.Detach}, nodelabel.Disabled},
		// The daemon starts in the default state, so these need no call.
		{"absent at start", []runtime.Object{node("n1", nil)}, nil, nodelabel.Absent},
		{"invalid at start", []runtime.Object{node("n1", map[string]string{nodelabel.OffloadLabel: "yes"})}, nil, nodelabel.Invalid},
		{"no such node", nil, nil, nodelabel.Absent},
	} {
		t.Run(tc.name, func(t *testing.T) {
			client := fake.NewClientset(tc.nodes...)
			rec := &recorder{}
			w := startWatcher(t, kubetest.FromClientset(client), "n1", rec, &testenv.LockedBuffer{})
			rec.expect(t, tc.want...)
			// Start returns after the first list, so the state is known.
			if got := w.State(); got != tc.state {
				t.Fatalf("label state %v, want %v", got, tc.state)
			}
			if tc.nodes == nil {
				// A node that appears later is picked up.
				if _, err := client.CoreV1().Nodes().Create(context.Background(),
					node("n1", map[string]string{nodelabel.OffloadLabel: "disabled"}), metav1.CreateOptions{}); err != nil {
					t.Fatal(err)
				}
				rec.expect(t, nodelabel.Detach)
			}
			w.Stop()
		})
	}
}

func TestNodeWatcherCallbackErrorLogged(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	client := fake.NewClientset(node("n1", nil))
	rec := &recorder{err: errors.New("attach failed: no XDP here")}
	logs := &testenv.LockedBuffer{}
	w := startWatcher(t, kubetest.FromClientset(client), "n1", rec, logs)
	setLabel(t, client, "n1", nodelabel.OffloadLabel, "enabled")
	rec.expect(t, nodelabel.Attach)
	waitFor(t, func() bool {
		s := logs.String()
		return strings.Contains(s, `"level":"ERROR"`) && strings.Contains(s, "no XDP here")
	}, "the callback's error in the log")
	// A failed callback does not stop later changes.
	setLabel(t, client, "n1", nodelabel.OffloadLabel, "disabled")
	rec.expect(t, nodelabel.Attach, nodelabel.Detach)
	w.Stop()
}

// TestNodeWatcherSerialCallbacks flips the label faster than a slow callback
// runs: calls never overlap, never repeat the previous state, and the last one
// is the final label.
func TestNodeWatcherSerialCallbacks(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	client := fake.NewClientset(node("n1", nil))
	rec := &recorder{delay: 5 * time.Millisecond}
	w := startWatcher(t, kubetest.FromClientset(client), "n1", rec, &testenv.LockedBuffer{})
	values := []string{"enabled", "disabled"}
	for i := range 40 {
		setLabel(t, client, "n1", nodelabel.OffloadLabel, values[i%2])
	}
	waitFor(t, func() bool {
		c := rec.get()
		return len(c) > 0 && c[len(c)-1] == nodelabel.Detach && w.State() == nodelabel.Disabled &&
			rec.inFlight.Load() == 0
	}, "the last call to be detach, have %v", rec.get)
	if rec.overlap.Load() {
		t.Fatal("callbacks ran concurrently")
	}
	calls := rec.get()
	prev := nodelabel.Default
	for i, c := range calls {
		if c == prev {
			t.Fatalf("call %d repeats %v: %v", i, c, calls)
		}
		prev = c
	}
	w.Stop()
}

func TestNodeWatcherLifecycle(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	log := slog.New(slog.NewTextHandler(&testenv.LockedBuffer{}, nil))
	noop := func(context.Context, nodelabel.Offload) error { return nil }

	t.Run("Run returns when ctx ends", func(t *testing.T) {
		rec := &recorder{}
		w := nodelabel.NewWatcher(kubetest.FromClientset(fake.NewClientset(node("n1", map[string]string{nodelabel.OffloadLabel: "enabled"}))),
			"n1", rec.fn, log)
		ctx, cancel := context.WithCancel(context.Background())
		errc := make(chan error, 1)
		go func() { errc <- w.Run(ctx) }()
		rec.expect(t, nodelabel.Attach) // running
		cancel()
		select {
		case err := <-errc:
			if err != nil {
				t.Fatal(err)
			}
		case <-time.After(waitTimeout):
			t.Fatal("Run did not return after cancel")
		}
		if err := w.Start(context.Background()); !errors.Is(err, nodelabel.ErrWatcherStarted) {
			t.Fatalf("Start after Run: %v, want ErrWatcherStarted", err)
		}
		w.Stop() // again: a no-op
	})
	t.Run("Stop before Start", func(t *testing.T) {
		w := nodelabel.NewWatcher(kubetest.FromClientset(fake.NewClientset()), "n1", noop, log)
		w.Stop()
		if err := w.Start(context.Background()); !errors.Is(err, nodelabel.ErrWatcherStopped) {
			t.Fatalf("Start after Stop: %v, want ErrWatcherStopped", err)
		}
	})
	t.Run("Start gives up with ctx", func(t *testing.T) {
		client := fake.NewClientset()
		// A list that always fails keeps the informer from syncing.
		client.PrependReactor("list", "nodes", func(k8stesting.Action) (bool, runtime.Object, error) {
			return true, nil, errors.New("apiserver unreachable")
		})
		w := nodelabel.NewWatcher(kubetest.FromClientset(client), "n1", noop, log)
		ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
		defer cancel()
		if err := w.Start(ctx); !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("Start: %v, want DeadlineExceeded", err)
		}
		w.Stop()
	})
	t.Run("Stop cancels a running callback", func(t *testing.T) {
		client := fake.NewClientset(node("n1", nil))
		entered := make(chan struct{})
		w := nodelabel.NewWatcher(kubetest.FromClientset(client), "n1", func(ctx context.Context, _ nodelabel.Offload) error {
			close(entered)
			<-ctx.Done()
			return ctx.Err()
		}, log)
		if err := w.Start(context.Background()); err != nil {
			t.Fatal(err)
		}
		setLabel(t, client, "n1", nodelabel.OffloadLabel, "enabled")
		select {
		case <-entered:
		case <-time.After(waitTimeout):
			t.Fatal("callback never called")
		}
		w.Stop() // returns only once the callback gave up
	})
}

func TestLabelStateStrings(t *testing.T) {
	want := map[nodelabel.State]string{nodelabel.Absent: "absent", nodelabel.Enabled: "enabled",
		nodelabel.Disabled: "disabled", nodelabel.Invalid: "invalid"}
	if len(nodelabel.States) != len(want) {
		t.Fatalf("States has %d states, want %d", len(nodelabel.States), len(want))
	}
	for _, s := range nodelabel.States {
		if s.String() != want[s] {
			t.Errorf("%d.String() = %q, want %q", s, s.String(), want[s])
		}
	}
	for o, s := range map[nodelabel.Offload]string{nodelabel.Default: "default",
		nodelabel.Attach: "attach", nodelabel.Detach: "detach"} {
		if o.String() != s {
			t.Errorf("%d.String() = %q, want %q", o, o.String(), s)
		}
	}
}
