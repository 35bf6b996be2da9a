package deploy_test

import (
	"encoding/json"
	"fmt"
	"maps"
	"os"
	"regexp"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"

	"sigs.k8s.io/kustomize/api/krusty"
	"sigs.k8s.io/kustomize/kyaml/filesys"
	"sigs.k8s.io/yaml"
)

// podMonitor is the part of the Prometheus Operator's PodMonitor that
// deploy/monitoring sets (decoded strictly: a field outside it fails).
type podMonitor struct {
	APIVersion string `json:"apiVersion"`
	Kind       string `json:"kind"`
	Metadata   struct {
		Name      string            `json:"name"`
		Namespace string            `json:"namespace"`
		Labels    map[string]string `json:"labels"`
	} `json:"metadata"`
	Spec struct {
		Selector struct {
			MatchLabels map[string]string `json:"matchLabels"`
		} `json:"selector"`
		NamespaceSelector struct {
			Any bool `json:"any"`
		} `json:"namespaceSelector"`
		PodMetricsEndpoints []struct {
			Path        string       `json:"path"`
			Interval    string       `json:"interval"`
			HonorLabels bool         `json:"honorLabels"`
			Relabelings []relabeling `json:"relabelings"`
		} `json:"podMetricsEndpoints"`
	} `json:"spec"`
}

// scrapeTarget is a pod's annotations and the address it must be scraped at.
type scrapeTarget struct {
	annotations map[string]string
	want        string
}

// relabeling is one of a PodMonitor endpoint's relabelings.
type relabeling struct {
	SourceLabels []string `json:"sourceLabels"`
	TargetLabel  string   `json:"targetLabel"`
	Regex        string   `json:"regex"`
	Replacement  string   `json:"replacement"`
	Action       string   `json:"action"`
}

// TestMonitoring: the PodMonitor selects the DaemonSets' pods (which carry
// the labels stunnerctl selects dataplane pods by) and scrapes each at its
// metrics port: the shipped config's, each Gateway's --metrics-addr, the
// operator's 8080; the dashboard ConfigMap holds valid JSON for
// Grafana's sidecar.
func TestMonitoring(t *testing.T) {
	ds := one(t, "DaemonSet", render(t, daemonsetDir).daemonSets)
	labels := ds.Spec.Template.Labels
	for k, v := range map[string]string{"app": "stunner", "stunner.l7mp.io/related-gateway-namespace": ds.Namespace} {
		if labels[k] != v {
			t.Errorf("pod label %s=%q, want %q (stunnerctl selects on it)", k, labels[k], v)
		}
	}
	if labels["stunner.l7mp.io/related-gateway-name"] == "" {
		t.Error("no stunner.l7mp.io/related-gateway-name pod label")
	}

	resMap, err := krusty.MakeKustomizer(krusty.MakeDefaultOptions()).Run(filesys.MakeFsOnDisk(), "../../deploy/monitoring")
	if err != nil {
		t.Fatalf("kustomize deploy/monitoring: %v", err)
	}
	var pm *podMonitor
	dashboards := 0
	for _, r := range resMap.Resources() {
		doc, err := r.AsYAML()
		if err != nil {
			t.Fatal(err)
		}
		switch r.GetKind() {
		case "PodMonitor":
			pm = &podMonitor{}
			if err := yaml.UnmarshalStrict(doc, pm); err != nil {
				t.Fatalf("PodMonitor: %v\n%s", err, doc)
			}
		case "ConfigMap":
			if r.GetLabels()["grafana_dashboard"] != "1" {
				t.Errorf("ConfigMap %s lacks the grafana_dashboard=1 label the sidecar imports by", r.GetName())
			}
			data := r.GetDataMap()
			for name, js := range data {
				var d struct {
					UID    string            `json:"uid"`
					Panels []json.RawMessage `json:"panels"`
				}
				if err := json.Unmarshal([]byte(js), &d); err != nil || d.UID == "" || len(d.Panels) == 0 {
					t.Errorf("dashboard %s: %v (uid %q, %d panels)", name, err, d.UID, len(d.Panels))
				}
				dashboards++
			}
		default:
			t.Fatalf("unexpected %s %s", r.GetKind(), r.GetName())
		}
	}
	if pm == nil || dashboards != 1 {
		t.Fatalf("PodMonitor %v, %d dashboards; want one of each", pm != nil, dashboards)
	}
	for k, v := range pm.Spec.Selector.MatchLabels {
		if labels[k] != v {
			t.Errorf("the PodMonitor selects %s=%s, which the DaemonSet's pods do not carry", k, v)
		}
	}
	if len(pm.Spec.PodMetricsEndpoints) != 1 {
		t.Fatalf("%d endpoints, want 1", len(pm.Spec.PodMetricsEndpoints))
	}
	ep := pm.Spec.PodMetricsEndpoints[0]
	if ep.Path != "/metrics" {
		t.Errorf("the PodMonitor scrapes %s, want /metrics", ep.Path)
	}
	// The address Prometheus scrapes each kind of pod at, by the
	// PodMonitor's own relabelings: the metrics port the pod listens on.
	const podIP = "192.0.2.10"
	metricsURL := stunnerConf(t, render(t, daemonsetDir)).Admin.MetricsEndpoint
	port := metricsURL[strings.LastIndex(metricsURL, ":")+1 : strings.Index(metricsURL, "/metrics")]
	targets := map[string]scrapeTarget{"deploy/daemonset": {ds.Spec.Template.Annotations, podIP + ":" + port}}
	for _, p := range gatewayPods(t, render(t, gatewayExampleDir)) {
		targets["deploy/gateway "+p.name] = scrapeTarget{p.ds.Spec.Template.Annotations, fmt.Sprintf("%s:%d", podIP, p.metricsPort)}
		for k, v := range pm.Spec.Selector.MatchLabels {
			if p.ds.Spec.Template.Labels[k] != v {
				t.Errorf("the PodMonitor selects %s=%s, which %s's pods do not carry", k, v, p.ds.Name)
			}
		}
	}
	// The operator's pods: no port annotation, metrics on :8080
	// (enableMetricsEndpoint renders http://:8080/metrics).
	targets["the operator's Deployment"] = scrapeTarget{operatorPodAnnotations(t), podIP + ":8080"}
	for name, tg := range targets {
		meta := map[string]string{"__meta_kubernetes_pod_ip": podIP, "__meta_kubernetes_pod_node_name": "node-1"}
		for k, v := range tg.annotations {
			meta["__meta_kubernetes_pod_annotation_"+sanitizeLabelName(k)] = v
		}
		if got := relabel(t, ep.Relabelings, meta)["__address__"]; got != tg.want {
			t.Errorf("%s: the PodMonitor scrapes %q, want %s", name, got, tg.want)
		}
	}
}

// relabel applies relabeling rules as Prometheus does (action replace only,
// the one the PodMonitor uses): the source labels' values joined by ";",
// matched by the whole regex, the target set to the expanded replacement.
func relabel(t *testing.T, rules []relabeling, lset map[string]string) map[string]string {
	t.Helper()
	out := maps.Clone(lset)
	for _, r := range rules {
		if r.Action != "replace" && r.Action != "" {
			t.Fatalf("relabel action %s: only replace is simulated", r.Action)
		}
		regex, replacement := r.Regex, r.Replacement
		if regex == "" {
			regex = "(.*)"
		}
		if replacement == "" {
			replacement = "$1"
		}
		re, err := regexp.Compile("^(?:" + regex + ")$")
		if err != nil {
			t.Fatalf("relabel regex %q: %v", r.Regex, err)
		}
		vals := make([]string, len(r.SourceLabels))
		for i, l := range r.SourceLabels {
			vals[i] = out[l]
		}
		val := strings.Join(vals, ";")
		m := re.FindStringSubmatchIndex(val)
		if m == nil {
			continue
		}
		out[r.TargetLabel] = string(re.ExpandString(nil, replacement, val, m))
	}
	return out
}

// sanitizeLabelName is how Prometheus names an annotation's meta label.
func sanitizeLabelName(s string) string {
	return regexp.MustCompile(`[^a-zA-Z0-9_]`).ReplaceAllString(s, "_")
}

// operatorPodAnnotations are the pod annotations of the Deployment STUNner's
// operator rendered for deploy/stunner's Dataplane (test/operator's fixture).
func operatorPodAnnotations(t *testing.T) map[string]string {
	t.Helper()
	b, err := os.ReadFile("../operator/testdata/operator-v1.2.1/deployment.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var d appsv1.Deployment
	if err := yaml.UnmarshalStrict(b, &d); err != nil {
		t.Fatal(err)
	}
	return d.Spec.Template.Annotations
}
