package netns

import (
	"context"
	"errors"
	"fmt"
	"time"

	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// ErrTimeout is what Eventually returns (wrapped, with the condition's last error) when the
// condition still failed at the deadline.
var ErrTimeout = errors.New("condition not met in time")

// abortError marks a condition's error as final.
type abortError struct{ error }

func (e abortError) Unwrap() error { return e.error }

// Abort makes Eventually give up at once and return err, for a condition that can no longer
// come true (the process it waits for has exited, say).
func Abort(err error) error { return abortError{err} }

// Eventually calls cond at once and then every interval until it returns nil (then Eventually
// returns nil), returns an error made with Abort (returned unwrapped), or timeout has passed:
// then the error wraps ErrTimeout and cond's last error. Tests wait on probes with it (a port
// bound, /ready answering, a map entry present), not on sleeps or log lines. timeout is scaled
// by TEST_TIMEOUT_SCALE (testenv.Timeout), for slow guests; interval is not.
func Eventually(timeout, interval time.Duration, cond func() error) error {
	timeout = testenv.Timeout(timeout)
	var last error
	err := wait.PollUntilContextTimeout(context.Background(), interval, timeout, true, func(context.Context) (bool, error) {
		last = cond()
		if a := (abortError{}); errors.As(last, &a) {
			return false, a
		}
		return last == nil, nil
	})
	var a abortError
	switch {
	case err == nil:
		return nil
	case errors.As(err, &a):
		return a.error
	case last == nil:
		return fmt.Errorf("%w (%v): %w", ErrTimeout, timeout, err)
	default:
		return fmt.Errorf("%w (%v): %w", ErrTimeout, timeout, last)
	}
}
