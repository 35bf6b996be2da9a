package deploy_test

import (
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	psapi "k8s.io/pod-security-admission/api"
	"k8s.io/pod-security-admission/policy"
	"sigs.k8s.io/yaml"
)

// gatewayExampleDir renders two Gateways' DaemonSets (deploy/gateway), the
// shared namespace and RBAC (deploy/common) and the Dataplane that leaves the
// Gateways' pods to the DaemonSets.
const gatewayExampleDir = "../../deploy/gateway/example"

// The config discovery service of the operator the stunner/stunner chart
// installs, and the bpffs directory every daemon of a node shares.
const (
	cdsOrigin   = "http://stunner-config-discovery.stunner-system.svc:13478"
	steeringDir = "/bpf/stunnerd-xdp"
)

// gatewayPod is one Gateway's DaemonSet, with what its arguments say.
type gatewayPod struct {
	ds                       *appsv1.DaemonSet
	c                        *corev1.Container
	namespace, name          string // the Gateway, from the pod's labels
	metricsPort, healthPort  int
	healthSocket, configFrom string
}

func gatewayPods(t *testing.T, m manifests) []gatewayPod {
	t.Helper()
	var pods []gatewayPod
	for i := range m.daemonSets {
		ds := &m.daemonSets[i]
		p := gatewayPod{ds: ds, c: container(t, ds),
			namespace: ds.Spec.Template.Labels["stunner.l7mp.io/related-gateway-namespace"],
			name:      ds.Spec.Template.Labels["stunner.l7mp.io/related-gateway-name"]}
		p.metricsPort = addrPort(t, ds.Name, "--metrics-addr", flagValue(p.c.Args, "--metrics-addr"))
		p.healthPort = addrPort(t, ds.Name, "--health-addr", flagValue(p.c.Args, "--health-addr"))
		p.healthSocket = flagValue(p.c.Args, "--health-socket")
		p.configFrom = argAfter(p.c.Args, "-c")
		pods = append(pods, p)
	}
	return pods
}

// TestGatewayDaemonSets renders the two-Gateway example and checks that both
// Gateways' daemons fit on one hostNetwork node, each fed by the config
// discovery service for its own Gateway.
func TestGatewayDaemonSets(t *testing.T) {
	m := render(t, gatewayExampleDir)
	pods := gatewayPods(t, m)
	if len(pods) != 2 {
		t.Fatalf("%d DaemonSets, want one per Gateway of the example (2)", len(pods))
	}
	if got := []string{pods[0].name, pods[1].name}; !slices.Equal(got, []string{"udp-gateway", "tcp-gateway"}) {
		t.Errorf("the DaemonSets serve Gateways %q, want udp-gateway and tcp-gateway", got)
	}

	t.Run("placeholders replaced", func(t *testing.T) {
		for _, p := range pods {
			b, err := yaml.Marshal(p.ds)
			if err != nil {
				t.Fatal(err)
			}
			for _, ph := range []string{"GATEWAY", "NAMESPACE", "METRICS_PORT", "HEALTH_PORT"} {
				if strings.Contains(string(b), ph) {
					t.Errorf("DaemonSet %s still holds the placeholder %s", p.ds.Name, ph)
				}
			}
		}
	})
	t.Run("one Gateway each, from the config discovery service", func(t *testing.T) {
		for _, p := range pods {
			if p.namespace == "" || p.name == "" {
				t.Fatalf("DaemonSet %s: no related-gateway labels on its pods", p.ds.Name)
			}
			if p.ds.Name != "stunnerd-xdp-"+p.name || p.ds.Namespace != p.namespace {
				t.Errorf("DaemonSet %s/%s, want %s/stunnerd-xdp-%s: in the Gateway's namespace, where its Service selects pods",
					p.ds.Namespace, p.ds.Name, p.namespace, p.name)
			}
			if p.configFrom != cdsOrigin {
				t.Errorf("%s: -c %q, want the config discovery service %s", p.ds.Name, p.configFrom, cdsOrigin)
			}
			if want := p.namespace + "/" + p.name; argAfter(p.c.Args, "-i") != want {
				t.Errorf("%s: -i %q, want %s", p.ds.Name, argAfter(p.c.Args, "-i"), want)
			}
			for _, a := range []string{"-w", "--node-name=$(NODE_NAME)", "--steering-dir=" + steeringDir} {
				if !slices.Contains(p.c.Args, a) {
					t.Errorf("%s: args %q lack %s", p.ds.Name, p.c.Args, a)
				}
			}
			// The operator's dataplane pods carry these labels: the
			// Gateway's Service and stunnerctl select by them.
			sel := labels.SelectorFromSet(labels.Set{"app": "stunner",
				"stunner.l7mp.io/related-gateway-namespace": p.namespace, "stunner.l7mp.io/related-gateway-name": p.name})
			if !sel.Matches(labels.Set(p.ds.Spec.Template.Labels)) {
				t.Errorf("%s: pod labels %v are not the operator's for the Gateway", p.ds.Name, p.ds.Spec.Template.Labels)
			}
			for name, path := range map[string]string{"NODE_NAME": "spec.nodeName", "STUNNER_NODENAME": "spec.nodeName", "STUNNER_ADDR": "status.podIP"} {
				i := slices.IndexFunc(p.c.Env, func(e corev1.EnvVar) bool { return e.Name == name })
				if i < 0 || p.c.Env[i].ValueFrom == nil || p.c.Env[i].ValueFrom.FieldRef == nil || p.c.Env[i].ValueFrom.FieldRef.FieldPath != path {
					t.Errorf("%s: %s is not from fieldRef %s", p.ds.Name, name, path)
				}
			}
			if v := p.ds.Spec.Template.Annotations["prometheus.io/port"]; v != strconv.Itoa(p.metricsPort) {
				t.Errorf("%s: prometheus.io/port %q, --metrics-addr port %d", p.ds.Name, v, p.metricsPort)
			}
		}
	})
	t.Run("no host ports", func(t *testing.T) {
		for _, p := range pods {
			spec := p.ds.Spec.Template.Spec
			if !spec.HostNetwork {
				t.Errorf("%s: hostNetwork off", p.ds.Name)
			}
			for _, c := range slices.Concat(spec.InitContainers, spec.Containers) {
				if len(c.Ports) != 0 {
					t.Errorf("%s: container %s declares ports %v: under hostNetwork they are host ports", p.ds.Name, c.Name, c.Ports)
				}
			}
		}
	})
	t.Run("ports and sockets of their own", func(t *testing.T) {
		// Every daemon of a node shares the host's network: a port two of
		// them ask for is served by the first, and the second retries its
		// bind forever.
		owner := map[int]string{}
		sockets := map[string]string{}
		for _, p := range pods {
			for flag, port := range map[string]int{"--metrics-addr": p.metricsPort, "--health-addr": p.healthPort} {
				if prev, ok := owner[port]; ok {
					t.Errorf("%s %s: port %d is %s's already", p.ds.Name, flag, port, prev)
				}
				owner[port] = p.ds.Name + " " + flag
			}
			if prev, ok := sockets[p.healthSocket]; ok || p.healthSocket == "" {
				t.Errorf("%s: --health-socket %q (also %s's)", p.ds.Name, p.healthSocket, prev)
			}
			sockets[p.healthSocket] = p.ds.Name
		}
	})
	t.Run("exec probes over the pod's own socket", func(t *testing.T) {
		for _, p := range pods {
			// The socket is on a volume of the pod's own (an emptyDir), so
			// no other pod, this Gateway's surge pod included, can answer.
			vm := slices.IndexFunc(p.c.VolumeMounts, func(vm corev1.VolumeMount) bool { return vm.MountPath == filepath.Dir(p.healthSocket) })
			if vm < 0 {
				t.Fatalf("%s: --health-socket %s is not on a volume (the root filesystem is read-only)", p.ds.Name, p.healthSocket)
			}
			v := slices.IndexFunc(p.ds.Spec.Template.Spec.Volumes, func(v corev1.Volume) bool { return v.Name == p.c.VolumeMounts[vm].Name })
			if v < 0 || p.ds.Spec.Template.Spec.Volumes[v].EmptyDir == nil {
				t.Errorf("%s: the health socket's volume is not an emptyDir of the pod", p.ds.Name)
			}
			for name, probe := range map[string]*corev1.Probe{"live": p.c.LivenessProbe, "ready": p.c.ReadinessProbe} {
				want := []string{entrypoint(t), "probe", "--health-socket=" + p.healthSocket, name}
				if probe == nil || probe.Exec == nil || !slices.Equal(probe.Exec.Command, want) {
					t.Errorf("%s: %s probe %+v, want exec %q", p.ds.Name, name, probe, want)
				}
			}
		}
	})
	t.Run("both Gateways on one node", func(t *testing.T) {
		a, b := pods[0].ds, pods[1].ds
		if !equality.Semantic.DeepEqual(a.Spec.Template.Spec.NodeSelector, b.Spec.Template.Spec.NodeSelector) ||
			!equality.Semantic.DeepEqual(a.Spec.Template.Spec.Tolerations, b.Spec.Template.Spec.Tolerations) {
			t.Errorf("the DaemonSets run on different nodes: nodeSelector %v / %v, tolerations %v / %v",
				a.Spec.Template.Spec.NodeSelector, b.Spec.Template.Spec.NodeSelector, a.Spec.Template.Spec.Tolerations, b.Spec.Template.Spec.Tolerations)
		}
		for _, p := range pods {
			spec := p.ds.Spec.Template.Spec
			if spec.Affinity != nil || len(spec.TopologySpreadConstraints) != 0 {
				t.Errorf("%s: affinity %+v, spread %+v could keep the Gateways apart", p.ds.Name, spec.Affinity, spec.TopologySpreadConstraints)
			}
		}
		// Each DaemonSet owns its Gateway's pods only.
		for _, p := range pods {
			sel, err := metav1.LabelSelectorAsSelector(p.ds.Spec.Selector)
			if err != nil {
				t.Fatal(err)
			}
			for _, q := range pods {
				if got := sel.Matches(labels.Set(q.ds.Spec.Template.Labels)); got != (p.ds == q.ds) {
					t.Errorf("%s's selector matches %s's pods: %v", p.ds.Name, q.ds.Name, got)
				}
			}
		}
	})
	t.Run("rolling update with surge", func(t *testing.T) {
		for _, p := range pods {
			u := p.ds.Spec.UpdateStrategy
			if u.Type != appsv1.RollingUpdateDaemonSetStrategyType || u.RollingUpdate == nil ||
				u.RollingUpdate.MaxSurge == nil || u.RollingUpdate.MaxSurge.IntValue() != 1 ||
				u.RollingUpdate.MaxUnavailable == nil || u.RollingUpdate.MaxUnavailable.IntValue() != 0 {
				t.Errorf("%s: update strategy %+v, want RollingUpdate maxSurge 1, maxUnavailable 0", p.ds.Name, u)
			}
		}
	})
	t.Run("the standalone DaemonSet's pod", func(t *testing.T) {
		// What the two layouts share must not drift apart: capabilities,
		// resources, the grace period, the bpffs volume.
		std := one(t, "DaemonSet", render(t, daemonsetDir).daemonSets)
		sc := container(t, std)
		for _, p := range pods {
			a, b := p.ds.Spec.Template.Spec, std.Spec.Template.Spec
			for what, same := range map[string]bool{
				"securityContext":    equality.Semantic.DeepEqual(p.c.SecurityContext, sc.SecurityContext),
				"resources":          equality.Semantic.DeepEqual(p.c.Resources, sc.Resources),
				"image":              p.c.Image == sc.Image && p.c.ImagePullPolicy == sc.ImagePullPolicy,
				"grace period":       equality.Semantic.DeepEqual(a.TerminationGracePeriodSeconds, b.TerminationGracePeriodSeconds),
				"nodeSelector":       equality.Semantic.DeepEqual(a.NodeSelector, b.NodeSelector),
				"serviceAccountName": a.ServiceAccountName == b.ServiceAccountName,
				"dnsPolicy":          a.DNSPolicy == b.DNSPolicy,
				"bpffs volume":       equality.Semantic.DeepEqual(volume(a, "bpffs"), volume(b, "bpffs")),
				"--steering-dir":     flagValue(p.c.Args, "--steering-dir") == flagValue(sc.Args, "--steering-dir"),
			} {
				if !same {
					t.Errorf("%s: %s differs from deploy/daemonset's", p.ds.Name, what)
				}
			}
		}
	})
	t.Run("namespace, ServiceAccount, RBAC", func(t *testing.T) {
		ns := one(t, "Namespace", m.namespaces)
		sa := one(t, "ServiceAccount", m.serviceAccounts)
		b := one(t, "ClusterRoleBinding", m.bindings)
		for _, p := range pods {
			if p.ds.Namespace != ns.Name || p.ds.Spec.Template.Spec.ServiceAccountName != sa.Name || sa.Namespace != ns.Name {
				t.Errorf("%s in %s runs as %s, the ServiceAccount is %s/%s", p.ds.Name, p.ds.Namespace,
					p.ds.Spec.Template.Spec.ServiceAccountName, sa.Namespace, sa.Name)
			}
		}
		if !slices.ContainsFunc(b.Subjects, func(s rbacv1.Subject) bool {
			return s.Kind == "ServiceAccount" && s.Name == sa.Name && s.Namespace == sa.Namespace
		}) {
			t.Errorf("the ClusterRoleBinding's subjects %+v lack the ServiceAccount", b.Subjects)
		}
	})
	t.Run("pod security admission", func(t *testing.T) {
		ns := one(t, "Namespace", m.namespaces)
		enforce, err := psapi.ParseLevel(ns.Labels[psapi.EnforceLevelLabel])
		if err != nil {
			t.Fatalf("namespace %s: %s=%q: %v", ns.Name, psapi.EnforceLevelLabel, ns.Labels[psapi.EnforceLevelLabel], err)
		}
		if enforce != psapi.LevelPrivileged {
			t.Errorf("namespace %s enforces %s: hostNetwork and the BPF capabilities need privileged", ns.Name, enforce)
		}
		for _, p := range pods {
			if reasons := forbidden(t, enforce, p.ds); len(reasons) != 0 {
				t.Errorf("%s: the namespace's %s level refuses the pod: %v", p.ds.Name, enforce, reasons)
			}
			// The label is needed: the stricter levels refuse the pod.
			for _, level := range []psapi.Level{psapi.LevelBaseline, psapi.LevelRestricted} {
				reasons := forbidden(t, level, p.ds)
				if len(reasons) == 0 {
					t.Errorf("%s: Pod Security %s admits the pod", p.ds.Name, level)
				}
				t.Logf("%s: Pod Security %s refuses: %s", p.ds.Name, level, strings.Join(reasons, "; "))
			}
		}
	})
	t.Run("the operator's Deployment has no pods", func(t *testing.T) {
		d := one(t, "Dataplane", m.dataplanes)
		if d.Spec.Replicas == nil || *d.Spec.Replicas != 0 {
			t.Errorf("Dataplane %s: replicas %v, want 0 (the operator enforces a replicas other than 1)", d.Metadata.Name, d.Spec.Replicas)
		}
		if !strings.HasPrefix(d.Spec.Image, "ghcr.io/l7mp/stunnerd-xdp") {
			t.Errorf("Dataplane %s: image %s", d.Metadata.Name, d.Spec.Image)
		}
	})
}

// TestGatewayPrivileged: the privileged component patches a Gateway's
// DaemonSet as it patches deploy/daemonset's.
func TestGatewayPrivileged(t *testing.T) {
	overlay := t.TempDir()
	writeKustomization(t, overlay, fmt.Sprintf(`components:
  - %s
  - %s
configMapGenerator:
  - name: gateway
    literals: [namespace=media, name=gw1, metrics-port=9100, health-port=9101]
    options:
      disableNameSuffixHash: true
      annotations: {config.kubernetes.io/local-config: "true"}
`, relPath(t, overlay, "../../deploy/gateway/daemonset"), relPath(t, overlay, filepath.Join(daemonsetDir, "components", "privileged"))))
	m := render(t, overlay)
	if len(m.namespaces)+len(m.secrets) != 0 {
		t.Errorf("the Gateway's settings or other objects leaked into the output: %d namespaces, %d secrets", len(m.namespaces), len(m.secrets))
	}
	p := one(t, "gateway pod", gatewayPods(t, m))
	if p.ds.Namespace != "media" || p.name != "gw1" || argAfter(p.c.Args, "-i") != "media/gw1" || p.metricsPort != 9100 || p.healthPort != 9101 {
		t.Errorf("DaemonSet %s/%s for %s/%s, -i %s, ports %d %d: not the settings'", p.ds.Namespace, p.ds.Name,
			p.namespace, p.name, argAfter(p.c.Args, "-i"), p.metricsPort, p.healthPort)
	}
	if sc := p.c.SecurityContext; sc == nil || sc.Privileged == nil || !*sc.Privileged {
		t.Errorf("securityContext %+v: want privileged", sc)
	}
}

// forbidden evaluates a DaemonSet's pod against a Pod Security level with
// the checks kube-apiserver's admission runs, and returns why it refuses.
func forbidden(t *testing.T, level psapi.Level, ds *appsv1.DaemonSet) []string {
	t.Helper()
	ev, err := policy.NewEvaluator(policy.DefaultChecks(), nil)
	if err != nil {
		t.Fatal(err)
	}
	res := policy.AggregateCheckResults(ev.EvaluatePod(psapi.LevelVersion{Level: level, Version: psapi.LatestVersion()},
		&ds.Spec.Template.ObjectMeta, &ds.Spec.Template.Spec))
	if res.Allowed {
		return nil
	}
	return res.ForbiddenReasons
}

func volume(spec corev1.PodSpec, name string) *corev1.Volume {
	i := slices.IndexFunc(spec.Volumes, func(v corev1.Volume) bool { return v.Name == name })
	if i < 0 {
		return nil
	}
	return &spec.Volumes[i]
}

// argAfter returns the argument after a flag given as two words (-c ORIGIN).
func argAfter(args []string, flag string) string {
	i := slices.Index(args, flag)
	if i < 0 || i+1 >= len(args) {
		return ""
	}
	return args[i+1]
}

// addrPort is the port of a :PORT or HOST:PORT flag value.
func addrPort(t *testing.T, ds, flag, addr string) int {
	t.Helper()
	_, port, err := net.SplitHostPort(addr)
	if err != nil {
		t.Fatalf("%s: %s=%q: %v", ds, flag, addr, err)
	}
	n, err := strconv.Atoi(port)
	if err != nil || n <= 0 || n > 65535 {
		t.Fatalf("%s: %s=%q: not a port", ds, flag, addr)
	}
	return n
}

func writeKustomization(t *testing.T, dir, kustomization string) {
	t.Helper()
	if err := os.WriteFile(filepath.Join(dir, "kustomization.yaml"), []byte(kustomization), 0o644); err != nil {
		t.Fatal(err)
	}
}

// relPath is dir relative to the overlay directory: kustomize refuses
// absolute paths to other kustomizations.
func relPath(t *testing.T, overlay, dir string) string {
	t.Helper()
	abs, err := filepath.Abs(dir)
	if err != nil {
		t.Fatal(err)
	}
	r, err := filepath.Rel(overlay, abs)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// TestGatewayArgsDryRun runs the daemon on each Gateway's rendered args and
// environment with -d (check and exit), against a config discovery server
// standing in for the operator's: the binary takes every flag, asks for its
// own Gateway's config for the pod's node, and finds the config valid. -w
// (a websocket watch) is left out: the dry run then makes one GET.
func TestGatewayArgsDryRun(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: not building the binary")
	}
	bin := filepath.Join(t.TempDir(), "stunnerd-xdp")
	build := exec.Command("go", "build", "-o", bin, "./cmd/stunnerd-xdp")
	build.Dir = "../.."
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}

	var mu sync.Mutex
	var asked []string
	cds := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		asked = append(asked, r.URL.String())
		mu.Unlock()
		id, ok := strings.CutPrefix(r.URL.Path, "/api/v1/configs/")
		if !ok {
			http.NotFound(w, r)
			return
		}
		// What the operator renders for a TURN-UDP Gateway (its admin
		// endpoints included, which the flags override).
		fmt.Fprintf(w, `{"version":"v1","admin":{"name":%q,"metrics_endpoint":"http://:8080/metrics","healthcheck_endpoint":"http://0.0.0.0:8086","offload_engine":"None"},
"auth":{"type":"static","realm":"stunner.l7mp.io","credentials":{"username":"user-1","password":"pass-1"}},
"listeners":[{"name":"%s/udp-listener","protocol":"TURN-UDP","address":"$STUNNER_ADDR","port":3478,"routes":["media-plane"]}],
"clusters":[{"name":"media-plane","type":"STATIC","protocol":"udp","endpoints":["10.244.1.7"]}]}`, id, id)
	}))
	defer cds.Close()

	for _, p := range gatewayPods(t, render(t, gatewayExampleDir)) {
		t.Run(p.name, func(t *testing.T) {
			// The downward API's values on a node "node-1" whose address
			// is loopback.
			env := map[string]string{}
			for _, e := range p.c.Env {
				switch {
				case e.ValueFrom == nil:
					env[e.Name] = e.Value
				case e.ValueFrom.FieldRef != nil && e.ValueFrom.FieldRef.FieldPath == "spec.nodeName":
					env[e.Name] = "node-1"
				case e.ValueFrom.FieldRef != nil && e.ValueFrom.FieldRef.FieldPath == "status.podIP":
					env[e.Name] = "127.0.0.1"
				default:
					t.Fatalf("env %s: %+v is not simulated", e.Name, e.ValueFrom)
				}
			}
			var args []string
			for i := 0; i < len(p.c.Args); i++ {
				a := p.c.Args[i]
				switch {
				case a == "-w":
					continue
				case a == "-c" && i+1 < len(p.c.Args):
					args = append(args, "-c", cds.URL)
					i++
					continue
				}
				// The kubelet expands $(VAR) from the container's env.
				for k, v := range env {
					a = strings.ReplaceAll(a, "$("+k+")", v)
				}
				args = append(args, a)
			}
			cmd := exec.Command(bin, append(args, "-d")...)
			cmd.Env = []string{"PATH=" + os.Getenv("PATH")}
			for k, v := range env {
				cmd.Env = append(cmd.Env, k+"="+v)
			}
			out, err := cmd.CombinedOutput()
			if err != nil || !strings.Contains(string(out), "dry run: config valid") {
				t.Fatalf("%q: %v\n%s", cmd.Args, err, out)
			}
			want := fmt.Sprintf("/api/v1/configs/%s/%s?node=node-1", p.namespace, p.name)
			mu.Lock()
			defer mu.Unlock()
			if !slices.Contains(asked, want) {
				t.Errorf("the config discovery server was asked for %q, want %s", asked, want)
			}
		})
	}
}
