package logging

import (
	"context"
	"log/slog"
	"sync"
	"time"

	pionlog "github.com/pion/logging"
	"golang.org/x/time/rate"
)

// Defaults of the Factory's Limiter: a burst of lines per message, then one
// per interval. A flood of 40,000 junk datagrams lasting a few seconds leaves
// a handful of lines per message.
const (
	DefaultLimitBurst    = 10
	DefaultLimitInterval = 5 * time.Second
	// SuppressedKey is the attribute that counts the lines of a message
	// dropped since the previous one that was written.
	SuppressedKey = "suppressed"
	// maxLimiterKeys bounds the limiter's memory; keys are format strings and
	// constant messages, so this is never reached unless a caller logs data as
	// the message. The messages beyond it share one budget.
	maxLimiterKeys = 1024
)

// Limiter bounds the log lines that others can cause (unauthenticated
// requests, unknown users, datagrams to relay ports without a permission,
// refused peers): per message, a burst, then one line per interval; the next
// line written carries how many were dropped. Messages are told apart by
// their format string (pion's) or message (slog's), never by their
// arguments, so a flood from many addresses shares one budget. Lines below
// INFO are not limited: DEBUG and TRACE are asked for on purpose. It is safe
// for concurrent use.
type Limiter struct {
	every time.Duration
	burst int
	now   func() time.Time

	mu   sync.Mutex
	keys map[string]*keyLimit
}

type keyLimit struct {
	lim     *rate.Limiter
	dropped uint64
}

// NewLimiter lets burst lines of a message through at once and one per
// every after that. A non-positive every disables limiting.
func NewLimiter(every time.Duration, burst int) *Limiter {
	return &Limiter{every: every, burst: max(burst, 1), now: time.Now, keys: map[string]*keyLimit{}}
}

// allow reports whether a line of message key may be written and how many
// were dropped since the last one that was.
func (l *Limiter) allow(level slog.Level, key string) (dropped uint64, ok bool) {
	if l == nil || l.every <= 0 || level < slog.LevelInfo {
		return 0, true
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	k, found := l.keys[key]
	if !found {
		if len(l.keys) >= maxLimiterKeys-1 { // one is kept for the overflow
			key = ""
			k = l.keys[key]
		}
		if k == nil {
			k = &keyLimit{lim: rate.NewLimiter(rate.Every(l.every), l.burst)}
			l.keys[key] = k
		}
	}
	if !k.lim.AllowN(l.now(), 1) {
		k.dropped++
		return 0, false
	}
	dropped, k.dropped = k.dropped, 0
	return dropped, true
}

// Limited returns a logger for scope whose INFO and higher lines go through
// the Factory's Limiter, one budget per message. Use it for lines a remote
// party can trigger.
func (f *Factory) Limited(scope string) *slog.Logger {
	l := f.Slog(scope)
	return slog.New(&limitHandler{inner: l.Handler(), lim: f.limiter, scope: scope})
}

// LimitedFactory is a pion LoggerFactory whose loggers' INFO and higher lines
// go through the Factory's Limiter, one budget per format string: for
// pion/turn, whose lines about requests and datagrams anyone can trigger.
func (f *Factory) LimitedFactory() pionlog.LoggerFactory { return limitedFactory{f} }

type limitedFactory struct{ f *Factory }

func (lf limitedFactory) NewLogger(scope string) pionlog.LeveledLogger {
	return &leveledLogger{l: lf.f.Slog(scope), lim: lf.f.limiter, scope: scope}
}

// limitHandler drops the lines its Limiter refuses.
type limitHandler struct {
	inner slog.Handler
	lim   *Limiter
	scope string
}

func (h *limitHandler) Enabled(ctx context.Context, l slog.Level) bool {
	return h.inner.Enabled(ctx, l)
}

func (h *limitHandler) Handle(ctx context.Context, r slog.Record) error {
	dropped, ok := h.lim.allow(r.Level, h.scope+"\x00"+r.Message)
	if !ok {
		return nil
	}
	if dropped > 0 {
		r.AddAttrs(slog.Uint64(SuppressedKey, dropped))
	}
	return h.inner.Handle(ctx, r)
}

func (h *limitHandler) WithAttrs(as []slog.Attr) slog.Handler {
	return &limitHandler{inner: h.inner.WithAttrs(as), lim: h.lim, scope: h.scope}
}

func (h *limitHandler) WithGroup(name string) slog.Handler {
	return &limitHandler{inner: h.inner.WithGroup(name), lim: h.lim, scope: h.scope}
}
