package loader

import (
	"errors"
	"fmt"
	"log/slog"
	"path"
	"runtime"
	"strings"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// Discover keeps the engine attached to the interfaces that match the
// patterns (MatchIface; DefaultTCPatterns: every pod's host-side veth,
// "pod:veth", and tunnel devices by kind, "kind:vxlan", "kind:geneve",
// "kind:ipip", "kind:wireguard") as
// they come and go, until stop is closed: it attaches to those present now,
// then follows the namespace's link events (a new, renamed or changed device
// that matches is attached, with clsact after clsactSettle; a deleted one's
// attachment is forgotten, so that a device reusing its ifindex is attached
// afresh). Call it from the interfaces' network namespace; it returns once
// the subscription stands. Discovery ends when stop is closed; done (when not
// nil) is closed once it has (no attach after).
func (t *TC) Discover(stop <-chan struct{}, patterns []string, log *slog.Logger) error {
	return t.discover(stop, nil, patterns, log)
}

func (t *TC) discover(stop <-chan struct{}, done chan<- struct{}, patterns []string, log *slog.Logger) error {
	if len(patterns) == 0 {
		if done != nil {
			close(done)
		}
		return nil
	}
	if _, err := t.AttachMatching(patterns...); err != nil {
		log.Warn("TC engine: some matching interfaces could not be attached", "error", err)
	}
	ns, err := netns.Get()
	if err != nil {
		return fmt.Errorf("TC discovery: %w", err)
	}
	updates := make(chan netlink.LinkUpdate, 256)
	unsubscribe := make(chan struct{})
	// The socket is made on this thread, in the caller's namespace (a
	// Namespace option would setns, which needs CAP_SYS_ADMIN).
	err = netlink.LinkSubscribeWithOptions(updates, unsubscribe, netlink.LinkSubscribeOptions{
		ErrorCallback: func(err error) { log.Debug("TC discovery: netlink link events", "error", err) },
	})
	if err != nil {
		ns.Close()
		if done != nil {
			close(done)
		}
		return fmt.Errorf("TC discovery: subscribe to link events: %w", err)
	}
	ready := make(chan error, 1)
	go func() {
		// Attaching resolves ifindexes in the thread's namespace: this
		// thread stays in the caller's, and dies with the goroutine.
		runtime.LockOSThread()
		defer ns.Close()
		if done != nil {
			defer close(done)
		}
		if err := enterNS(ns); err != nil {
			ready <- err
			close(unsubscribe)
			return
		}
		ready <- nil
		// Devices waiting for t.settle before they are attached, by ifindex.
		pending := map[int]time.Time{}
		for {
			var settled <-chan time.Time
			if len(pending) > 0 {
				settled = time.After(time.Until(earliest(pending)))
			}
			select {
			case <-settled:
				t.attachSettled(pending, patterns, log)
			case <-stop:
				close(unsubscribe)
				for range updates { // closed once the socket is
				}
				return
			case u, ok := <-updates:
				if !ok {
					// The subscription broke: look at what is there now;
					// devices that come later wait for the next Discover.
					log.Warn("TC discovery: link events ended; matching interfaces that appear later are not attached")
					_, _ = t.AttachMatching(patterns...)
					return
				}
				t.linkEvent(u, patterns, pending, log)
			}
		}
	}()
	if err := <-ready; err != nil {
		return fmt.Errorf("TC discovery: enter the namespace: %w", err)
	}
	return nil
}

// linkEvent attaches to a new (or renamed, or changed) matching device, or
// puts it into pending until t.settle has passed, and forgets a deleted one.
func (t *TC) linkEvent(u netlink.LinkUpdate, patterns []string, pending map[int]time.Time, log *slog.Logger) {
	attrs := u.Link.Attrs()
	if u.Header.Type == unix.RTM_DELLINK {
		delete(pending, attrs.Index)
		t.forget(attrs.Index)
		return
	}
	if !MatchIface(patterns, ifaceOf(u.Link)) {
		return
	}
	if t.settle > 0 {
		if _, ok := pending[attrs.Index]; !ok && !t.attachedTo(attrs.Index) {
			pending[attrs.Index] = time.Now().Add(t.settle)
		}
		return
	}
	t.attachNew(attrs.Name, log)
}

// attachSettled attaches the pending devices whose wait is over, if they
// still match.
func (t *TC) attachSettled(pending map[int]time.Time, patterns []string, log *slog.Logger) {
	now := time.Now()
	for ifindex, at := range pending {
		if at.After(now) {
			continue
		}
		delete(pending, ifindex)
		if l, err := netlink.LinkByIndex(ifindex); err == nil && MatchIface(patterns, ifaceOf(l)) {
			t.attachNew(l.Attrs().Name, log)
		}
	}
}

func earliest(pending map[int]time.Time) time.Time {
	var first time.Time
	for _, at := range pending {
		if first.IsZero() || at.Before(first) {
			first = at
		}
	}
	return first
}

// attachNew attaches to a device that just appeared or changed.
func (t *TC) attachNew(name string, log *slog.Logger) {
	// A device just created may not be registered under its name for
	// every lookup yet: a few tries.
	var err error
	for try := 0; try < 5; try++ {
		if err = t.Attach(name); err == nil || errors.Is(err, unix.ENODEV) {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err != nil {
		log.Warn("TC engine: cannot attach to a new interface", "iface", name, "error", err)
	} else {
		log.Debug("TC engine attached", "iface", name)
	}
}

func (t *TC) attachedTo(ifindex int) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	_, ok := t.links[ifindex]
	return ok
}

// KindPrefix starts a pattern that matches an interface by its link kind
// (rtnetlink's IFLA_INFO_KIND, `ip -d link` shows it) instead of its name:
// "kind:vxlan" matches every VXLAN device whatever its name (flannel.1,
// vxlan.calico, cilium_vxlan), "kind:geneve" every Geneve device. The media
// of a peer on another node comes back through such a device, decapsulated,
// when the node's overlay masquerades the relay's packets into the pod
// network (flannel's default): see docs/internals.md, "NAT check".
const KindPrefix = "kind:"

// PodPrefix starts a pattern that matches by link kind as KindPrefix does,
// and only a device whose other end is in another network namespace
// (rtnetlink's IFLA_LINK_NETNSID; `ip link` shows "link-netns"): "pod:veth"
// matches every pod's host-side veth whatever the CNI calls it (Calico cali*,
// Cilium lxc*, EKS's VPC CNI eni*, AKS's Azure CNI azv*, bridge plugins'
// veth*, Antrea's and OVN-Kubernetes' names made from the pod's), and neither
// end of a veth pair whose ends are both in this namespace.
const PodPrefix = "pod:"

// DefaultTCPatterns are the interfaces the TC engine follows by default:
// every pod's host-side veth, every VXLAN and Geneve device, and every IPIP
// and WireGuard device (Calico's tunl0 and wireguard.cali, Cilium's
// cilium_ipip4 and cilium_wg0: devices without a link-layer header, where
// the engine's L3 program runs), where the media of local pods and overlays
// enter.
var DefaultTCPatterns = []string{PodPrefix + "veth", KindPrefix + "vxlan", KindPrefix + "geneve", KindPrefix + "ipip", KindPrefix + "wireguard"}

// IfaceInfo is what the patterns look at.
type IfaceInfo struct {
	Name string
	Kind string // the link kind: "veth", "vxlan"; "" for a device without one (lo, a NIC)
	// PeerElsewhere: the device's other end (a veth's peer) is in another
	// network namespace.
	PeerElsewhere bool
}

func ifaceOf(l netlink.Link) IfaceInfo {
	a := l.Attrs()
	return IfaceInfo{Name: a.Name, Kind: l.Type(), PeerElsewhere: a.NetNsID >= 0}
}

// MatchIface tells whether the interface matches one of the patterns: a
// shell pattern (path.Match) of the name, or KindPrefix or PodPrefix and a
// shell pattern of the kind.
func MatchIface(patterns []string, ifc IfaceInfo) bool {
	for _, p := range patterns {
		subject := ifc.Name
		if k, ok := strings.CutPrefix(p, KindPrefix); ok {
			p, subject = k, ifc.Kind
		} else if k, ok := strings.CutPrefix(p, PodPrefix); ok {
			if !ifc.PeerElsewhere {
				continue
			}
			p, subject = k, ifc.Kind
		}
		if ok, _ := path.Match(p, subject); ok && subject != "" {
			return true
		}
	}
	return false
}

// CheckIfacePatterns returns an error for a pattern MatchIface cannot use.
func CheckIfacePatterns(patterns []string) error {
	for _, p := range patterns {
		k, isKind := strings.CutPrefix(p, KindPrefix)
		if !isKind {
			k, isKind = strings.CutPrefix(p, PodPrefix)
		}
		if _, err := path.Match(k, ""); err != nil {
			return fmt.Errorf("interface pattern %q: %w", p, err)
		}
		if isKind && k == "" {
			return fmt.Errorf("interface pattern %q: no kind: %w", p, path.ErrBadPattern)
		}
	}
	return nil
}

// forget drops the attachment of a device that is gone (the kernel detached
// the program with it): a tcx link is closed, a filter went with the device.
func (t *TC) forget(ifindex int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if a, ok := t.links[ifindex]; ok {
		delete(t.links, ifindex)
		_ = a.hook.detach()
	}
}

// enterNS moves the calling (locked) thread into ns unless it is there
// already: setns needs CAP_SYS_ADMIN, which the DaemonSet does not grant, and
// a daemon's threads all share its namespace (tests that run the engine in a
// namespace of their own do so as root).
func enterNS(ns netns.NsHandle) error {
	cur, err := netns.Get()
	if err != nil {
		return err
	}
	defer cur.Close()
	if cur.Equal(ns) {
		return nil
	}
	return netns.Set(ns)
}
