package daemon

import "time"

// tick calls f every interval until it returns true or the daemon stops.
func (d *Daemon) tick(every time.Duration, f func() bool) {
	tickUntil(d.stop, every, nil, func(bool) bool { return f() })
}

// tickOr is tick that also calls f whenever wake fires, telling it which
// (woken).
func (d *Daemon) tickOr(every time.Duration, wake <-chan struct{}, f func(woken bool) bool) {
	tickUntil(d.stop, every, wake, f)
}

// tickUntil calls f every interval and whenever wake fires, until f returns
// true or stop is closed.
func tickUntil(stop <-chan struct{}, every time.Duration, wake <-chan struct{}, f func(woken bool) bool) {
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		woken := false
		select {
		case <-stop:
			return
		case <-t.C:
		case <-wake:
			woken = true
		}
		if f(woken) {
			return
		}
	}
}
