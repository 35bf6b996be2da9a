package deploy_test

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"

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
			Path        string `json:"path"`
			Interval    string `json:"interval"`
			HonorLabels bool   `json:"honorLabels"`
			Relabelings []struct {
				SourceLabels []string `json:"sourceLabels"`
				TargetLabel  string   `json:"targetLabel"`
				Regex        string   `json:"regex"`
				Replacement  string   `json:"replacement"`
				Action       string   `json:"action"`
			} `json:"relabelings"`
		} `json:"podMetricsEndpoints"`
	} `json:"spec"`
}

// TestMonitoring: the PodMonitor selects the DaemonSet's pods (which carry
// the labels stunnerctl selects dataplane pods by) and scrapes the metrics
// port of the shipped config; the dashboard ConfigMap holds valid JSON for
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
	metricsURL := stunnerConf(t, render(t, daemonsetDir)).Admin.MetricsEndpoint
	port := metricsURL[strings.LastIndex(metricsURL, ":")+1 : strings.Index(metricsURL, "/metrics")]
	want := fmt.Sprintf("$1:%s", port)
	found := false
	for _, rl := range ep.Relabelings {
		if rl.TargetLabel == "__address__" {
			found = rl.Replacement == want && len(rl.SourceLabels) == 1 && rl.SourceLabels[0] == "__meta_kubernetes_pod_ip"
		}
	}
	if !found || ep.Path != "/metrics" {
		t.Errorf("the PodMonitor does not scrape the pod IP at %s%s (the config's %s): %+v", port, ep.Path, metricsURL, ep)
	}
}
