package daemon

import (
	"time"
)

// xdpRetry re-attaches XDP where the mode wants it but it is not attached
// (offload.Manager.Retry) every interval, and on a link event
// (offload.Manager.LinkChanged): only a link event tries again an interface
// whose driver refused the mode, and neither loads again a program the
// kernel refused. Sessions are served from userspace meanwhile.
func (d *Daemon) xdpRetry(every time.Duration) {
	d.tickOr(every, d.linkEvents, func(linkEvent bool) bool {
		if linkEvent {
			d.xdp.LinkChanged()
		} else {
			d.xdp.Retry() // the manager logs what changed
		}
		return false
	})
}
