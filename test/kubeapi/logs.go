package kubeapi

import (
	"log/slog"
	"strings"
	"testing"

	"k8s.io/klog/v2"

	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// ClientLogs routes client-go's logs (klog) in this process to a buffer until
// the test ends, as the daemon routes them to its own log: an informer whose
// list or watch the API server refuses only logs it and retries, so RBAC
// that lacks a verb shows there (Refused) before anything fails.
func ClientLogs(t testing.TB) *testenv.LockedBuffer {
	logs := &testenv.LockedBuffer{}
	klog.SetSlogLogger(slog.New(slog.NewTextHandler(logs, nil)))
	t.Cleanup(klog.ClearLogger)
	return logs
}

// Refused returns the lines of a log that report a request the API server
// refused for lack of permission (HTTP 403, "... is forbidden: User ...
// cannot watch resource ...").
func Refused(log string) []string {
	var out []string
	for line := range strings.Lines(log) {
		if strings.Contains(line, "forbidden") {
			out = append(out, strings.TrimSpace(line))
		}
	}
	return out
}
