package daemon

import (
	"time"

	"github.com/l7mp/stunnerd-xdp/internal/allocflows"
	"github.com/l7mp/stunnerd-xdp/internal/channelmap"
	"github.com/l7mp/stunnerd-xdp/internal/loader"
	"github.com/l7mp/stunnerd-xdp/internal/shield"
)

// The listener shield (bpf/relay.c listener_shield) drops at the UDP
// listeners what pion/turn would discard unanswered. Its test of allocations
// reads the daemon's table (internal/allocflows), which outlives every load
// of the programs, and the node's (the steering's steer_flows: during a
// rolling update the other daemon's clients pass through this daemon's
// programs too). It tests them only while the table holds every allocation
// of this daemon.

// openAllocations creates the table before the listeners take allocations,
// and the read loops' shield over it.
func (d *Daemon) openAllocations() {
	t, err := allocflows.New(d.allocationsChanged)
	if err != nil {
		d.log.Debug("no allocation map: the kernel's shield passes ChannelData of every client", "error", err)
	}
	d.allocs = t
	if cfg := d.config(); !cfg.NoListenerShield {
		d.shield = shield.New(t, &d.counters.Shield, cfg.AdmissionRate, cfg.AdmissionBurst)
	}
}

// closeAllocations frees the table once the listeners are closed.
func (d *Daemon) closeAllocations() {
	d.allocs.Close()
}

// program is the programs' load-time configuration, with the maps the
// shield shares.
func (d *Daemon) program(c *Config) loader.Config {
	p := c.loaderConfig()
	p.AllocFlows = d.allocs.Map()
	if d.steer != nil {
		p.NodeFlows = d.steer.FlowMap()
	}
	return p
}

// allocationsChanged follows the table's completeness into the programs.
func (d *Daemon) allocationsChanged() {
	if m := d.dests.maps.Load(); m != nil {
		d.setShield(m)
	}
}

// setShield sets the shield of the maps as the configuration and the table
// say.
func (d *Daemon) setShield(m *channelmap.Maps) {
	on := !d.config().NoListenerShield
	allocs := d.allocs.Map() != nil && d.allocs.Complete()
	if on && d.allocs.Map() != nil && !allocs {
		d.log.Warn("listener shield: an allocation is missing from its table, so ChannelData passes to pion/turn whatever its client until that allocation ends")
	}
	s := channelmap.Shield{Junk: on, Allocations: allocs}
	if r := d.config().AdmissionRate; r > 0 {
		s.AdmitCost = time.Duration(float64(time.Second) / r)
		s.AdmitBurst = time.Duration(max(d.config().AdmissionBurst-1, 0)) * s.AdmitCost
	}
	if err := m.SetShield(s); err != nil {
		d.log.Warn("listener shield not set: the programs pass what pion/turn discards", "error", err)
	}
}
