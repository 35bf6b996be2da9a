package listener

import (
	"errors"
	"log/slog"
	"net"
	"sync"

	"github.com/l7mp/stunnerd-xdp/internal/config"
	"github.com/l7mp/stunnerd-xdp/internal/quota"
)

// Set is the daemon's listeners by name.
type Set struct {
	deps Deps
	log  *slog.Logger
	// strangerLog is for lines anyone who can send a datagram can trigger
	// (refused peers and allocations): rate-limited.
	strangerLog *slog.Logger
	// gate shuts the hooks that reach the mirror, the destinations and the
	// steering off once Close began.
	gate gate

	mu     sync.Mutex // guards byName
	byName map[string]*Listener
}

// NewSet returns an empty set whose listeners use deps.
func NewSet(deps Deps) *Set {
	return &Set{deps: deps, log: deps.Logger.Slog("stunnerd-xdp"), strangerLog: deps.Logger.Limited("auth"),
		byName: map[string]*Listener{}}
}

// Start starts the listeners of a daemon that starts; on an error the ones
// started are closed.
func (s *Set) Start(st Settings, ls []config.ResolvedListener) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, l := range ls {
		if err := s.start(st, l); err != nil {
			s.stopAll()
			return err
		}
	}
	return nil
}

// Prune stops the listeners next does not keep as they run: those it lacks
// and those whose socket it changes (address, port, protocol, certificate);
// with all, every one (pion/turn keys on the realm). Their allocations close.
func (s *Set) Prune(next []config.ResolvedListener, all bool) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	want := map[string]config.ResolvedListener{}
	for _, l := range next {
		want[l.Name] = l
	}
	var errs []error
	for name, ls := range s.byName {
		if l, ok := want[name]; !ok || all || !ls.l.SameSocket(l) {
			errs = append(errs, s.stop(name))
		}
	}
	return errors.Join(errs...)
}

// Apply brings the running listeners to next after Prune: a running one
// takes its new peer allowlist and port ranges in place (revoking what they
// no longer admit, on both paths), a missing one starts.
func (s *Set) Apply(st Settings, next []config.ResolvedListener) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	var errs []error
	for _, l := range next {
		if ls, ok := s.byName[l.Name]; ok {
			s.configure(st, ls, l)
			continue
		}
		errs = append(errs, s.start(st, l))
	}
	return errors.Join(errs...)
}

// RecheckPeers re-reads every listener's peer policy (the learned cluster
// networks changed): peers it refuses now are revoked as a reload revokes
// them. A fresh policy value makes the relay sockets' cached verdicts miss.
func (s *Set) RecheckPeers(st Settings) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, ls := range s.byName {
		s.configure(st, ls, ls.l)
	}
}

// AllocationCount returns pion's live allocations.
func (s *Set) AllocationCount() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, ls := range s.byName {
		for _, srv := range ls.servers {
			n += srv.AllocationCount()
		}
	}
	return n
}

// Close stops every listener, then shuts the hooks off: pion reports the
// deletion of the allocations it closes from their own goroutines, after
// Server.Close has returned.
func (s *Set) Close() {
	s.mu.Lock()
	s.stopAll()
	s.mu.Unlock()
	s.gate.close()
}

func (s *Set) stopAll() {
	for name := range s.byName {
		if err := s.stop(name); err != nil && !errors.Is(err, net.ErrClosed) {
			s.log.Warn("closing listener", "listener", name, "error", err)
		}
	}
}

// CheckQuotaCounts warns of the pion servers for which the quota counts
// more live allocations than the server holds, on two checks in a row with
// the same counts (a hook runs after pion's map changes, so one check may
// catch a deletion half-reported): slots leaked by a sequence of hooks the
// counter does not follow. seen carries the previous check's excess; it
// returns the listeners warned of.
func (s *Set) CheckQuotaCounts(seen map[quota.Server][2]int) []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	var warned []string
	now := map[quota.Server][2]int{}
	for _, ls := range s.byName {
		for i, srv := range ls.servers {
			qs := ls.quotas[i]
			counts := [2]int{s.deps.Quota.Live(qs), srv.AllocationCount()}
			if counts[0] <= counts[1] {
				continue
			}
			if seen[qs] == counts {
				s.log.Warn("the quota counts allocations pion does not hold: their slots stay taken until a restart",
					"listener", ls.l.Name, "counted", counts[0], "pion", counts[1])
				warned = append(warned, ls.l.Name)
			}
			now[qs] = counts
		}
	}
	clear(seen)
	for k, v := range now {
		seen[k] = v
	}
	return warned
}

// Allocations are pion's live allocations per listener, one count per
// read loop (pion/turn server).
func (s *Set) Allocations() map[string][]int {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := map[string][]int{}
	for name, ls := range s.byName {
		for _, srv := range ls.servers {
			out[name] = append(out[name], srv.AllocationCount())
		}
	}
	return out
}

// QuotaServers are the quota counter's identities of a listener's read
// loops, in the order of Allocations.
func (s *Set) QuotaServers(name string) []quota.Server {
	s.mu.Lock()
	defer s.mu.Unlock()
	if ls, ok := s.byName[name]; ok {
		return append([]quota.Server(nil), ls.quotas...)
	}
	return nil
}
