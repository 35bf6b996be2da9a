package logging

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	pionlog "github.com/pion/logging"

	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

func TestParseSpec(t *testing.T) {
	good := []struct {
		name, spec string
		def        slog.Level
		scopes     map[string]slog.Level
	}{
		{"empty", "", slog.LevelInfo, nil},
		{"blank", "   ", slog.LevelInfo, nil},
		{"all only", "all:DEBUG", slog.LevelDebug, nil},
		{"case insensitive", "ALL:debug,Turn:Trace", slog.LevelDebug, map[string]slog.Level{"turn": LevelTrace}},
		{"default stays info", "xdp:WARN", slog.LevelInfo, map[string]slog.Level{"xdp": slog.LevelWarn}},
		{"aliases", "all:none,a:off,b:warning,c:DISABLE,d:ERROR", LevelDisable,
			map[string]slog.Level{"a": LevelDisable, "b": slog.LevelWarn, "c": LevelDisable, "d": slog.LevelError}},
		{"whitespace", " all : INFO , turn : DEBUG ", slog.LevelInfo, map[string]slog.Level{"turn": slog.LevelDebug}},
		{"typical", "all:INFO,turn:DEBUG,xdp:WARN", slog.LevelInfo,
			map[string]slog.Level{"turn": slog.LevelDebug, "xdp": slog.LevelWarn}},
	}
	for _, tc := range good {
		t.Run(tc.name, func(t *testing.T) {
			s, err := ParseSpec(tc.spec)
			if err != nil {
				t.Fatalf("ParseSpec(%q): %v", tc.spec, err)
			}
			if s.Default != tc.def {
				t.Errorf("default = %v, want %v", s.Default, tc.def)
			}
			if len(s.Scopes) != len(tc.scopes) {
				t.Errorf("scopes = %v, want %v", s.Scopes, tc.scopes)
			}
			for k, v := range tc.scopes {
				if s.Scopes[k] != v {
					t.Errorf("scope %q = %v, want %v", k, s.Scopes[k], v)
				}
			}
			// The canonical form must parse back to the same spec.
			back, err := ParseSpec(s.String())
			if err != nil || back.String() != s.String() {
				t.Errorf("round trip %q -> %q, %v", s.String(), back.String(), err)
			}
		})
	}

	bad := []struct {
		name, spec string
		wantInErr  []string
	}{
		{"unknown level", "all:INFO,turn:LOUD", []string{`"turn:LOUD"`, "unknown log level"}},
		{"empty level", "turn:", []string{`"turn:"`, "unknown log level"}},
		{"extra colon", "turn:DEBUG:x", []string{`"turn:DEBUG:x"`}},
		{"empty scope", ":DEBUG", []string{`":DEBUG"`, "empty scope"}},
		{"blank scope", "  :DEBUG", []string{"empty scope"}},
		{"missing colon", "all:INFO,turn", []string{`"turn"`, "scope:LEVEL"}},
		{"duplicate scope", "turn:DEBUG,xdp:INFO,turn:INFO", []string{`"turn:INFO"`, "duplicate scope"}},
		{"duplicate scope case", "turn:DEBUG,TURN:INFO", []string{"duplicate scope"}},
		{"duplicate all", "all:DEBUG,all:INFO", []string{"duplicate scope"}},
		{"empty entry", "all:INFO,,turn:DEBUG", []string{"empty entry"}},
		{"trailing comma", "all:INFO,", []string{"empty entry"}},
	}
	for _, tc := range bad {
		t.Run("bad/"+tc.name, func(t *testing.T) {
			_, err := ParseSpec(tc.spec)
			if err == nil {
				t.Fatalf("ParseSpec(%q) succeeded, want error", tc.spec)
			}
			for _, w := range tc.wantInErr {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not mention %s", err, w)
				}
			}
		})
	}
}

func TestNew(t *testing.T) {
	for _, tc := range []struct {
		name, spec, format string
		wantErr            bool
	}{
		{"text", "", "text", false},
		{"json", "all:DEBUG", "json", false},
		{"format case", "", "JSON", false},
		{"bad format", "", "xml", true},
		{"empty format", "", "", true},
		{"bad spec", "all:LOUD", "text", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f, err := New(tc.spec, tc.format, &bytes.Buffer{})
			if (err != nil) != tc.wantErr {
				t.Fatalf("New(%q, %q) error = %v, wantErr %v", tc.spec, tc.format, err, tc.wantErr)
			}
			if err == nil && f == nil {
				t.Fatal("nil factory without error")
			}
		})
	}
}

// logAt calls the pion method matching level.
func logAt(l pionlog.LeveledLogger, level slog.Level, msg string) {
	switch level {
	case LevelTrace:
		l.Tracef("%s", msg)
	case slog.LevelDebug:
		l.Debug(msg)
	case slog.LevelInfo:
		l.Infof("%s", msg)
	case slog.LevelWarn:
		l.Warn(msg)
	case slog.LevelError:
		l.Errorf("%s", msg)
	}
}

func TestScopeFiltering(t *testing.T) {
	var buf bytes.Buffer
	f, err := New("all:WARN,turn:DEBUG,xdp:DISABLE,trc:TRACE", "json", &buf)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		scope string
		level slog.Level
		want  bool
	}{
		{"other", slog.LevelInfo, false},
		{"other", slog.LevelWarn, true},
		{"other", slog.LevelError, true},
		{"turn", LevelTrace, false},
		{"turn", slog.LevelDebug, true},
		{"TURN", slog.LevelDebug, true}, // scopes are case-insensitive
		{"xdp", slog.LevelError, false},
		{"trc", LevelTrace, true},
	} {
		t.Run(fmt.Sprintf("%s/%s", tc.scope, LevelName(tc.level)), func(t *testing.T) {
			buf.Reset()
			logAt(f.NewLogger(tc.scope), tc.level, "hello")
			if got := buf.Len() > 0; got != tc.want {
				t.Errorf("emitted = %v, want %v (output %q)", got, tc.want, buf.String())
			}
			buf.Reset()
			f.Slog(tc.scope).Log(t.Context(), tc.level, "hello")
			if got := buf.Len() > 0; got != tc.want {
				t.Errorf("slog emitted = %v, want %v (output %q)", got, tc.want, buf.String())
			}
		})
	}
}

func TestSetLevelsLive(t *testing.T) {
	var buf bytes.Buffer
	f, err := New("all:INFO", "text", &buf)
	if err != nil {
		t.Fatal(err)
	}
	// Loggers are created once, before any level change, to prove that
	// existing loggers follow SetLevels.
	turn, xdp := f.NewLogger("turn"), f.Slog("xdp")
	steps := []struct {
		name, spec       string
		wantErr          bool
		turnDebug, xdpOK bool // turn emits at DEBUG, xdp emits at INFO
	}{
		{"initial", "", false, false, true},
		{"debug all", "all:DEBUG", false, true, true},
		{"scoped", "all:DEBUG,turn:INFO,xdp:ERROR", false, false, false},
		{"invalid keeps previous", "all:DEBUG,turn:BOGUS", true, false, false},
		{"back to default", "all:INFO", false, false, true},
	}
	for _, st := range steps {
		t.Run(st.name, func(t *testing.T) {
			if st.spec != "" {
				if err := f.SetLevels(st.spec); (err != nil) != st.wantErr {
					t.Fatalf("SetLevels(%q) error = %v, wantErr %v", st.spec, err, st.wantErr)
				}
			}
			buf.Reset()
			turn.Debug("d")
			if got := buf.Len() > 0; got != st.turnDebug {
				t.Errorf("turn debug emitted = %v, want %v (levels %s)", got, st.turnDebug, f.Levels())
			}
			buf.Reset()
			xdp.Info("i")
			if got := buf.Len() > 0; got != st.xdpOK {
				t.Errorf("xdp info emitted = %v, want %v (levels %s)", got, st.xdpOK, f.Levels())
			}
		})
	}
}

func TestJSONOutput(t *testing.T) {
	var buf bytes.Buffer
	f, err := New("all:TRACE", "json", &buf)
	if err != nil {
		t.Fatal(err)
	}
	l := f.NewLogger("turn")
	for _, tc := range []struct {
		level slog.Level
		name  string
	}{
		{LevelTrace, "TRACE"},
		{slog.LevelDebug, "DEBUG"},
		{slog.LevelInfo, "INFO"},
		{slog.LevelWarn, "WARN"},
		{slog.LevelError, "ERROR"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			buf.Reset()
			logAt(l, tc.level, `msg with "quotes" and 100%`)
			var rec map[string]any
			if err := json.Unmarshal(buf.Bytes(), &rec); err != nil {
				t.Fatalf("invalid JSON %q: %v", buf.String(), err)
			}
			if _, err := time.Parse(time.RFC3339Nano, fmt.Sprint(rec["time"])); err != nil {
				t.Errorf("bad time %v: %v", rec["time"], err)
			}
			want := map[string]any{"level": tc.name, "scope": "turn", "msg": `msg with "quotes" and 100%`}
			for k, v := range want {
				if rec[k] != v {
					t.Errorf("%s = %v, want %v", k, rec[k], v)
				}
			}
			if strings.Count(buf.String(), "\n") != 1 {
				t.Errorf("want exactly one line, got %q", buf.String())
			}
		})
	}

	t.Run("slog attrs", func(t *testing.T) {
		buf.Reset()
		f.Slog("xdp").Info("attached", "iface", "eth0", "mode", "native")
		var rec map[string]any
		if err := json.Unmarshal(buf.Bytes(), &rec); err != nil {
			t.Fatalf("invalid JSON %q: %v", buf.String(), err)
		}
		for k, v := range map[string]any{"scope": "xdp", "msg": "attached", "iface": "eth0", "mode": "native", "level": "INFO"} {
			if rec[k] != v {
				t.Errorf("%s = %v, want %v", k, rec[k], v)
			}
		}
	})
}

func TestTextOutput(t *testing.T) {
	var buf bytes.Buffer
	f, err := New("all:TRACE", "text", &buf)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		log  func()
		want []string
	}{
		{"trace", func() { f.NewLogger("turn").Trace("pkt") }, []string{"level=TRACE", "scope=turn", "msg=pkt"}},
		{"slog trace", func() { f.Slog("xdp").Log(t.Context(), LevelTrace, "x", "iface", "eth0") },
			[]string{"level=TRACE", "scope=xdp", "iface=eth0"}},
		{"info", func() { f.NewLogger("turn").Infof("n=%d", 3) }, []string{"level=INFO", `msg="n=3"`}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			buf.Reset()
			tc.log()
			out := buf.String()
			for _, w := range tc.want {
				if !strings.Contains(out, w) {
					t.Errorf("output %q lacks %q", out, w)
				}
			}
			if strings.Contains(out, "DEBUG-4") {
				t.Errorf("TRACE rendered as slog default: %q", out)
			}
		})
	}
}

func TestConcurrent(t *testing.T) {
	var buf testenv.LockedBuffer
	f, err := New("all:INFO", "json", &buf)
	if err != nil {
		t.Fatal(err)
	}
	const workers, iters = 8, 200
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			scope := fmt.Sprintf("s%d", w%3)
			l, s := f.NewLogger(scope), f.Slog(scope)
			for i := range iters {
				l.Infof("pion %d", i)
				l.Debug("maybe")
				s.Warn("slog", "i", i)
			}
		})
	}
	wg.Go(func() {
		specs := []string{"all:DEBUG", "all:INFO,s1:ERROR", "all:DISABLE", "all:TRACE,s2:WARN"}
		for i := range iters {
			if err := f.SetLevels(specs[i%len(specs)]); err != nil {
				t.Error(err)
			}
			_ = f.Levels()
		}
	})
	wg.Wait()

	// Every line must be a complete JSON object: no interleaved writes.
	sc := bufio.NewScanner(strings.NewReader(buf.String()))
	for sc.Scan() {
		var rec map[string]any
		if err := json.Unmarshal(sc.Bytes(), &rec); err != nil {
			t.Fatalf("corrupt line %q: %v", sc.Text(), err)
		}
	}
}
