package daemon

import (
	"context"
	"net/netip"
	"slices"
	"time"

	"github.com/l7mp/stunnerd-xdp/internal/kube"
	"github.com/l7mp/stunnerd-xdp/internal/natcheck"
	"github.com/l7mp/stunnerd-xdp/internal/servicecidr"
)

// startGate makes the mirror offload only bindings whose relay<->peer flow
// the kernel does not NAT (the XDP path runs before netfilter), and never
// those whose peer is in a --no-offload-peer prefix. It runs before any
// offload is set, so no binding is offloaded unjudged.
func (d *Daemon) startGate() {
	d.mirror.SetNoOffloadPeers(d.config().NoOffloadPeers)
	c, err := natcheck.New()
	if err != nil {
		// Every binding then stays pending (in userspace): offloading blind
		// could send a ClusterIP peer's traffic down the default route.
		d.config().Logger.Slog("control").Error("cannot read conntrack: bindings stay on the userspace path", "error", err)
		d.mirror.SetGate(failedChecker{err})
		return
	}
	d.mirror.SetGate(c) // the mirror closes it
}

type failedChecker struct{ err error }

func (f failedChecker) Check(_, _ netip.AddrPort) (natcheck.Result, error) {
	return natcheck.Result{}, f.err
}

// followServiceCIDRs keeps the cluster's Service CIDRs out of the kernel
// path, beside --no-offload-peer, and refuses them as peers unless an allow
// prefix inside them admits them (peerpolicy), until the daemon closes.
func (d *Daemon) followServiceCIDRs(api kube.API, timeout time.Duration) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	stop := servicecidr.Follow(ctx, api, d.config().Logger.Slog("k8s"), func(cidrs []netip.Prefix) {
		d.clusterNets.Set(cidrs)
		d.listeners.RecheckPeers(d.config().listenerSettings())
		d.mirror.SetNoOffloadPeers(append(slices.Clone(d.config().NoOffloadPeers), cidrs...))
	})
	if !d.track(func() {
		<-d.stop
		stop()
	}) {
		stop()
	}
}
