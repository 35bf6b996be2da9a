package testenv

import (
	"fmt"
	"os"
	"strconv"
	"sync"
	"time"
)

// TimeoutScaleEnv names the factor every deadline of the tests' waits is multiplied by: 1 when
// unset; the kernel matrix (test/kernels) sets 10, as qemu's TCG runs a guest about ten times
// slower than this machine. A wait ends as soon as its condition holds, so a larger factor only
// makes a failing test take longer; it never loosens what a test asserts.
const TimeoutScaleEnv = "TEST_TIMEOUT_SCALE"

var timeoutScale = sync.OnceValue(func() float64 {
	s := os.Getenv(TimeoutScaleEnv)
	if s == "" {
		return 1
	}
	f, err := strconv.ParseFloat(s, 64)
	if err != nil || f < 1 {
		// A typo must not leave a slow guest with this machine's deadlines.
		panic(fmt.Sprintf("%s=%q: want a number >= 1", TimeoutScaleEnv, s))
	}
	return f
})

// Timeout is d scaled by TEST_TIMEOUT_SCALE: the deadline of a wait on a condition (a port
// bound, /ready answering, a child test's budget). Not for pacing or for a time a test measures.
func Timeout(d time.Duration) time.Duration {
	return time.Duration(float64(d) * timeoutScale())
}
