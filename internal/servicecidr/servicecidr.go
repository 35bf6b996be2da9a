// Package servicecidr learns the cluster's Service CIDRs from the Kubernetes
// API, so that ClusterIP peers stay on the userspace path and are refused
// unless allowed.
package servicecidr

import (
	"cmp"
	"context"
	"log/slog"
	"net/netip"
	"slices"
	"sync"

	networkingv1 "k8s.io/api/networking/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/cache"

	"github.com/l7mp/stunnerd-xdp/internal/kube"
	"github.com/l7mp/stunnerd-xdp/internal/prefix"
)

// Follow reports the cluster's Service CIDRs (networking.k8s.io/v1
// ServiceCIDR objects, Kubernetes 1.33 and later) to onChange: once after the
// first list, then whenever the set changes. A peer in a Service CIDR is a
// ClusterIP, which kube-proxy DNATs and Cilium translates at the socket, both
// out of the XDP program's sight, so the daemon keeps these peers in
// userspace.
//
// A cluster that does not serve the resource (older Kubernetes) or does not
// let the daemon list it (RBAC) is logged once at INFO and not asked again:
// stop is then a no-op and onChange is never called. Other errors are left to
// the informer, which retries. onChange is called from one goroutine at a
// time; stop ends the watch and waits for its goroutines. ctx bounds the
// first list only.
func Follow(ctx context.Context, api kube.API, log *slog.Logger, onChange func([]netip.Prefix)) (stop func()) {
	w := &serviceCIDRs{log: log, onChange: onChange}
	source := api.ServiceCIDRs()
	obj, err := cache.ToListerWatcherWithContext(source).ListWithContext(ctx, metav1.ListOptions{})
	switch {
	case apierrors.IsNotFound(err), apierrors.IsForbidden(err), apierrors.IsMethodNotSupported(err):
		log.Info("cannot list the cluster's Service CIDRs; ClusterIP peers are kept in userspace by conntrack evidence and --no-offload-peer only",
			"resource", "servicecidrs.networking.k8s.io/v1", "error", err)
		return func() {}
	case err != nil:
		log.Warn("listing the cluster's Service CIDRs failed; retrying", "error", err)
	default:
		if list, ok := obj.(*networkingv1.ServiceCIDRList); ok {
			objs := make([]any, len(list.Items))
			for i := range list.Items {
				objs[i] = &list.Items[i]
			}
			w.update(objs)
		}
	}

	informer := cache.NewSharedIndexInformer(source, &networkingv1.ServiceCIDR{}, 0, cache.Indexers{})
	refresh := func(any) { w.update(informer.GetStore().List()) }
	if _, err := informer.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    refresh,
		UpdateFunc: func(_, obj any) { refresh(obj) },
		DeleteFunc: refresh,
	}); err != nil {
		log.Warn("cannot follow the cluster's Service CIDRs", "error", err)
		return func() {}
	}
	done, ran := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(ran)
		informer.Run(done)
	}()
	var once sync.Once
	return func() {
		once.Do(func() {
			close(done)
			<-ran
		})
	}
}

type serviceCIDRs struct {
	log      *slog.Logger
	onChange func([]netip.Prefix)

	mu        sync.Mutex // serialises onChange
	last      []netip.Prefix
	delivered bool
}

func (w *serviceCIDRs) update(objs []any) {
	var prefixes []netip.Prefix
	for _, o := range objs {
		sc, ok := o.(*networkingv1.ServiceCIDR)
		if !ok {
			continue
		}
		for _, s := range sc.Spec.CIDRs {
			p, err := prefix.Parse(s)
			if err != nil {
				w.log.Warn("ignoring an invalid Service CIDR", "servicecidr", sc.Name, "cidr", s, "error", err)
				continue
			}
			prefixes = append(prefixes, p)
		}
	}
	slices.SortFunc(prefixes, func(a, b netip.Prefix) int {
		if c := a.Addr().Compare(b.Addr()); c != 0 {
			return c
		}
		return cmp.Compare(a.Bits(), b.Bits())
	})
	prefixes = slices.Compact(prefixes)

	w.mu.Lock()
	defer w.mu.Unlock()
	if w.delivered && slices.Equal(prefixes, w.last) {
		return
	}
	w.last, w.delivered = prefixes, true
	w.log.Info("Service CIDRs: peers in them stay on the userspace path", "cidrs", prefixes)
	w.onChange(slices.Clone(prefixes))
}
