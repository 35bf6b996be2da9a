package logging

import (
	"fmt"
	"log/slog"
	"math"
	"sync"
	"time"

	pionlog "github.com/pion/logging"
)

// RateLimited is a pion LeveledLogger for the data path: it forwards at most
// burst messages at once and, after that, one message per interval, dropping
// the rest. The next forwarded message carries the number of messages dropped
// since the previous one, so operators know something was suppressed. One
// token bucket is shared by all levels. It is safe for concurrent use.
type RateLimited struct {
	l        pionlog.LeveledLogger
	every    time.Duration
	capacity time.Duration // burst*every: the bucket size measured in time
	now      func() time.Time

	mu         sync.Mutex
	credit     time.Duration // accumulated time; each message costs every
	last       time.Time
	suppressed uint64
}

var _ pionlog.LeveledLogger = (*RateLimited)(nil)

// NewRateLimited wraps l so that it emits at most burst messages in a burst
// and one message per every on average. A burst below 1 is treated as 1; a
// non-positive every disables rate limiting.
func NewRateLimited(l pionlog.LeveledLogger, every time.Duration, burst int) *RateLimited {
	return newRateLimited(l, every, burst, time.Now)
}

// newRateLimited allows tests to inject a fake clock.
func newRateLimited(l pionlog.LeveledLogger, every time.Duration, burst int, now func() time.Time) *RateLimited {
	burst = max(burst, 1)
	capacity := time.Duration(math.MaxInt64)
	if every > 0 && int64(burst) <= math.MaxInt64/int64(every) {
		capacity = every * time.Duration(burst)
	}
	// Start with a full bucket so the first burst of messages goes through.
	return &RateLimited{l: l, every: every, capacity: capacity, now: now, credit: capacity, last: now()}
}

// allow reports whether a message may be emitted and, if so, how many
// messages were suppressed since the last emitted one.
func (r *RateLimited) allow() (uint64, bool) {
	if r.every <= 0 {
		return 0, true
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	now := r.now()
	if elapsed := now.Sub(r.last); elapsed > 0 {
		// Written to avoid overflowing credit+elapsed after long idle periods.
		if elapsed >= r.capacity-r.credit {
			r.credit = r.capacity
		} else {
			r.credit += elapsed
		}
		r.last = now
	}
	if r.credit < r.every {
		r.suppressed++
		return 0, false
	}
	r.credit -= r.every
	n := r.suppressed
	r.suppressed = 0
	return n, true
}

// enabled lets messages below the wrapped logger's level bypass the bucket:
// otherwise disabled Trace spam would use up the budget and hide real errors.
func (r *RateLimited) enabled(level slog.Level) bool {
	if e, ok := r.l.(interface{ enabled(slog.Level) bool }); ok {
		return e.enabled(level)
	}
	return true
}

func (r *RateLimited) admit(level slog.Level) (uint64, bool) {
	if !r.enabled(level) {
		return 0, false
	}
	return r.allow()
}

func (r *RateLimited) log(level slog.Level, msg string) {
	if n, ok := r.admit(level); ok {
		r.emit(level, msg, n)
	}
}

// logf formats only admitted messages to keep dropped ones cheap.
func (r *RateLimited) logf(level slog.Level, format string, args ...any) {
	if n, ok := r.admit(level); ok {
		r.emit(level, fmt.Sprintf(format, args...), n)
	}
}

func (r *RateLimited) emit(level slog.Level, msg string, suppressed uint64) {
	if suppressed > 0 {
		msg = fmt.Sprintf("%s (suppressed %d messages)", msg, suppressed)
	}
	switch level {
	case LevelTrace:
		r.l.Trace(msg)
	case slog.LevelDebug:
		r.l.Debug(msg)
	case slog.LevelInfo:
		r.l.Info(msg)
	case slog.LevelWarn:
		r.l.Warn(msg)
	default:
		r.l.Error(msg)
	}
}

// Trace logs msg at TRACE level, subject to the rate limit.
func (r *RateLimited) Trace(msg string) { r.log(LevelTrace, msg) }

// Tracef logs a formatted message at TRACE level, subject to the rate limit.
func (r *RateLimited) Tracef(format string, args ...any) { r.logf(LevelTrace, format, args...) }

// Debug logs msg at DEBUG level, subject to the rate limit.
func (r *RateLimited) Debug(msg string) { r.log(slog.LevelDebug, msg) }

// Debugf logs a formatted message at DEBUG level, subject to the rate limit.
func (r *RateLimited) Debugf(format string, args ...any) { r.logf(slog.LevelDebug, format, args...) }

// Info logs msg at INFO level, subject to the rate limit.
func (r *RateLimited) Info(msg string) { r.log(slog.LevelInfo, msg) }

// Infof logs a formatted message at INFO level, subject to the rate limit.
func (r *RateLimited) Infof(format string, args ...any) { r.logf(slog.LevelInfo, format, args...) }

// Warn logs msg at WARN level, subject to the rate limit.
func (r *RateLimited) Warn(msg string) { r.log(slog.LevelWarn, msg) }

// Warnf logs a formatted message at WARN level, subject to the rate limit.
func (r *RateLimited) Warnf(format string, args ...any) { r.logf(slog.LevelWarn, format, args...) }

// Error logs msg at ERROR level, subject to the rate limit.
func (r *RateLimited) Error(msg string) { r.log(slog.LevelError, msg) }

// Errorf logs a formatted message at ERROR level, subject to the rate limit.
func (r *RateLimited) Errorf(format string, args ...any) { r.logf(slog.LevelError, format, args...) }
