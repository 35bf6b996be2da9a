package daemon

import "time"

// tick calls f every interval until it returns true or the daemon stops.
func (d *Daemon) tick(every time.Duration, f func() bool) {
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-d.stop:
			return
		case <-t.C:
		}
		if f() {
			return
		}
	}
}
