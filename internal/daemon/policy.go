package daemon

import (
	"errors"
	"log/slog"
	"time"

	"golang.org/x/sys/unix"

	"github.com/l7mp/stunnerd-xdp/internal/policywatch"
)

// policyRetry is how long the watchers wait before subscribing again after a
// failure, and how often they look whether conntrack was loaded.
const policyRetry = 2 * time.Second

// nodePolicy holds the subscriptions made before any offload is set, so
// that no removal or policy that comes meanwhile is missed; the watchers
// take them over (watchPolicy).
type nodePolicy struct {
	ct   *policywatch.ConntrackEvents // nil: conntrack not loaded yet, or failed
	xfrm *policywatch.XfrmEvents      // nil: no xfrm in the kernel, or failed
	// listed: the xfrm policies were read and given to the mirror.
	listed bool
}

// startPolicy subscribes to conntrack's removals and xfrm's policy changes and
// gives the mirror the xfrm policies there are now. It runs before any
// offload is set: no binding is offloaded that a policy refuses.
func (d *Daemon) startPolicy() nodePolicy {
	log := d.config().Logger.Slog("policy")
	var p nodePolicy
	var err error
	if p.ct, err = policywatch.ListenConntrack(); err != nil && !errors.Is(err, policywatch.ErrNoConntrack) {
		log.Warn("cannot follow conntrack's removals; retrying", "error", err)
	}
	if p.xfrm, err = policywatch.WatchXfrm(); err != nil {
		p.xfrm = nil
		d.xfrmUnreadable(log, err)
		return p
	}
	p.listed = d.listXfrm(log)
	return p
}

// watchPolicy follows conntrack's removals and xfrm's policy changes until
// the daemon stops.
func (d *Daemon) watchPolicy(p nodePolicy) {
	log := d.config().Logger.Slog("policy")
	if !d.track(func() { d.watchConntrack(log, p.ct) }) && p.ct != nil {
		p.ct.Close()
	}
	if !d.track(func() { d.watchXfrm(log, p.xfrm, p.listed) }) && p.xfrm != nil {
		p.xfrm.Close()
	}
}

// watchConntrack hands every UDP entry conntrack removes to the mirror, which
// evicts the bindings it belonged to. Without a subscription it subscribes
// again every policyRetry; once it has one after a time without, the mirror
// looks up every offloaded binding's entries (removals in between went
// unseen).
func (d *Daemon) watchConntrack(log *slog.Logger, ev *policywatch.ConntrackEvents) {
	// Without a subscription from the start, entries made before the first
	// one (conntrack loaded later) may go unseen too.
	lost := ev == nil
	for {
		for ev == nil {
			select {
			case <-d.stop:
				return
			case <-time.After(policyRetry):
			}
			var err error
			ev, err = policywatch.ListenConntrack()
			switch {
			case errors.Is(err, policywatch.ErrNoConntrack):
			case err != nil:
				log.Debug("cannot follow conntrack's removals; retrying", "error", err)
			case lost:
				d.mirror.ConntrackLost()
				lost = false
			}
		}
		stopped := make(chan struct{})
		go func(ev *policywatch.ConntrackEvents) {
			select {
			case <-d.stop:
			case <-stopped:
			}
			ev.Close()
		}(ev)
		for {
			removed, err := ev.Next()
			if errors.Is(err, policywatch.ErrEventsLost) {
				d.mirror.ConntrackLost()
				continue
			}
			if err != nil {
				break
			}
			for _, r := range removed {
				d.mirror.ConntrackRemoved(r)
			}
		}
		close(stopped)
		select {
		case <-d.stop:
			return
		default:
		}
		log.Warn("conntrack removals: the subscription failed; subscribing again")
		ev, lost = nil, true
	}
}

// watchXfrm lists the xfrm policies anew whenever one changes and gives them
// to the mirror; while they cannot be read or followed it tries again every
// policyRetry.
func (d *Daemon) watchXfrm(log *slog.Logger, ev *policywatch.XfrmEvents, listed bool) {
	changed := make(chan error, 1)
	follow := func(ev *policywatch.XfrmEvents) {
		for {
			_, err := ev.Next()
			select {
			case changed <- err:
			case <-d.stop:
				return
			}
			if err != nil {
				return
			}
		}
	}
	if ev != nil {
		go follow(ev)
	}
	defer func() {
		if ev != nil {
			ev.Close() // ends follow
		}
	}()
	retry := time.NewTicker(policyRetry)
	defer retry.Stop()
	for {
		select {
		case <-d.stop:
			return
		case err := <-changed:
			if err != nil {
				log.Warn("xfrm policies: the subscription failed; subscribing again", "error", err)
				ev.Close()
				ev, listed = nil, false
				continue
			}
			listed = d.listXfrm(log)
		case <-retry.C:
			if ev == nil {
				var err error
				if ev, err = policywatch.WatchXfrm(); err != nil {
					if errors.Is(err, policywatch.ErrNoXfrm) {
						return // the kernel has none: no policy can come
					}
					ev = nil
					continue
				}
				go follow(ev)
				listed = false // changes in between went unseen
			}
			if !listed {
				listed = d.listXfrm(log)
			}
		}
	}
}

// listXfrm gives the mirror the namespace's xfrm policies and tells whether
// it could read them.
func (d *Daemon) listXfrm(log *slog.Logger) bool {
	ps, err := policywatch.ListPolicies()
	if err != nil {
		d.xfrmUnreadable(log, err)
		return false
	}
	d.mirror.SetXfrmPolicies(ps)
	return true
}

// xfrmUnreadable handles policies that cannot be read. A kernel without
// xfrm's netlink interface has none that the node's tools could have made,
// and a daemon without CAP_NET_ADMIN cannot attach a kernel path at all:
// nothing to consult. Otherwise a policy may refuse any flow: every binding
// stays in userspace (reason xfrm) until they can be read.
func (d *Daemon) xfrmUnreadable(log *slog.Logger, err error) {
	switch {
	case errors.Is(err, policywatch.ErrNoXfrm):
		log.Info("the kernel has no xfrm netlink interface: no xfrm policy to consult")
	case errors.Is(err, unix.EPERM):
		log.Warn("cannot read the xfrm policies (no CAP_NET_ADMIN): they are not consulted", "error", err)
	default:
		log.Error("cannot read the xfrm policies: bindings stay on the userspace path until they can be read", "error", err)
		d.mirror.SetXfrmPolicies(policywatch.Policies{policywatch.RefuseAll})
	}
}
