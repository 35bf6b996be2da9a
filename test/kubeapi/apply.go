package kubeapi

import (
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"os/exec"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/discovery/cached/memory"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/restmapper"

	"github.com/l7mp/stunnerd-xdp/test/netns"
)

// ApplyKustomization renders the kustomization in dir as `kubectl apply -k`
// does and applies every object it renders, so that the server validates
// them and the RBAC objects among them take effect exactly as shipped. It
// returns the objects as the server stored them.
func (s *Server) ApplyKustomization(t testing.TB, dir string) []*unstructured.Unstructured {
	t.Helper()
	render := netns.RequireBinary(t, netns.Kustomize)
	var stderr bytes.Buffer
	cmd := exec.Command(render, dir)
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("kustomize %s: %v: %s", dir, err, stderr.String())
	}
	return s.apply(t, dir, decodeYAML(t, dir, out))
}

// ApplyFile applies every object of a YAML file (`kubectl apply -f`): for a
// manifest that is part of a kustomization whose other objects need CRDs.
func (s *Server) ApplyFile(t testing.TB, path string) []*unstructured.Unstructured {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return s.apply(t, path, decodeYAML(t, path, b))
}

// decodeYAML decodes every object of a YAML (or JSON) stream.
func decodeYAML(t testing.TB, from string, b []byte) []*unstructured.Unstructured {
	t.Helper()
	var objs []*unstructured.Unstructured
	dec := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(b), 4096)
	for {
		u := &unstructured.Unstructured{}
		if err := dec.Decode(&u.Object); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			t.Fatalf("%s: %v", from, err)
		}
		if len(u.Object) > 0 {
			objs = append(objs, u)
		}
	}
	return objs
}

// apply server-side applies objs as the admin.
func (s *Server) apply(t testing.TB, from string, objs []*unstructured.Unstructured) []*unstructured.Unstructured {
	t.Helper()
	cfg := s.restConfig(s.adminToken)
	dc, err := discovery.NewDiscoveryClientForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	mapper := restmapper.NewDeferredDiscoveryRESTMapper(memory.NewMemCacheClient(dc))
	dyn, err := dynamic.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var applied []*unstructured.Unstructured
	for _, u := range objs {
		gvk := u.GroupVersionKind()
		mapping, err := mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
		if err != nil {
			t.Fatalf("%s %s from %s: %v", gvk, u.GetName(), from, err)
		}
		var ri dynamic.ResourceInterface = dyn.Resource(mapping.Resource)
		if mapping.Scope.Name() == meta.RESTScopeNameNamespace {
			ri = dyn.Resource(mapping.Resource).Namespace(u.GetNamespace())
		}
		got, err := ri.Apply(ctx, u.GetName(), u, metav1.ApplyOptions{FieldManager: "stunnerd-xdp-tests", Force: true})
		if err != nil {
			t.Fatalf("applying %s %s/%s from %s: %v", gvk.Kind, u.GetNamespace(), u.GetName(), from, err)
		}
		applied = append(applied, got)
	}
	return applied
}
