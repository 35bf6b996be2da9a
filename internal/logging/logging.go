// Package logging provides a pion-compatible logger factory built on log/slog,
// in the style of STUNner's stunnerd logger: per-scope levels configured with a
// spec string like "all:INFO,turn:DEBUG,xdp:WARN" that can be changed live.
package logging

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"math"
	"slices"
	"strings"
	"sync"

	pionlog "github.com/pion/logging"
)

// Log levels beyond the ones defined by log/slog.
const (
	// LevelTrace sits below slog.LevelDebug so that pion's Trace calls can be
	// filtered separately from Debug; it is printed as "TRACE".
	LevelTrace = slog.LevelDebug - 4
	// LevelDisable is above every real level, so a scope set to it emits nothing.
	LevelDisable = slog.Level(math.MaxInt32)
)

// AllScope is the spec scope that sets the default level for all other scopes.
const AllScope = "all"

// ScopeKey is the attribute key under which the logger scope is recorded.
const ScopeKey = "scope"

// Output formats accepted by New.
const (
	FormatText = "text"
	FormatJSON = "json"
)

// ParseLevel parses a case-insensitive level name: TRACE, DEBUG, INFO, WARN
// (or WARNING), ERROR, DISABLE (or NONE, OFF).
func ParseLevel(s string) (slog.Level, error) {
	switch strings.ToUpper(strings.TrimSpace(s)) {
	case "TRACE":
		return LevelTrace, nil
	case "DEBUG":
		return slog.LevelDebug, nil
	case "INFO":
		return slog.LevelInfo, nil
	case "WARN", "WARNING":
		return slog.LevelWarn, nil
	case "ERROR":
		return slog.LevelError, nil
	case "DISABLE", "NONE", "OFF":
		return LevelDisable, nil
	}
	return 0, fmt.Errorf("unknown log level %q (want TRACE, DEBUG, INFO, WARN, ERROR or DISABLE)", s)
}

// LevelName returns the canonical spec name of a level.
func LevelName(l slog.Level) string {
	switch {
	case l >= LevelDisable:
		return "DISABLE"
	case l == LevelTrace:
		return "TRACE"
	}
	return l.String()
}

// Spec is a parsed log level specification.
type Spec struct {
	// Default is the level of scopes not listed in Scopes (set by "all").
	Default slog.Level
	// Scopes maps lower-case scope names to their level.
	Scopes map[string]slog.Level
}

// ParseSpec parses a comma-separated list of scope:LEVEL pairs such as
// "all:INFO,turn:DEBUG". Scope names are case-insensitive. An empty spec means
// "all:INFO". Parsing is strict: empty entries, missing colons, empty scopes,
// unknown levels and duplicate scopes are errors, because silently ignoring a
// typo would leave an operator wondering why their debug logs never appear.
func ParseSpec(spec string) (Spec, error) {
	s := Spec{Default: slog.LevelInfo, Scopes: map[string]slog.Level{}}
	if strings.TrimSpace(spec) == "" {
		return s, nil
	}
	seen := map[string]bool{}
	for tok := range strings.SplitSeq(spec, ",") {
		entry := strings.TrimSpace(tok)
		if entry == "" {
			return Spec{}, fmt.Errorf("invalid log spec %q: empty entry", spec)
		}
		scope, lvl, ok := strings.Cut(entry, ":")
		if !ok {
			return Spec{}, fmt.Errorf("invalid log spec entry %q: want scope:LEVEL", entry)
		}
		scope = strings.ToLower(strings.TrimSpace(scope))
		if scope == "" {
			return Spec{}, fmt.Errorf("invalid log spec entry %q: empty scope", entry)
		}
		level, err := ParseLevel(lvl)
		if err != nil {
			return Spec{}, fmt.Errorf("invalid log spec entry %q: %w", entry, err)
		}
		if seen[scope] {
			return Spec{}, fmt.Errorf("invalid log spec entry %q: duplicate scope %q", entry, scope)
		}
		seen[scope] = true
		if scope == AllScope {
			s.Default = level
		} else {
			s.Scopes[scope] = level
		}
	}
	return s, nil
}

// Level returns the level that applies to scope.
func (s Spec) Level(scope string) slog.Level {
	if l, ok := s.Scopes[strings.ToLower(scope)]; ok {
		return l
	}
	return s.Default
}

// String renders the spec in canonical form ("all" first, then sorted scopes),
// suitable for feeding back into ParseSpec.
func (s Spec) String() string {
	parts := []string{AllScope + ":" + LevelName(s.Default)}
	for _, scope := range slices.Sorted(maps.Keys(s.Scopes)) {
		parts = append(parts, scope+":"+LevelName(s.Scopes[scope]))
	}
	return strings.Join(parts, ",")
}

// Factory creates scoped loggers that share one output and one level spec. It
// implements pion's logging.LoggerFactory and is safe for concurrent use.
type Factory struct {
	base    slog.Handler
	limiter *Limiter // for Limited and LimitedFactory

	mu   sync.Mutex
	spec Spec
	// vars holds one LevelVar per scope ever requested. Loggers keep a pointer
	// to their scope's LevelVar, so SetLevels takes effect on existing loggers
	// immediately while the hot path stays a single atomic load.
	vars map[string]*slog.LevelVar
}

var _ pionlog.LoggerFactory = (*Factory)(nil)

// New returns a Factory writing to w in the given format ("text" or "json"),
// with levels set from spec (see ParseSpec).
func New(spec, format string, w io.Writer) (*Factory, error) {
	s, err := ParseSpec(spec)
	if err != nil {
		return nil, err
	}
	opts := &slog.HandlerOptions{
		// Per-scope filtering happens in scopeHandler; the base handler must
		// let everything through.
		Level:       LevelTrace,
		ReplaceAttr: replaceLevel,
	}
	var h slog.Handler
	switch strings.ToLower(format) {
	case FormatText:
		h = slog.NewTextHandler(w, opts)
	case FormatJSON:
		h = slog.NewJSONHandler(w, opts)
	default:
		return nil, fmt.Errorf("unknown log format %q (want %q or %q)", format, FormatText, FormatJSON)
	}
	return &Factory{base: h, spec: s, vars: map[string]*slog.LevelVar{},
		limiter: NewLimiter(DefaultLimitInterval, DefaultLimitBurst)}, nil
}

// replaceLevel prints LevelTrace as "TRACE" instead of slog's "DEBUG-4".
func replaceLevel(groups []string, a slog.Attr) slog.Attr {
	if len(groups) == 0 && a.Key == slog.LevelKey {
		if l, ok := a.Value.Any().(slog.Level); ok && l == LevelTrace {
			a.Value = slog.StringValue("TRACE")
		}
	}
	return a
}

// SetLevels atomically replaces the level spec; all existing and future
// loggers obey the new levels. On error the current levels are kept.
func (f *Factory) SetLevels(spec string) error {
	s, err := ParseSpec(spec)
	if err != nil {
		return err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.spec = s
	for scope, v := range f.vars {
		v.Set(s.Level(scope))
	}
	return nil
}

// Levels returns the current level spec in canonical form.
func (f *Factory) Levels() string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.spec.String()
}

// levelVar returns the shared LevelVar for scope, creating it if needed.
func (f *Factory) levelVar(scope string) *slog.LevelVar {
	key := strings.ToLower(scope)
	f.mu.Lock()
	defer f.mu.Unlock()
	v, ok := f.vars[key]
	if !ok {
		v = new(slog.LevelVar)
		v.Set(f.spec.Level(key))
		f.vars[key] = v
	}
	return v
}

// Slog returns a structured logger for scope that obeys the scope's level.
func (f *Factory) Slog(scope string) *slog.Logger {
	h := &scopeHandler{
		inner: f.base.WithAttrs([]slog.Attr{slog.String(ScopeKey, scope)}),
		level: f.levelVar(scope),
	}
	return slog.New(h)
}

// NewLogger returns a pion LeveledLogger for scope. It implements
// logging.LoggerFactory so the Factory can be handed to pion/turn directly.
func (f *Factory) NewLogger(scope string) pionlog.LeveledLogger {
	return &leveledLogger{l: f.Slog(scope)}
}

// scopeHandler gates records on a shared, live-updatable scope level.
type scopeHandler struct {
	inner slog.Handler
	level slog.Leveler
}

func (h *scopeHandler) Enabled(ctx context.Context, l slog.Level) bool {
	return l >= h.level.Level() && h.inner.Enabled(ctx, l)
}

func (h *scopeHandler) Handle(ctx context.Context, r slog.Record) error {
	return h.inner.Handle(ctx, r)
}

func (h *scopeHandler) WithAttrs(as []slog.Attr) slog.Handler {
	return &scopeHandler{inner: h.inner.WithAttrs(as), level: h.level}
}

func (h *scopeHandler) WithGroup(name string) slog.Handler {
	return &scopeHandler{inner: h.inner.WithGroup(name), level: h.level}
}

// leveledLogger adapts a *slog.Logger to pion's LeveledLogger; with a
// Limiter, its lines at INFO and above are rate-limited per format string.
type leveledLogger struct {
	l     *slog.Logger
	lim   *Limiter
	scope string
}

var _ pionlog.LeveledLogger = (*leveledLogger)(nil)

func (l *leveledLogger) enabled(level slog.Level) bool {
	return l.l.Enabled(context.Background(), level)
}

func (l *leveledLogger) log(level slog.Level, msg string) {
	l.logf(level, "%s", msg)
}

// logf checks the level and the limit before formatting, so disabled and
// dropped calls on the data path do not pay for fmt.Sprintf.
func (l *leveledLogger) logf(level slog.Level, format string, args ...any) {
	if !l.enabled(level) {
		return
	}
	key := format
	if format == "%s" && len(args) == 1 {
		key, _ = args[0].(string)
	}
	dropped, ok := l.lim.allow(level, l.scope+"\x00"+key)
	if !ok {
		return
	}
	msg := fmt.Sprintf(format, args...)
	if dropped > 0 {
		l.l.Log(context.Background(), level, msg, SuppressedKey, dropped)
		return
	}
	l.l.Log(context.Background(), level, msg)
}

func (l *leveledLogger) Trace(msg string)                  { l.log(LevelTrace, msg) }
func (l *leveledLogger) Tracef(format string, args ...any) { l.logf(LevelTrace, format, args...) }
func (l *leveledLogger) Debug(msg string)                  { l.log(slog.LevelDebug, msg) }
func (l *leveledLogger) Debugf(format string, args ...any) { l.logf(slog.LevelDebug, format, args...) }
func (l *leveledLogger) Info(msg string)                   { l.log(slog.LevelInfo, msg) }
func (l *leveledLogger) Infof(format string, args ...any)  { l.logf(slog.LevelInfo, format, args...) }
func (l *leveledLogger) Warn(msg string)                   { l.log(slog.LevelWarn, msg) }
func (l *leveledLogger) Warnf(format string, args ...any)  { l.logf(slog.LevelWarn, format, args...) }
func (l *leveledLogger) Error(msg string)                  { l.log(slog.LevelError, msg) }
func (l *leveledLogger) Errorf(format string, args ...any) { l.logf(slog.LevelError, format, args...) }
