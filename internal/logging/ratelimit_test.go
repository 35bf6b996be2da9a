package logging

import (
	"bytes"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// fakeClock is a manually advanced clock, safe for concurrent reads.
type fakeClock struct{ ns atomic.Int64 }

func (c *fakeClock) now() time.Time          { return time.Unix(0, c.ns.Load()) }
func (c *fakeClock) advance(d time.Duration) { c.ns.Add(int64(d)) }

// recorder is a LeveledLogger that records messages with their level.
type recorder struct {
	mu   sync.Mutex
	msgs []string
}

func (r *recorder) add(level, msg string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.msgs = append(r.msgs, level+" "+msg)
}

func (r *recorder) take() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	m := r.msgs
	r.msgs = nil
	return m
}

func (r *recorder) Trace(m string)            { r.add("TRACE", m) }
func (r *recorder) Tracef(f string, a ...any) { panic("RateLimited must format itself") }
func (r *recorder) Debug(m string)            { r.add("DEBUG", m) }
func (r *recorder) Debugf(f string, a ...any) { panic("RateLimited must format itself") }
func (r *recorder) Info(m string)             { r.add("INFO", m) }
func (r *recorder) Infof(f string, a ...any)  { panic("RateLimited must format itself") }
func (r *recorder) Warn(m string)             { r.add("WARN", m) }
func (r *recorder) Warnf(f string, a ...any)  { panic("RateLimited must format itself") }
func (r *recorder) Error(m string)            { r.add("ERROR", m) }
func (r *recorder) Errorf(f string, a ...any) { panic("RateLimited must format itself") }

func TestRateLimited(t *testing.T) {
	type step struct {
		advance time.Duration
		calls   int
		want    []string // messages emitted by this step, in order
	}
	for _, tc := range []struct {
		name  string
		every time.Duration
		burst int
		steps []step
	}{
		{"burst then steady", time.Second, 3, []step{
			{0, 5, []string{"INFO m", "INFO m", "INFO m"}},
			{time.Second, 1, []string{"INFO m (suppressed 2 messages)"}},
			{500 * time.Millisecond, 1, nil},
			{500 * time.Millisecond, 2, []string{"INFO m (suppressed 1 messages)"}},
			{time.Second, 1, []string{"INFO m (suppressed 1 messages)"}},
			{time.Second, 1, []string{"INFO m"}},
		}},
		{"idle refills only up to burst", time.Second, 2, []step{
			{0, 2, []string{"INFO m", "INFO m"}},
			{time.Hour, 5, []string{"INFO m", "INFO m"}},
			{time.Second, 1, []string{"INFO m (suppressed 3 messages)"}},
		}},
		{"burst below one acts as one", time.Second, 0, []step{
			{0, 3, []string{"INFO m"}},
			{time.Second, 1, []string{"INFO m (suppressed 2 messages)"}},
		}},
		{"non-positive interval disables limiting", 0, 1, []step{
			{0, 3, []string{"INFO m", "INFO m", "INFO m"}},
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var clk fakeClock
			rec := &recorder{}
			rl := newRateLimited(rec, tc.every, tc.burst, clk.now)
			for i, st := range tc.steps {
				clk.advance(st.advance)
				for range st.calls {
					rl.Info("m")
				}
				if got := rec.take(); strings.Join(got, "|") != strings.Join(st.want, "|") {
					t.Errorf("step %d: got %q, want %q", i, got, st.want)
				}
			}
		})
	}
}

func TestRateLimitedLevels(t *testing.T) {
	var clk fakeClock
	rec := &recorder{}
	rl := newRateLimited(rec, time.Second, 5, clk.now)
	rl.Tracef("t%d", 1)
	rl.Debugf("d%d", 2)
	rl.Infof("i%d", 3)
	rl.Warnf("w%d", 4)
	rl.Errorf("e%d", 5)
	rl.Error("dropped") // the bucket is shared by all levels
	clk.advance(time.Second)
	rl.Error("e")
	want := []string{"TRACE t1", "DEBUG d2", "INFO i3", "WARN w4", "ERROR e5", "ERROR e (suppressed 1 messages)"}
	if got := rec.take(); strings.Join(got, "|") != strings.Join(want, "|") {
		t.Errorf("got %q, want %q", got, want)
	}
}

// Messages the wrapped logger would discard anyway must not use up the
// budget, or disabled TRACE chatter would hide real errors.
func TestRateLimitedDisabledLevelsAreFree(t *testing.T) {
	var buf bytes.Buffer
	f, err := New("all:INFO", "text", &buf)
	if err != nil {
		t.Fatal(err)
	}
	var clk fakeClock
	rl := newRateLimited(f.NewLogger("xdp"), time.Second, 1, clk.now)
	for range 100 {
		rl.Tracef("pkt %d", 1)
		rl.Debug("pkt")
	}
	rl.Warn("real problem")
	out := buf.String()
	if !strings.Contains(out, "real problem") || strings.Contains(out, "suppressed") {
		t.Errorf("unexpected output %q", out)
	}
}

func TestRateLimitedConcurrent(t *testing.T) {
	var clk fakeClock
	rec := &recorder{}
	const burst, workers, iters = 10, 8, 500
	rl := newRateLimited(rec, time.Second, burst, clk.now)
	// The clock is frozen while goroutines run, so the outcome is exact.
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for range iters {
				rl.Infof("x")
			}
		})
	}
	wg.Wait()
	if got := rec.take(); len(got) != burst {
		t.Fatalf("emitted %d messages, want %d", len(got), burst)
	}
	clk.advance(time.Second)
	rl.Info("after")
	want := "INFO after (suppressed 3990 messages)"
	if got := rec.take(); len(got) != 1 || got[0] != want {
		t.Errorf("got %q, want %q", got, want)
	}
}
