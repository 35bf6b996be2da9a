package loader

import (
	"testing"
	"time"

	"github.com/l7mp/stunnerd-xdp/internal/xdpfeatures"
)

// WithoutXDPFeatures makes the programs loaded until t ends see a kernel
// without xdp-features (before 6.3): dev_caps comes from the fallback, which
// reads every device again every 50 ms.
func WithoutXDPFeatures(t testing.TB) {
	dial, poll := dialXDPFeatures, fallbackPoll
	dialXDPFeatures = func() (*xdpfeatures.Client, error) { return nil, xdpfeatures.ErrUnsupported }
	fallbackPoll = 50 * time.Millisecond
	t.Cleanup(func() { dialXDPFeatures, fallbackPoll = dial, poll })
}
