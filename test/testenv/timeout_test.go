package testenv

import (
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"
)

// TestTimeoutScale: TEST_TIMEOUT_SCALE multiplies the deadlines, and a value that is not a
// number >= 1 stops the test binary instead of leaving this machine's deadlines in place. Each
// case runs in a child process, as the factor is read once.
func TestTimeoutScale(t *testing.T) {
	if os.Getenv("TESTENV_SCALE_CHILD") != "" {
		t.Logf("Timeout(2s) = %v", Timeout(2*time.Second))
		return
	}
	for _, c := range []struct{ scale, want string }{
		{"", "Timeout(2s) = 2s"},
		{"10", "Timeout(2s) = 20s"},
		{"2.5", "Timeout(2s) = 5s"},
		{"0.5", `TEST_TIMEOUT_SCALE="0.5": want a number >= 1`},
		{"ten", `TEST_TIMEOUT_SCALE="ten": want a number >= 1`},
	} {
		cmd := exec.Command(os.Args[0], "-test.run", "^TestTimeoutScale$", "-test.v", "-test.count=1")
		cmd.Env = append(os.Environ(), "TESTENV_SCALE_CHILD=1", TimeoutScaleEnv+"="+c.scale)
		out, _ := cmd.CombinedOutput()
		if !strings.Contains(string(out), c.want) {
			t.Errorf("%s=%q: want %q in\n%s", TimeoutScaleEnv, c.scale, c.want, out)
		}
	}
}
