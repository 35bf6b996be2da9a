package logging

import (
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// fakeClock is a manually advanced clock, safe for concurrent reads.
type fakeClock struct{ ns atomic.Int64 }

func (c *fakeClock) now() time.Time          { return time.Unix(0, c.ns.Load()) }
func (c *fakeClock) advance(d time.Duration) { c.ns.Add(int64(d)) }

// limitedFactory returns a Factory writing to a buffer, with a limiter of
// burst lines then one per second on a fake clock.
func newLimitedFactory(t *testing.T, spec string, burst int) (*Factory, *fakeClock, *syncBuffer) {
	t.Helper()
	buf := &syncBuffer{}
	f, err := New(spec, "text", buf)
	if err != nil {
		t.Fatal(err)
	}
	clk := &fakeClock{}
	f.limiter = NewLimiter(time.Second, burst)
	f.limiter.now = clk.now
	return f, clk, buf
}

// syncBuffer is a log sink whose lines are taken by the test.
type syncBuffer struct {
	testenv.LockedBuffer
	read int
}

// take returns the lines written since the last take.
func (s *syncBuffer) take() []string {
	all := s.String()
	out := strings.Split(strings.TrimSpace(all[s.read:]), "\n")
	s.read = len(all)
	if len(out) == 1 && out[0] == "" {
		return nil
	}
	return out
}

func TestLimitedSlog(t *testing.T) {
	f, clk, buf := newLimitedFactory(t, "all:INFO", 3)
	log := f.Limited("auth")
	for i := range 10 {
		log.Info("unknown user", "user", fmt.Sprint("u", i))
	}
	if got := buf.take(); len(got) != 3 {
		t.Fatalf("a burst of 10 wrote %d lines, want 3: %q", len(got), got)
	}
	// Another message has a budget of its own.
	log.Warn("permission refused")
	if got := buf.take(); len(got) != 1 {
		t.Fatalf("another message: %q", got)
	}
	clk.advance(time.Second)
	log.Info("unknown user", "user", "late")
	got := buf.take()
	if len(got) != 1 || !strings.Contains(got[0], "user=late") || !strings.Contains(got[0], SuppressedKey+"=7") {
		t.Fatalf("after a second: %q, want one line with %s=7", got, SuppressedKey)
	}
	// DEBUG is asked for on purpose: not limited, and it uses no budget.
	if err := f.SetLevels("all:DEBUG"); err != nil {
		t.Fatal(err)
	}
	for range 10 {
		log.Debug("unknown user detail")
	}
	if got := buf.take(); len(got) != 10 {
		t.Fatalf("DEBUG lines: %d, want 10", len(got))
	}
	// Lines the level hides use no budget either.
	if err := f.SetLevels("all:WARN"); err != nil {
		t.Fatal(err)
	}
	for range 10 {
		log.Info("hidden")
	}
	if err := f.SetLevels("all:INFO"); err != nil {
		t.Fatal(err)
	}
	log.Info("hidden")
	if got := buf.take(); len(got) != 1 || strings.Contains(got[0], SuppressedKey) {
		t.Fatalf("after hidden lines: %q", got)
	}
}

// pion's lines are told apart by their format, not their arguments: a flood
// from many addresses shares one budget.
func TestLimitedFactory(t *testing.T) {
	f, clk, buf := newLimitedFactory(t, "all:INFO", 2)
	l := f.LimitedFactory().NewLogger("turn")
	for i := range 100 {
		l.Infof("No Permission or Channel exists for %v on allocation %v", fmt.Sprint("10.0.0.1:", i), "10.0.0.2:50000")
		l.Errorf("Failed to send ChannelData from allocation %v %v", i, "boom")
		l.Debugf("Relay socket %v received %d bytes", i, 100)
	}
	if got := buf.take(); len(got) != 4 {
		t.Fatalf("%d lines, want 2 per message (DEBUG is off): %q", len(got), got)
	}
	clk.advance(time.Second)
	l.Info("plain")
	l.Infof("No Permission or Channel exists for %v on allocation %v", "x", "y")
	got := buf.take()
	if len(got) != 2 || strings.Contains(got[0], SuppressedKey) || !strings.Contains(got[1], SuppressedKey+"=98") {
		t.Fatalf("after a second: %q", got)
	}
	// The plain Factory logger is not limited.
	p := f.NewLogger("turn")
	for range 5 {
		p.Infof("No Permission or Channel exists for %v on allocation %v", "x", "y")
	}
	if got := buf.take(); len(got) != 5 {
		t.Fatalf("unlimited logger wrote %d of 5", len(got))
	}
}

func TestLimiterConcurrentAndBounded(t *testing.T) {
	f, clk, buf := newLimitedFactory(t, "all:INFO", 10)
	log := f.Limited("auth")
	var wg sync.WaitGroup
	for w := range 8 {
		wg.Go(func() {
			for i := range 500 {
				log.Info("flood")
				// Data as the message: the key space is capped, the
				// overflow shares one budget.
				log.Info(fmt.Sprint("junk ", w, " ", i))
			}
		})
	}
	wg.Wait()
	got := buf.take()
	flood := 0
	for _, l := range got {
		if strings.Contains(l, "msg=flood") {
			flood++
		}
	}
	// The clock is frozen: exactly the burst of "flood"; the junk messages
	// got maxLimiterKeys-1 budgets of 10 and the overflow one more burst.
	if flood != 10 || len(got) > 10*maxLimiterKeys+10 {
		t.Fatalf("flood lines %d (want 10), total %d", flood, len(got))
	}
	if n := len(f.limiter.keys); n > maxLimiterKeys {
		t.Fatalf("%d keys, want at most %d", n, maxLimiterKeys)
	}
	clk.advance(time.Second)
	log.Info("flood")
	if got := buf.take(); len(got) != 1 || !strings.Contains(got[0], SuppressedKey+"=3990") {
		t.Fatalf("after a second: %q", got)
	}
}
