// Package kubetest adapts a client-go clientset (a fake, in unit tests) to
// kube.API. Only tests import it: the daemon's binary keeps out of the
// clientset and its API groups.
package kubetest

import (
	"context"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"

	"github.com/l7mp/stunnerd-xdp/internal/kube"
)

// FromClientset returns the kube.API that c serves. A fake clientset says it
// cannot stream a watch's initial list (WatchList), and the informers then
// list first, as with client-go's own informers.
func FromClientset(c kubernetes.Interface) kube.API { return clientset{c} }

type clientset struct{ c kubernetes.Interface }

func (s clientset) Node(name string) cache.ListerWatcher {
	selector := fields.OneTermEqualSelector("metadata.name", name).String()
	return cache.ToListWatcherWithWatchListSemantics(&cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			o.FieldSelector = selector
			return s.c.CoreV1().Nodes().List(ctx, o)
		},
		WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			o.FieldSelector = selector
			return s.c.CoreV1().Nodes().Watch(ctx, o)
		},
	}, s.c)
}

func (s clientset) ServiceCIDRs() cache.ListerWatcher {
	return cache.ToListWatcherWithWatchListSemantics(&cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			return s.c.NetworkingV1().ServiceCIDRs().List(ctx, o)
		},
		WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			return s.c.NetworkingV1().ServiceCIDRs().Watch(ctx, o)
		},
	}, s.c)
}
