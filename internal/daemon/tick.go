package daemon

import "time"

// tick calls f every interval until it returns true or the daemon stops.
func (d *Daemon) tick(every time.Duration, f func() bool) { tickUntil(d.stop, every, nil, f) }

// tickOr is tick that also calls f whenever wake fires.
func (d *Daemon) tickOr(every time.Duration, wake <-chan struct{}, f func() bool) {
	tickUntil(d.stop, every, wake, f)
}

// tickUntil calls f every interval and whenever wake fires, until f returns
// true or stop is closed.
func tickUntil(stop <-chan struct{}, every time.Duration, wake <-chan struct{}, f func() bool) {
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-stop:
			return
		case <-t.C:
		case <-wake:
		}
		if f() {
			return
		}
	}
}
