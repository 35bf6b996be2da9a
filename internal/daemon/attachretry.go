package daemon

import (
	"time"

	"github.com/l7mp/stunnerd-xdp/internal/loader"
)

// xdpRetry re-attaches XDP where it is wanted but not attached: another
// daemon's program still holds the interface during a rolling update, or the
// interface came later, or was deleted and created again. It runs every
// interval and at once on a link event. Sessions are served from userspace
// meanwhile.
func (d *Daemon) xdpRetry(every time.Duration) {
	d.tickOr(every, d.linkEvents, func() bool {
		d.modeMu.Lock()
		defer d.modeMu.Unlock()
		if mode := d.wantMode(); mode != loader.ModeOff && len(d.sw.Missing()) > 0 {
			_, _ = d.sw.Enable(mode) // the switch logs what changed
			d.syncDestinations()
		}
		return false
	})
}
