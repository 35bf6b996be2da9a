// Package deploy_test renders the project's kustomizations (deploy/daemonset,
// deploy/gateway, deploy/monitoring) the way kubectl apply -k does and checks
// the properties production depends on: kubectl is not needed, and every
// document must decode strictly into the Kubernetes API types, so a misspelt
// field fails here instead of being dropped by the API server. It is a module
// of its own so that kustomize stays out of the main module.
package deploy_test

import (
	"bufio"
	"debug/elf"
	"encoding/json"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"sigs.k8s.io/kustomize/api/krusty"
	"sigs.k8s.io/kustomize/kyaml/filesys"
	"sigs.k8s.io/yaml"
)

// daemonsetDir is the kustomization under test: the project's DaemonSet.
const daemonsetDir = "../../deploy/daemonset"

// manifests are the decoded objects of one rendering.
type manifests struct {
	namespaces      []corev1.Namespace
	serviceAccounts []corev1.ServiceAccount
	secrets         []corev1.Secret
	daemonSets      []appsv1.DaemonSet
	clusterRoles    []rbacv1.ClusterRole
	bindings        []rbacv1.ClusterRoleBinding
	dataplanes      []dataplane
}

// render runs kustomize on dir and decodes every resource strictly.
func render(t *testing.T, dir string) manifests {
	t.Helper()
	resMap, err := krusty.MakeKustomizer(krusty.MakeDefaultOptions()).Run(filesys.MakeFsOnDisk(), dir)
	if err != nil {
		t.Fatalf("kustomize %s: %v", dir, err)
	}
	var m manifests
	for _, r := range resMap.Resources() {
		doc, err := r.AsYAML()
		if err != nil {
			t.Fatal(err)
		}
		var target any
		switch r.GetKind() {
		case "Namespace":
			m.namespaces = append(m.namespaces, corev1.Namespace{})
			target = &m.namespaces[len(m.namespaces)-1]
		case "ServiceAccount":
			m.serviceAccounts = append(m.serviceAccounts, corev1.ServiceAccount{})
			target = &m.serviceAccounts[len(m.serviceAccounts)-1]
		case "Secret":
			m.secrets = append(m.secrets, corev1.Secret{})
			target = &m.secrets[len(m.secrets)-1]
		case "DaemonSet":
			m.daemonSets = append(m.daemonSets, appsv1.DaemonSet{})
			target = &m.daemonSets[len(m.daemonSets)-1]
		case "ClusterRole":
			m.clusterRoles = append(m.clusterRoles, rbacv1.ClusterRole{})
			target = &m.clusterRoles[len(m.clusterRoles)-1]
		case "ClusterRoleBinding":
			m.bindings = append(m.bindings, rbacv1.ClusterRoleBinding{})
			target = &m.bindings[len(m.bindings)-1]
		case "Dataplane":
			m.dataplanes = append(m.dataplanes, dataplane{})
			target = &m.dataplanes[len(m.dataplanes)-1]
		default:
			t.Fatalf("unexpected %s %s in the rendering", r.GetKind(), r.GetName())
		}
		if err := yaml.UnmarshalStrict(doc, target); err != nil {
			t.Fatalf("%s %s does not decode strictly: %v\n%s", r.GetKind(), r.GetName(), err, doc)
		}
	}
	return m
}

func one[T any](t *testing.T, kind string, objs []T) *T {
	t.Helper()
	if len(objs) != 1 {
		t.Fatalf("%d %s objects, want 1", len(objs), kind)
	}
	return &objs[0]
}

func container(t *testing.T, ds *appsv1.DaemonSet) *corev1.Container {
	t.Helper()
	return one(t, "container", ds.Spec.Template.Spec.Containers)
}

func TestDaemonSet(t *testing.T) {
	m := render(t, daemonsetDir)
	ds := one(t, "DaemonSet", m.daemonSets)
	pod := ds.Spec.Template.Spec
	c := container(t, ds)

	t.Run("namespace", func(t *testing.T) {
		ns := one(t, "Namespace", m.namespaces)
		if ns.Name != "stunner" || ds.Namespace != "stunner" {
			t.Fatalf("namespace %q, DaemonSet in %q, want stunner", ns.Name, ds.Namespace)
		}
		if got := ns.Labels["pod-security.kubernetes.io/enforce"]; got != "privileged" {
			t.Errorf("pod security enforce %q: hostNetwork and BPF capabilities need privileged", got)
		}
	})
	t.Run("host network", func(t *testing.T) {
		if !pod.HostNetwork {
			t.Error("hostNetwork is off")
		}
		if pod.DNSPolicy != corev1.DNSClusterFirstWithHostNet {
			t.Errorf("dnsPolicy %q, want ClusterFirstWithHostNet", pod.DNSPolicy)
		}
		if got := pod.NodeSelector["stunner.l7mp.io/media-node"]; got != "true" || len(pod.NodeSelector) != 1 {
			t.Errorf("nodeSelector %v, want only stunner.l7mp.io/media-node=true", pod.NodeSelector)
		}
		if pod.ServiceAccountName != one(t, "ServiceAccount", m.serviceAccounts).Name {
			t.Errorf("serviceAccountName %q is not the ServiceAccount", pod.ServiceAccountName)
		}
	})
	t.Run("capabilities, not privileged", func(t *testing.T) {
		sc := c.SecurityContext
		if sc == nil || sc.Capabilities == nil {
			t.Fatal("no securityContext capabilities")
		}
		if sc.Privileged != nil && *sc.Privileged {
			t.Error("privileged by default")
		}
		// The smallest set on 5.11+: test/e2e TestCapabilities runs the
		// binary with each of them dropped.
		add := slices.Sorted(slices.Values(sc.Capabilities.Add))
		if want := []corev1.Capability{"BPF", "NET_ADMIN", "PERFMON"}; !slices.Equal(add, want) {
			t.Errorf("capabilities added %v, want %v", add, want)
		}
		if !slices.Equal(sc.Capabilities.Drop, []corev1.Capability{"ALL"}) {
			t.Errorf("capabilities dropped %v, want [ALL]", sc.Capabilities.Drop)
		}
		if sc.RunAsUser == nil || *sc.RunAsUser != 0 {
			t.Error("not run as root: capabilities only reach a root process")
		}
		if sc.SeccompProfile == nil || sc.SeccompProfile.Type != corev1.SeccompProfileTypeRuntimeDefault {
			t.Errorf("seccompProfile %+v, want RuntimeDefault", sc.SeccompProfile)
		}
		if sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation {
			t.Error("privilege escalation allowed")
		}
		if sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem {
			t.Error("root filesystem writable")
		}
	})
	t.Run("credentials from a Secret", func(t *testing.T) {
		password := stunnerConf(t, m).Auth.Credentials["password"]
		for _, a := range c.Args {
			if strings.Contains(a, "turn://") || strings.Contains(a, password) || strings.HasPrefix(a, "--auth") {
				t.Errorf("credentials on the command line: %q", a)
			}
		}
		for _, e := range c.Env {
			if strings.Contains(e.Value, password) {
				t.Errorf("credentials in the environment: %s", e.Name)
			}
		}
		v := slices.IndexFunc(pod.Volumes, func(v corev1.Volume) bool { return v.Name == "config" })
		if v < 0 || pod.Volumes[v].Secret == nil || pod.Volumes[v].Secret.SecretName != one(t, "Secret", m.secrets).Name {
			t.Fatalf("the config volume is not the Secret: %+v", pod.Volumes)
		}
		if mode := pod.Volumes[v].Secret.DefaultMode; mode == nil || *mode&0o077 != 0 {
			t.Errorf("the config's file mode %v lets others read it", mode)
		}
	})
	t.Run("node name and address from the downward API", func(t *testing.T) {
		for name, path := range map[string]string{"NODE_NAME": "spec.nodeName", "STUNNER_ADDR": "status.podIP"} {
			i := slices.IndexFunc(c.Env, func(e corev1.EnvVar) bool { return e.Name == name })
			if i < 0 {
				t.Errorf("no %s in the environment", name)
				continue
			}
			if e := c.Env[i]; e.ValueFrom == nil || e.ValueFrom.FieldRef == nil || e.ValueFrom.FieldRef.FieldPath != path {
				t.Errorf("%s is not from fieldRef %s: %+v", name, path, e)
			}
		}
		if !slices.Contains(c.Args, "--node-name=$(NODE_NAME)") {
			t.Errorf("args %v do not pass --node-name=$(NODE_NAME)", c.Args)
		}
		if !slices.Contains(c.Args, "--log-format=json") {
			t.Errorf("args %v do not log JSON", c.Args)
		}
	})
	t.Run("probes", func(t *testing.T) {
		// Exec probes over the pod's own health socket: during a surge the
		// node's :8086 belongs to whichever pod bound it first.
		sock := flagValue(c.Args, "--health-socket")
		if sock == "" {
			t.Fatalf("args %v have no --health-socket", c.Args)
		}
		if !slices.ContainsFunc(c.VolumeMounts, func(vm corev1.VolumeMount) bool { return vm.MountPath == filepath.Dir(sock) }) {
			t.Errorf("--health-socket %s is not on a volume (the root filesystem is read-only)", sock)
		}
		for name, p := range map[string]*corev1.Probe{"live": c.LivenessProbe, "ready": c.ReadinessProbe} {
			if p == nil || p.Exec == nil {
				t.Errorf("no exec probe for %s", name)
				continue
			}
			want := []string{entrypoint(t), "probe", "--health-socket=" + sock, name}
			if !slices.Equal(p.Exec.Command, want) {
				t.Errorf("%s probe runs %q, want %q", name, p.Exec.Command, want)
			}
		}
	})
	t.Run("prometheus annotations", func(t *testing.T) {
		want := map[string]string{"prometheus.io/scrape": "true", "prometheus.io/port": "8080", "prometheus.io/path": "/metrics"}
		for k, v := range want {
			if got := ds.Spec.Template.Annotations[k]; got != v {
				t.Errorf("annotation %s=%q, want %q", k, got, v)
			}
		}
	})
	t.Run("rollout and shutdown", func(t *testing.T) {
		if g := pod.TerminationGracePeriodSeconds; g == nil || *g != 3600 {
			t.Errorf("terminationGracePeriodSeconds %v, want 3600", g)
		}
		u := ds.Spec.UpdateStrategy
		if u.Type != appsv1.RollingUpdateDaemonSetStrategyType || u.RollingUpdate == nil {
			t.Fatalf("update strategy %+v, want RollingUpdate", u)
		}
		// Never a node without a server: the new pod starts beside the old
		// one (test/e2e TestRollingUpdateHandover runs that overlap).
		if s := u.RollingUpdate.MaxSurge; s == nil || s.IntValue() != 1 {
			t.Errorf("maxSurge %v, want 1", s)
		}
		if mu := u.RollingUpdate.MaxUnavailable; mu == nil || mu.IntValue() != 0 {
			t.Errorf("maxUnavailable %v, want 0", mu)
		}
		// Declared ports of a hostNetwork pod are host ports: the scheduler
		// would keep the surge pod Pending on them.
		for _, c := range pod.Containers {
			if len(c.Ports) != 0 {
				t.Errorf("container %s declares ports %v: a surge pod could not schedule", c.Name, c.Ports)
			}
		}
	})
	t.Run("bpffs: the project's directory only", func(t *testing.T) {
		// The handover directory is the mount of the node's
		// /sys/fs/bpf/stunnerd-xdp, made by the kubelet when missing, and
		// nothing else of the node's bpffs is mounted.
		dir := flagValue(c.Args, "--steering-dir")
		vm := slices.IndexFunc(c.VolumeMounts, func(vm corev1.VolumeMount) bool { return vm.MountPath == dir })
		if dir == "" || vm < 0 {
			t.Fatalf("--steering-dir %q is not a volume mount", dir)
		}
		if c.VolumeMounts[vm].ReadOnly {
			t.Error("the bpffs mount is read-only: the steering maps cannot be pinned")
		}
		if strings.HasPrefix(dir, "/sys/") {
			t.Errorf("--steering-dir %s: the container's /sys is a read-only sysfs, no mount point can be made there", dir)
		}
		v := slices.IndexFunc(pod.Volumes, func(v corev1.Volume) bool { return v.Name == c.VolumeMounts[vm].Name })
		hp := pod.Volumes[v].HostPath
		if hp == nil || hp.Path != "/sys/fs/bpf/stunnerd-xdp" || hp.Type == nil || *hp.Type != corev1.HostPathDirectoryOrCreate {
			t.Errorf("the handover volume %+v, want hostPath /sys/fs/bpf/stunnerd-xdp, DirectoryOrCreate", pod.Volumes[v])
		}
		for _, v := range pod.Volumes {
			if v.HostPath != nil && (v.HostPath.Path == "/sys/fs/bpf" || v.HostPath.Path == "/sys/fs/bpf/" || v.HostPath.Path == "/sys") {
				t.Errorf("volume %s mounts the whole %s", v.Name, v.HostPath.Path)
			}
		}
	})
	t.Run("volumes", func(t *testing.T) {
		i := slices.Index(c.Args, "-c")
		if i < 0 || i+1 >= len(c.Args) {
			t.Fatalf("args %v have no -c FILE", c.Args)
		}
		file := c.Args[i+1]
		if !slices.ContainsFunc(c.VolumeMounts, func(vm corev1.VolumeMount) bool {
			return vm.Name == "config" && filepath.Dir(file) == vm.MountPath
		}) {
			t.Errorf("-c %s is not in the config volume's mount", file)
		}
		if _, ok := one(t, "Secret", m.secrets).StringData[filepath.Base(file)]; !ok {
			t.Errorf("the config Secret has no key %s", filepath.Base(file))
		}
	})
	t.Run("image", func(t *testing.T) {
		if c.Image != "ghcr.io/l7mp/stunnerd-xdp:latest" {
			t.Errorf("image %q", c.Image)
		}
		if c.Resources.Requests.Cpu().IsZero() || c.Resources.Limits.Memory().IsZero() {
			t.Errorf("resources %+v: want a CPU request and a memory limit", c.Resources)
		}
	})
}

func TestRBAC(t *testing.T) {
	m := render(t, daemonsetDir)
	role := one(t, "ClusterRole", m.clusterRoles)
	if len(role.Rules) != 2 {
		t.Fatalf("%d rules, want nodes and servicecidrs: %+v", len(role.Rules), role.Rules)
	}
	for i, want := range []struct {
		group, resource string
		verbs           []string
	}{{"", "nodes", []string{"get", "list", "watch"}}, {"networking.k8s.io", "servicecidrs", []string{"list", "watch"}}} {
		rule := role.Rules[i]
		if !slices.Equal(rule.APIGroups, []string{want.group}) || !slices.Equal(rule.Resources, []string{want.resource}) {
			t.Errorf("rule on %v/%v, want %q/%s only", rule.APIGroups, rule.Resources, want.group, want.resource)
		}
		if verbs := slices.Sorted(slices.Values(rule.Verbs)); !slices.Equal(verbs, want.verbs) {
			t.Errorf("%s verbs %v, want exactly %v (nothing writes)", want.resource, verbs, want.verbs)
		}
		if len(rule.ResourceNames) != 0 || len(rule.NonResourceURLs) != 0 {
			t.Errorf("unexpected resourceNames or nonResourceURLs: %+v", rule)
		}
	}
	b := one(t, "ClusterRoleBinding", m.bindings)
	sa := one(t, "ServiceAccount", m.serviceAccounts)
	if b.RoleRef.Kind != "ClusterRole" || b.RoleRef.Name != role.Name {
		t.Errorf("binding refers to %+v, want ClusterRole %s", b.RoleRef, role.Name)
	}
	s := one(t, "subject", b.Subjects)
	if s.Kind != "ServiceAccount" || s.Name != sa.Name || s.Namespace != sa.Namespace {
		t.Errorf("binding subject %+v, want ServiceAccount %s/%s", s, sa.Namespace, sa.Name)
	}
}

// stunnerConfig holds the fields of STUNner's v1 dataplane configuration
// (github.com/l7mp/stunner pkg/apis/v1 at v1.1.0, the JSON tags copied) that
// the example uses; strict decoding makes a misspelt key an error.
type stunnerConfig struct {
	Version string `json:"version"`
	Admin   struct {
		Name                string  `json:"name,omitempty"`
		LogLevel            string  `json:"loglevel,omitempty"`
		MetricsEndpoint     string  `json:"metrics_endpoint,omitempty"`
		HealthCheckEndpoint *string `json:"healthcheck_endpoint,omitempty"`
	} `json:"admin"`
	Auth struct {
		Type        string            `json:"type,omitempty"`
		Realm       string            `json:"realm,omitempty"`
		Credentials map[string]string `json:"credentials"`
	} `json:"auth"`
	Listeners []stunnerListener `json:"listeners"`
	Clusters  []stunnerCluster  `json:"clusters"`
}

type stunnerListener struct {
	Name       string   `json:"name,omitempty"`
	Protocol   string   `json:"protocol,omitempty"`
	PublicAddr string   `json:"public_address,omitempty"`
	PublicPort int      `json:"public_port,omitempty"`
	Addr       string   `json:"address,omitempty"`
	Port       int      `json:"port,omitempty"`
	Routes     []string `json:"routes,omitempty"`
}

type stunnerCluster struct {
	Name      string   `json:"name"`
	Type      string   `json:"type,omitempty"`
	Protocol  string   `json:"protocol,omitempty"`
	Endpoints []string `json:"endpoints,omitempty"`
}

// stunnerConf decodes the shipped stunnerd.conf strictly, with $STUNNER_ADDR
// expanded.
func stunnerConf(t *testing.T, m manifests) stunnerConfig {
	t.Helper()
	sec := one(t, "Secret", m.secrets)
	raw, ok := sec.StringData["stunnerd.conf"]
	if !ok {
		t.Fatalf("Secret %s has no stunnerd.conf", sec.Name)
	}
	// STUNner expands $VARIABLES from the environment before parsing.
	expanded := os.Expand(raw, func(v string) string {
		if v == "STUNNER_ADDR" {
			return "192.0.2.10"
		}
		t.Errorf("stunnerd.conf uses $%s, which the DaemonSet does not set", v)
		return ""
	})
	var conf stunnerConfig
	if err := yaml.UnmarshalStrict([]byte(expanded), &conf); err != nil {
		t.Fatalf("stunnerd.conf: %v", err)
	}
	return conf
}

func TestStunnerConfig(t *testing.T) {
	conf := stunnerConf(t, render(t, daemonsetDir))
	if conf.Version != "v1" {
		t.Errorf("version %q, want v1", conf.Version)
	}
	if conf.Auth.Type != "static" || conf.Auth.Credentials["username"] == "" || conf.Auth.Credentials["password"] == "" {
		t.Errorf("auth %+v: want static with username and password", conf.Auth)
	}
	if len(conf.Listeners) != 1 {
		t.Fatalf("%d listeners, want 1", len(conf.Listeners))
	}
	l := conf.Listeners[0]
	if l.Protocol != "TURN-UDP" || l.Port != 3478 || l.Addr != "192.0.2.10" {
		t.Errorf("listener %+v: want TURN-UDP on $STUNNER_ADDR:3478", l)
	}
	for _, r := range l.Routes {
		if !slices.ContainsFunc(conf.Clusters, func(c stunnerCluster) bool {
			return c.Name == r && c.Type == "STATIC" && len(c.Endpoints) > 0
		}) {
			t.Errorf("route %q names no STATIC cluster with endpoints", r)
		}
	}
	// The endpoints the config asks for are where the DaemonSet probes and
	// Prometheus scrapes.
	for what, endpoint := range map[string]string{"metrics": conf.Admin.MetricsEndpoint, "health": deref(conf.Admin.HealthCheckEndpoint)} {
		u, err := url.Parse(endpoint)
		if err != nil {
			t.Errorf("%s endpoint %q: %v", what, endpoint, err)
			continue
		}
		want := map[string]string{"metrics": "8080", "health": "8086"}[what]
		if u.Port() != want {
			t.Errorf("%s endpoint %q is not on port %s", what, endpoint, want)
		}
	}
}

func deref(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}

func TestPrivilegedComponent(t *testing.T) {
	overlay := t.TempDir()
	writeKustomization(t, overlay, fmt.Sprintf("resources:\n  - %s\ncomponents:\n  - %s\n",
		relPath(t, overlay, daemonsetDir), relPath(t, overlay, filepath.Join(daemonsetDir, "components", "privileged"))))
	m := render(t, overlay)
	ds := one(t, "DaemonSet", m.daemonSets)
	sc := container(t, ds).SecurityContext
	if sc == nil || sc.Privileged == nil || !*sc.Privileged {
		t.Fatalf("securityContext %+v: want privileged", sc)
	}
	if sc.AllowPrivilegeEscalation != nil && !*sc.AllowPrivilegeEscalation {
		t.Error("allowPrivilegeEscalation: false with privileged: true is refused by the API server")
	}
}

// TestDockerfile checks the stages and runs the Dockerfile's own build
// command: docker cannot run here, but the command that produces the image's
// only file can, and its output must be a static binary for distroless/static.
func TestDockerfile(t *testing.T) {
	f, err := os.Open("../../Dockerfile")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var froms []string
	var build string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		switch {
		case strings.HasPrefix(line, "FROM "):
			froms = append(froms, strings.TrimPrefix(line, "FROM "))
		case strings.HasPrefix(line, "RUN ") && strings.Contains(line, " go build "):
			build = strings.TrimPrefix(line, "RUN ")
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	if len(froms) != 2 || !strings.HasPrefix(froms[0], "golang:1.26 ") ||
		!strings.HasPrefix(froms[1], "gcr.io/distroless/static") {
		t.Fatalf("stages %q: want golang:1.26 then gcr.io/distroless/static", froms)
	}
	if build == "" {
		t.Fatal("no RUN ... go build line")
	}
	for _, want := range []string{"CGO_ENABLED=0", "-trimpath", "./cmd/stunnerd-xdp"} {
		if !strings.Contains(build, want) {
			t.Errorf("build command %q lacks %s", build, want)
		}
	}
	if testing.Short() {
		t.Skip("-short: not building the binary")
	}

	// Run the same command: leading VAR=value words are the environment,
	// -o goes to a temporary file, build args come from the host.
	out := filepath.Join(t.TempDir(), "stunnerd-xdp")
	words := strings.Fields(os.Expand(build, func(v string) string {
		if v == "TARGETARCH" {
			return runtime.GOARCH
		}
		t.Fatalf("unknown build arg $%s", v)
		return ""
	}))
	env := os.Environ()
	for len(words) > 0 && strings.Contains(words[0], "=") {
		env = append(env, words[0])
		words = words[1:]
	}
	if len(words) < 2 || words[0] != "go" {
		t.Fatalf("build command %q does not run go", build)
	}
	if i := slices.Index(words, "-o"); i >= 0 && i+1 < len(words) {
		words[i+1] = out
	} else {
		t.Fatalf("build command %q has no -o", build)
	}
	cmd := exec.Command(words[0], words[1:]...)
	cmd.Dir = "../.."
	cmd.Env = env
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("%v: %v\n%s", cmd.Args, err, b)
	}

	bin, err := elf.Open(out)
	if err != nil {
		t.Fatal(err)
	}
	defer bin.Close()
	for _, p := range bin.Progs {
		if p.Type == elf.PT_INTERP {
			t.Error("the binary has an ELF interpreter: it is dynamically linked")
		}
	}
	if libs, err := bin.ImportedLibraries(); err != nil || len(libs) != 0 {
		t.Errorf("the binary needs shared libraries %v (%v)", libs, err)
	}
}

// flagValue returns the value of a --name=value argument.
func flagValue(args []string, name string) string {
	for _, a := range args {
		if v, ok := strings.CutPrefix(a, name+"="); ok {
			return v
		}
	}
	return ""
}

// entrypoint is the binary the Dockerfile's image runs.
func entrypoint(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile("../../Dockerfile")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, "ENTRYPOINT "); ok {
			var cmd []string
			if err := json.Unmarshal([]byte(rest), &cmd); err != nil || len(cmd) == 0 {
				t.Fatalf("ENTRYPOINT %s: %v", rest, err)
			}
			return cmd[0]
		}
	}
	t.Fatal("Dockerfile has no ENTRYPOINT")
	return ""
}
