package netns

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sync"
	"testing"

	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// The programs the tests run, for Binary.
const (
	Daemon   = "stunnerd-xdp" // ./cmd/stunnerd-xdp from this tree
	UDPEcho  = "udpecho"      // ./test/cmd/udpecho from this tree
	Turncat  = "turncat"      // STUNner v1.1.0's turncat, from test/tools
	Stunnerd = "stunnerd"     // STUNner v1.1.0's stunnerd, from test/tools
	// Stunnerd121 is STUNner v1.2.1's stunnerd (the current release), from test/tools/stunner121.
	Stunnerd121 = "stunnerd-v1.2.1"
	// Etcd and KubeAPIServer are etcd v3.6 and kube-apiserver v1.35.4 from test/kapi, a module of
	// their own (Kubernetes' server code stays out of this one); `make kube-bins` builds both.
	Etcd          = "etcd"
	KubeAPIServer = "kube-apiserver"
	// Kustomize renders a kustomization (test/deploy/render: kustomize stays in that module).
	Kustomize = "kustomize-render"
)

// binarySpec says where a program comes from: the environment variable that names a prebuilt binary
// instead, and the package built from this tree ("" for test/tools' STUNner builds). A package of
// a module under test/ names the module's directory (mod); such a program is pinned by that
// module's go.mod, so a build already in bin/ is used as it is.
type binarySpec struct{ env, pkg, mod string }

var binaries = map[string]binarySpec{
	Daemon:        {env: "STUNNERD_XDP", pkg: "./cmd/stunnerd-xdp"},
	UDPEcho:       {env: "UDPECHO", pkg: "./test/cmd/udpecho"},
	Turncat:       {env: "TURNCAT"},
	Stunnerd:      {env: "STUNNERD"},
	Stunnerd121:   {env: "STUNNERD_121"},
	Etcd:          {env: "ETCD", pkg: "./etcd", mod: "test/kapi"},
	KubeAPIServer: {env: "KUBE_APISERVER", pkg: "k8s.io/kubernetes/cmd/kube-apiserver", mod: "test/kapi"},
	Kustomize:     {env: "KUSTOMIZE_RENDER", pkg: "./render", mod: "test/deploy"},
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
	once, _ := built.LoadOrStore(name, sync.OnceValues(func() (string, error) { return build(name, spec) }))
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

func build(name string, spec binarySpec) (string, error) {
	bin := filepath.Join(RepoRoot(), "bin")
	path := filepath.Join(bin, name)
	if _, err := os.Stat(path); err == nil && (spec.pkg == "" || spec.mod != "" || testenv.InNetns()) {
		return path, nil
	}
	if spec.pkg == "" {
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
	cmd := exec.Command("go", "build", "-o", tmp.Name(), spec.pkg)
	if spec.mod != "" {
		// Stripped, as `make kube-bins` builds them: kube-apiserver is ~100 MB so.
		cmd = exec.Command("go", "build", "-trimpath", "-ldflags=-s -w", "-o", tmp.Name(), spec.pkg)
	}
	if err := runIn(cmd, spec.mod); err != nil {
		return "", err
	}
	return path, os.Rename(tmp.Name(), path)
}

func run(cmd *exec.Cmd) error { return runIn(cmd, "") }

// runIn runs cmd in dir, relative to the repository's root.
func runIn(cmd *exec.Cmd, dir string) error {
	cmd.Dir = filepath.Join(RepoRoot(), dir)
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("%s: %w\n%s", cmd, err, out)
	}
	return nil
}
