// Package kube is the daemon's client of the Kubernetes API: REST clients for
// the two resources it reads, its own Node (the offload label) and the
// cluster's ServiceCIDRs, with a scheme that knows only their API groups.
// client-go's clientset and informer factory register every API group of
// Kubernetes; through them, code the daemon never runs was most of the
// binary.
package kube

import (
	"fmt"

	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
)

// API is what the daemon reads from the Kubernetes API: list-and-watch
// sources for informers (nodelabel, servicecidr). *Client implements it;
// tests may back it with anything that lists and watches.
type API interface {
	// Node lists and watches the Node named name only (a field selector on
	// metadata.name: RBAC cannot narrow list/watch to one name, the
	// selector keeps the traffic and the cache to one object).
	Node(name string) cache.ListerWatcher
	// ServiceCIDRs lists and watches networking.k8s.io/v1 ServiceCIDRs.
	ServiceCIDRs() cache.ListerWatcher
}

// Client is API over the REST clients of core/v1 and networking.k8s.io/v1.
type Client struct {
	core, networking rest.Interface
}

var _ API = (*Client)(nil)

// scheme knows the two API groups' types, and the meta types their lists and
// watch events carry.
var scheme = func() *runtime.Scheme {
	s := runtime.NewScheme()
	for _, add := range []func(*runtime.Scheme) error{corev1.AddToScheme, networkingv1.AddToScheme} {
		if err := add(s); err != nil {
			panic(err) // static registration: fails only on a programming error
		}
	}
	return s
}()

// NewForConfig returns a Client for the API server cfg names (in-cluster
// config or a kubeconfig's).
func NewForConfig(cfg *rest.Config) (*Client, error) {
	core, err := restClient(cfg, "/api", corev1.SchemeGroupVersion)
	if err != nil {
		return nil, err
	}
	networking, err := restClient(cfg, "/apis", networkingv1.SchemeGroupVersion)
	if err != nil {
		return nil, err
	}
	return &Client{core: core, networking: networking}, nil
}

func restClient(cfg *rest.Config, apiPath string, gv schema.GroupVersion) (*rest.RESTClient, error) {
	c := rest.CopyConfig(cfg)
	c.APIPath = apiPath
	c.GroupVersion = &gv
	c.NegotiatedSerializer = serializer.NewCodecFactory(scheme).WithoutConversion()
	if c.UserAgent == "" {
		c.UserAgent = rest.DefaultKubernetesUserAgent()
	}
	r, err := rest.RESTClientFor(c)
	if err != nil {
		return nil, fmt.Errorf("REST client for %s: %w", gv, err)
	}
	return r, nil
}

// Node implements API.
func (c *Client) Node(name string) cache.ListerWatcher {
	return cache.NewListWatchFromClient(c.core, "nodes", metav1.NamespaceAll, fields.OneTermEqualSelector("metadata.name", name))
}

// ServiceCIDRs implements API.
func (c *Client) ServiceCIDRs() cache.ListerWatcher {
	return cache.NewListWatchFromClient(c.networking, "servicecidrs", metav1.NamespaceAll, fields.Everything())
}
