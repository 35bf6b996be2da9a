package daemon

import (
	"fmt"
	"net"
	"net/http"
	"os"
)

// ServeUnix serves the health endpoints on a unix socket: it answers for this
// process only, which is what a probe needs while two daemons share the node's
// network namespace (`stunnerd-xdp probe` is its client).
func (e *Endpoints) ServeUnix(path string, h http.Handler) error {
	if path == "" {
		return nil
	}
	if fi, err := os.Lstat(path); err == nil && fi.Mode()&os.ModeSocket != 0 {
		_ = os.Remove(path) // left by a daemon that was killed
	}
	ln, err := net.Listen("unix", path)
	if err != nil {
		return fmt.Errorf("health socket: %w", err)
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	e.add(ln, h)
	e.log.Info("health socket listening", "path", path)
	return nil
}
