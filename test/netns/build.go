package netns

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sync"
	"testing"

	"github.com/l7mp/stunnerd-xdp/internal/testenv"
)

// The programs the tests run, for Binary.
const (
	Daemon   = "stunnerd-xdp" // ./cmd/stunnerd-xdp from this tree
	UDPEcho  = "udpecho"      // ./test/cmd/udpecho from this tree
	Turncat  = "turncat"      // STUNner v1.1.0's turncat, from test/tools
	Stunnerd = "stunnerd"     // STUNner v1.1.0's stunnerd, from test/tools
	// Stunnerd121 is STUNner v1.2.1's stunnerd (the current release), from test/tools/stunner121.
	Stunnerd121 = "stunnerd-v1.2.1"
)

// binaries says where each program comes from: the environment variable that names a prebuilt
// binary instead, and the package built from this tree ("" for test/tools' STUNner builds).
var binaries = map[string]struct{ env, pkg string }{
	Daemon:      {"STUNNERD_XDP", "./cmd/stunnerd-xdp"},
	UDPEcho:     {"UDPECHO", "./test/cmd/udpecho"},
	Turncat:     {"TURNCAT", ""},
	Stunnerd:    {"STUNNERD", ""},
	Stunnerd121: {"STUNNERD_121", ""},
}

var built sync.Map // name -> func() (string, error), built once per process

// Binary returns the path of one of the programs above, building it at most once per process:
// the variable's binary if it is set; else this tree's build in bin/ (go build, so the tests run
// the code they sit next to); STUNner's builds in bin/ as `make tools` makes them, running
// test/tools/build.sh when they are missing. A test re-executed in a namespace
// (testenv.RunInNetns) uses what its parent built.
func Binary(name string) (string, error) {
	spec, ok := binaries[name]
	if !ok {
		return "", fmt.Errorf("no such test binary %q", name)
	}
	if p := os.Getenv(spec.env); p != "" {
		return p, nil
	}
	once, _ := built.LoadOrStore(name, sync.OnceValues(func() (string, error) { return build(name, spec.pkg) }))
	return once.(func() (string, error))()
}

// RequireBinary is Binary that fails the test when the program cannot be had.
func RequireBinary(t testing.TB, name string) string {
	t.Helper()
	p, err := Binary(name)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// RepoRoot is the root of this repository's checkout.
func RepoRoot() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(file), "..", "..")
}

func build(name, pkg string) (string, error) {
	bin := filepath.Join(RepoRoot(), "bin")
	path := filepath.Join(bin, name)
	if _, err := os.Stat(path); err == nil && (pkg == "" || testenv.InNetns()) {
		return path, nil
	}
	if pkg == "" {
		return path, run(exec.Command(filepath.Join(RepoRoot(), "test", "tools", "build.sh"), bin))
	}
	if err := os.MkdirAll(bin, 0o755); err != nil {
		return "", err
	}
	// Built beside the target and renamed over it: the test binaries of other packages may run
	// or build it at the same time.
	tmp, err := os.CreateTemp(bin, "."+name+"-*")
	if err != nil {
		return "", err
	}
	tmp.Close()
	defer os.Remove(tmp.Name())
	if err := run(exec.Command("go", "build", "-o", tmp.Name(), pkg)); err != nil {
		return "", err
	}
	return path, os.Rename(tmp.Name(), path)
}

func run(cmd *exec.Cmd) error {
	cmd.Dir = RepoRoot()
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("%s: %w\n%s", cmd, err, out)
	}
	return nil
}
