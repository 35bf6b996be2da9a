package daemon

import (
	"time"
)

// xdpRetry re-attaches XDP where the mode wants it but it is not attached
// (offload.Manager.Retry), every interval and at once on a link event.
// Sessions are served from userspace meanwhile.
func (d *Daemon) xdpRetry(every time.Duration) {
	d.tickOr(every, d.linkEvents, func() bool {
		d.xdp.Retry() // the manager logs what changed
		return false
	})
}
