package daemon

import (
	"sync/atomic"

	"github.com/l7mp/stunnerd-xdp/internal/channelmap"
	"github.com/l7mp/stunnerd-xdp/internal/destinations"
	"github.com/l7mp/stunnerd-xdp/internal/mirror"
)

// destinationSync keeps the XDP program's table of accepted destinations
// (which wire address:port reaches which UDP listener) in step with the
// listeners, the node's addresses and the VIPs allocations come through.
type destinationSync struct {
	tracker *destinations.Tracker
	// maps is the offload manager's binding maps once it loaded them: the tracker
	// pushes there from its own goroutine.
	maps atomic.Pointer[channelmap.Maps]
}

// startDestinations starts the tracker for the configured UDP listeners; it
// runs before the listeners so that their first allocations are seen.
func (d *Daemon) startDestinations() {
	d.dests = &destinationSync{}
	d.dests.tracker = destinations.New(destinations.Config{
		Sink: d.dests.push,
		Log:  d.config().Logger.Slog("destinations"),
	}, d.config().udpListenerAddrs())
}

func (s *destinationSync) push(t destinations.Table) error {
	m := s.maps.Load()
	if m == nil {
		return nil // no maps yet: SetMaps resyncs when they come
	}
	return m.SetDestinations(t)
}

// mapWriters are where the offload manager, the maps' one owner, hands them:
// the mirror's bindings go there while the program runs anywhere, the tables
// below from the load on.
type mapWriters struct{ d *Daemon }

func (w mapWriters) SetOffload(o mirror.Offload) { w.d.mirror.SetOffload(o) }

// SetMaps points the tables at the maps the manager loaded (nil: freed):
// the accepted destinations, the accounts and the rate limit, which pion's
// relay sockets charge in the kernel's maps from now on (one bucket per
// allocation for both paths), or in their own while there are none.
func (w mapWriters) SetMaps(o mirror.Offload) {
	d := w.d
	m, _ := o.(*channelmap.Maps)
	d.dests.maps.Store(m)
	d.rateLimit.SetKernel(nil)
	if m == nil {
		return
	}
	m.SetAccount(d.traffic.Account)
	// New maps start without a limit; a reload keeps them, and this.
	if err := m.SetRateLimit(d.config().RateLimit); err != nil {
		d.log.Warn("XDP rate limit not set: the kernel relays without it", "error", err)
	} else {
		d.rateLimit.SetKernel(m)
	}
	d.setShield(m)
	d.dests.tracker.Resync()
}

// closeDestinations stops the tracker before the offload manager frees the maps.
func (d *Daemon) closeDestinations() {
	d.dests.maps.Store(nil)
	d.rateLimit.SetKernel(nil)
	d.dests.tracker.Close()
}

// Destinations returns the accepted destinations the daemon computed last.
func (d *Daemon) Destinations() destinations.Table { return d.dests.tracker.Table() }
