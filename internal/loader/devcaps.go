package loader

import (
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/l7mp/stunnerd-xdp/bpf"
	"github.com/l7mp/stunnerd-xdp/internal/xdpfeatures"
)

// devCaps keeps the program's dev_caps map true for every device of the
// namespace it was started in: how the program runs there (native, generic,
// not attached), whether an XDP frame sent out of it is transmitted, and its
// MTU. The program relays into a device only when the frame will leave (see
// bpf/maps.h); any device may be the FIB's egress, so all are written (a hash
// map of ifindexes: cheap). It follows rtnetlink link events (devices added,
// deleted, their MTU) and the netdev family's notifications (a veth's
// NDO_XMIT comes and goes with its peer's XDP program), re-reads everything
// on each (coalesced), and bumps the FIB generation whenever an entry
// changed, so that cached next hops, which carry the decision, are decided
// again. Below 6.3 (no xdp-features) it decides per device from what it can
// read instead (devcaps_fallback.go) and reads again every fallbackPoll.
// It also tells how the stack filters each device's packets by reverse path
// (devcaps_rp.go), following the rp_filter sysctls and the IPv4 addresses.
type devCaps struct {
	caps   *ebpf.Map
	fibGen *bpf.FibGen
	log    *slog.Logger
	rtnl   *netlink.Handle
	feat   *xdpfeatures.Client // nil: the kernel reports no XDP features
	fb     *fallback           // without feat: what the devices tell otherwise
	watch  *xdpfeatures.Watcher
	rp     *rpWatch
	stop   chan struct{}
	kick   chan struct{}
	wg     sync.WaitGroup

	mu      sync.Mutex
	modes   map[int]Mode
	written map[uint32]bpf.RelayDevCap
	rpBlind bool // the reverse-path settings were not readable (warned)
}

// startDevCaps starts keeping the dev_caps map of the calling thread's
// network namespace, with modes the attachments so far. It returns once the
// map is written and every subscription is up.
func startDevCaps(caps *ebpf.Map, fibGen *bpf.FibGen, modes map[int]Mode, log *slog.Logger) (*devCaps, error) {
	// Sockets belong to the namespace of the thread that opens them: the
	// caller's. Opening them "at" a namespace handle would setns, which
	// needs CAP_SYS_ADMIN, beyond the DaemonSet's BPF, NET_ADMIN, PERFMON.
	rtnl, err := netlink.NewHandle(unix.NETLINK_ROUTE)
	if err != nil {
		return nil, fmt.Errorf("device capabilities: netlink: %w", err)
	}
	d := &devCaps{caps: caps, fibGen: fibGen, log: log, rtnl: rtnl, stop: make(chan struct{}),
		kick: make(chan struct{}, 1), modes: modes, written: map[uint32]bpf.RelayDevCap{}}
	feat, err := dialXDPFeatures()
	switch {
	case errors.Is(err, xdpfeatures.ErrUnsupported):
		if d.fb, err = newFallback(); err != nil {
			log.Warn("the kernel does not report which devices transmit XDP frames (Linux 6.3+), nor can they be read otherwise: from natively attached interfaces nothing is redirected or sent back (XDP_TX); use --xdp-mode=generic", "error", err)
			break
		}
		log.Info("the kernel does not report which devices transmit XDP frames (Linux 6.3+): deciding per device (a veth whose peer runs XDP in its driver, a NIC of a known driver running XDP in its driver); others get no redirected frame",
			"every", fallbackPoll.String())
	case err != nil:
		rtnl.Close()
		return nil, fmt.Errorf("device capabilities: %w", err)
	default:
		d.feat = feat
		if d.watch, err = xdpfeatures.Watch(func(xdpfeatures.Event) { d.poke() }); err != nil {
			d.close()
			return nil, fmt.Errorf("device capabilities: notifications: %w", err)
		}
	}
	if d.rp, err = dialRPWatch(); err != nil {
		d.close()
		return nil, fmt.Errorf("device capabilities: reverse-path filter: %w", err)
	}
	updates := make(chan netlink.LinkUpdate, 64)
	done := make(chan struct{})
	err = netlink.LinkSubscribeWithOptions(updates, done, netlink.LinkSubscribeOptions{
		ErrorCallback: func(err error) { log.Debug("netlink link events for device capabilities", "error", err) }})
	if err != nil {
		d.close()
		return nil, fmt.Errorf("device capabilities: link events: %w", err)
	}
	d.sync()
	d.wg.Add(3)
	go func() {
		defer d.wg.Done()
		d.rp.follow(d.stop, d.poke, log)
	}()
	go func() {
		defer d.wg.Done()
		for {
			select {
			case <-d.stop:
				close(done)
				for range updates { // closed by the receiver once the socket is
				}
				return
			case _, ok := <-updates:
				d.poke()
				if !ok {
					// The subscription broke: netdev notifications and
					// attachments still re-read everything.
					log.Warn("netlink link events ended: device capabilities follow only XDP feature notifications and attachments")
					<-d.stop
					close(done)
					return
				}
			}
		}
	}()
	go func() {
		defer d.wg.Done()
		var poll <-chan time.Time // nil with xdp-features: notifications say
		if d.fb != nil {
			t := time.NewTicker(fallbackPoll)
			defer t.Stop()
			poll = t.C
		}
		for {
			select {
			case <-d.stop:
				return
			case <-d.kick:
			case <-poll:
			}
			d.sync()
		}
	}()
	return d, nil
}

// poke asks for a re-read (coalesced: one pending at most).
func (d *devCaps) poke() {
	select {
	case d.kick <- struct{}{}:
	default:
	}
}

// setModes records the attachments (ifindex -> mode) and writes the map
// before returning.
func (d *devCaps) setModes(modes map[int]Mode) {
	d.mu.Lock()
	d.modes = modes
	d.mu.Unlock()
	d.sync()
}

// capOf is the dev_caps entry of a device: features as the kernel reports
// them (known false: nothing known).
func capOf(l netlink.Link, mode Mode, features xdpfeatures.Act, known bool) bpf.RelayDevCap {
	v := bpf.RelayDevCap{Mtu: uint32(l.Attrs().MTU)}
	if xmitNeedsRoute(l) {
		v.Flags |= bpf.RelayDevFlagDEV_XMIT_NEEDS_ROUTE
	}
	switch mode {
	case ModeNative:
		v.Flags |= bpf.RelayDevFlagDEV_ATTACHED_NATIVE
	case ModeGeneric:
		v.Flags |= bpf.RelayDevFlagDEV_ATTACHED_GENERIC
	}
	if !known {
		return v
	}
	if features&xdpfeatures.NDOXmit != 0 {
		v.Flags |= bpf.RelayDevFlagDEV_XDP_XMIT
	}
	// XDP_TX out of a veth is a transmit into its peer (veth_xdp_tx ->
	// veth_xdp_xmit), dropped unless the peer can receive XDP frames: what
	// NDO_XMIT says. A driver with native XDP (Basic) transmits XDP_TX on its
	// own queues (ndo_xdp_xmit or not: mlx4 has XDP_TX without it).
	tx := features&xdpfeatures.Basic != 0
	if l.Type() == "veth" {
		tx = features&xdpfeatures.NDOXmit != 0
	}
	if tx {
		v.Flags |= bpf.RelayDevFlagDEV_XDP_TX
	}
	return v
}

// xmitNeedsRoute tells a device whose transmit takes the outer destination
// from the route attached to the skb: an ip_tunnel-based IP tunnel (ipip,
// sit, ip6tnl, gre, ip6gre) without a fixed remote end (Calico's tunl0, an
// NBMA GRE). ip_tunnel_xmit and ip6_tnl_xmit drop an skb without a dst
// there (tx_fifo_errors, tx_carrier_errors): what a TC redirect without
// bpf_redirect_neigh hands them. An Ethernet-over-GRE device (gretap) routes
// no inner IP packet: not one of them.
func xmitNeedsRoute(l netlink.Link) bool {
	switch t := l.(type) {
	case *netlink.Iptun:
		return t.Remote == nil || t.Remote.IsUnspecified()
	case *netlink.Sittun:
		return t.Remote == nil || t.Remote.IsUnspecified()
	case *netlink.Ip6tnl:
		return t.Remote == nil || t.Remote.IsUnspecified()
	case *netlink.Gretun: // gre, ip6gre (gretap is a *netlink.Gretap)
		return t.Remote == nil || t.Remote.IsUnspecified()
	}
	return false
}

// sync reads every device and its features and writes what changed.
func (d *devCaps) sync() {
	d.mu.Lock()
	defer d.mu.Unlock()
	links, err := d.rtnl.LinkList()
	if err != nil {
		d.log.Warn("device capabilities: cannot list the devices; keeping what the program has", "error", err)
		return
	}
	var features map[int]xdpfeatures.Act
	if d.fb != nil {
		features = d.fb.features(links, d.modes)
	}
	if d.feat != nil {
		if features, err = d.feat.Dump(); err != nil {
			// Nothing is known until the next read works: conservative.
			d.log.Warn("device capabilities: cannot read XDP features; treating every device as transmitting none", "error", err)
			features = nil
		}
	}
	rp, err := d.rp.read(d.rtnl)
	switch {
	case err != nil && !d.rpBlind:
		// Unknown is strict everywhere (rpFlags of nil): the program then
		// checks every IPv4 packet and passes more to the stack, never less.
		d.log.Warn("device capabilities: cannot read the reverse-path filter settings; treating every device as filtering strictly until they can be read", "error", err)
		d.rpBlind = true
	case err == nil && d.rpBlind:
		d.log.Info("device capabilities: the reverse-path filter settings are readable again")
		d.rpBlind = false
	}
	want := make(map[uint32]bpf.RelayDevCap, len(links))
	filters := false // some device filters by reverse path
	for _, l := range links {
		idx := l.Attrs().Index
		f, known := features[idx]
		v := capOf(l, d.modes[idx], f, known)
		v.Flags |= rp.rpFlags(idx)
		filters = filters || v.Flags&(bpf.RelayDevFlagDEV_RP_STRICT|bpf.RelayDevFlagDEV_RP_LOOSE) != 0
		want[uint32(idx)] = v
	}
	changed := false
	for k, v := range want {
		if old, ok := d.written[k]; ok && old == v {
			continue
		}
		if err := d.caps.Put(k, v); err != nil {
			d.log.Warn("device capabilities: cannot write; the program treats the device as transmitting no XDP frame", "ifindex", k, "error", err)
			delete(want, k)
			continue
		}
		changed = true
	}
	for k := range d.written {
		if _, ok := want[k]; ok {
			continue
		}
		if err := d.caps.Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			d.log.Warn("device capabilities: cannot remove a gone device", "ifindex", k, "error", err)
		}
		changed = true
	}
	d.written = want
	// After the entries: the program looks at them only with the flag set.
	if err := d.fibGen.SetReversePath(filters); err != nil {
		// Generation 0 carries no flag: the program looks at every entry.
		d.log.Warn("device capabilities: cannot tell the program whether a device filters by reverse path; turned the next-hop cache off", "error", err)
		_ = d.fibGen.Disable()
	}
	if changed {
		if err := d.fibGen.Invalidate(); err != nil {
			d.log.Warn("device capabilities changed but the next-hop cache cannot be invalidated; turned it off", "error", err)
		}
	}
}

// close stops following and closes the sockets.
func (d *devCaps) close() {
	select {
	case <-d.stop:
	default:
		close(d.stop)
	}
	if d.watch != nil {
		_ = d.watch.Close()
	}
	d.wg.Wait()
	if d.feat != nil {
		_ = d.feat.Close()
	}
	if d.fb != nil {
		d.fb.close()
	}
	if d.rp != nil {
		d.rp.close()
	}
	d.rtnl.Close()
}

// XDPFeatures says whether the kernel reports which devices transmit XDP
// frames (netdev xdp-features, 6.3+); without them dev_caps comes from the
// fallback (devcaps_fallback.go). It asks in the calling thread's namespace.
func XDPFeatures() bool {
	c, err := dialXDPFeatures()
	if err != nil {
		return false
	}
	_ = c.Close()
	return true
}
