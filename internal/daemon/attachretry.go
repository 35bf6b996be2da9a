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
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-d.stop:
			return
		case <-t.C:
			d.xdp.Retry() // the manager logs what changed
		case <-d.linkEvents:
			d.xdp.LinkChanged()
		}
	}
}
