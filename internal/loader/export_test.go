package loader

import "time"

// SetSettle sets how long discovery waits before it attaches a device that
// appeared (clsact): the tests' devices need no seconds.
func SetSettle(t *TC, d time.Duration) {
	if t.settle > 0 {
		t.settle = d
	}
}

// ClsactHandleBase is the first of the handles the engines' filters take.
const ClsactHandleBase = clsactHandleBase
