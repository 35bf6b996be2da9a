package loader

import (
	"errors"
	"fmt"
	"reflect"
	"strings"
	"sync"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"

	"github.com/l7mp/stunnerd-xdp/bpf"
)

// TC is the second kernel engine (bpf/relay_tc.c): the relay on the skb path,
// attached at ingress as a cls_bpf filter on a clsact qdisc, after every
// other filter (TCAttach: tcx only where asked). It shares every map with
// the XDP program it was loaded for (bindings, states, counters, rate limits,
// flow caches), and reaches any egress (bpf_redirect), so it relays where XDP
// cannot transmit: a pod's veth, a tunnel or bridge device, and traffic
// entering on a pod's host-side veth, where no XDP program runs.
type TC struct {
	objs bpf.RelayTcObjects
	// how is TCAttachTCX or TCAttachClsact, for every interface.
	how TCAttach
	// owner holds the handle of the engine's cls_bpf filters (clsact).
	owner *tcOwner
	// swept are the interfaces a crashed daemon's filters were removed from
	// at load, sweepErr what failed there (clsact).
	swept    []string
	sweepErr error
	// settle is how long discovery waits before it attaches to a device that
	// appeared (clsact: clsactSettle).
	settle time.Duration

	mu sync.Mutex
	// links are keyed by ifindex, as the XDP program's.
	links map[int]tcAttachment
}

type tcAttachment struct {
	hook tcHook
	name string
	// l3: the device has no link-layer header (tc_turn_relay_l3 runs there).
	l3 bool
}

// clsactSettle is how long the engine leaves a new device alone before it
// adds a clsact qdisc there: a CNI chain's bandwidth plugin adds its own
// ingress qdisc to a pod's host-side veth right after the veth appears, with
// an exclusive create that fails (and the pod's network setup with it) where
// a clsact qdisc is already in place. Later the engine's filter goes onto the
// plugin's qdisc, after its filter. Media a pod sends in its first seconds
// goes through userspace.
const clsactSettle = 5 * time.Second

// LoadTC loads the TC engine over the XDP program's maps, with its
// configuration (listener ports, relay range, flow cache seed), attached as
// a cls_bpf filter after every other (TCAttachAuto, LoadTCWith). After the XDP
// program's Reconfigure, call the engine's Reconfigure.
func (p *Program) LoadTC() (*TC, error) { return p.LoadTCWith(TCAttachAuto) }

// LoadTCWith is LoadTC with the way the engine attaches: TCAttachTCX fails
// with ebpf.ErrNotSupported on a kernel without tcx. With clsact, the
// engine's filters that a crashed daemon left in the caller's network
// namespace are removed (Swept).
func (p *Program) LoadTCWith(how TCAttach) (*TC, error) {
	t := &TC{links: map[int]tcAttachment{}}
	if err := loadTC(p, &t.objs, nil); err != nil {
		return nil, err
	}
	if err := t.chooseAttach(how); err != nil {
		_ = t.objs.Close()
		return nil, err
	}
	return t, nil
}

// chooseAttach settles how the engine attaches, once for all interfaces.
func (t *TC) chooseAttach(how TCAttach) error {
	switch how {
	case TCAttachAuto:
		how = TCAttachClsact
	case TCAttachTCX:
		if !tcxSupported(t.objs.TcTurnRelay) {
			return fmt.Errorf("attach the TC engine with tcx (kernel 6.6+): %w", ebpf.ErrNotSupported)
		}
	case TCAttachClsact:
	default:
		return fmt.Errorf("invalid TC attach %q", how)
	}
	t.how = how
	if how != TCAttachClsact {
		return nil
	}
	owner, err := claimFreeHandle()
	if err != nil {
		return err
	}
	t.owner, t.settle = owner, clsactSettle
	t.swept, t.sweepErr = sweepClsact(owner)
	return nil
}

// AttachMethod is how the engine attaches: TCAttachTCX or TCAttachClsact.
func (t *TC) AttachMethod() TCAttach { return t.how }

// Swept returns the interfaces from which the load removed a crashed
// daemon's filters (clsact), and what failed there.
func (t *TC) Swept() ([]string, error) { return t.swept, t.sweepErr }

// loadTC loads the engine into objs with p's maps and configuration, and the
// engine's own maps from own when given (a reload keeps its counters).
func loadTC(p *Program, objs *bpf.RelayTcObjects, own *bpf.RelayTcMaps) error {
	spec, err := bpf.LoadRelayTc()
	if err != nil {
		return fmt.Errorf("read TC program spec: %w", err)
	}
	var c bpf.RelayConfig
	if err := p.objs.Cfg.Get(&c); err != nil {
		return fmt.Errorf("read the XDP program's config: %w", err)
	}
	if err := spec.Variables[bpf.RelayTcVarCfg].Set(bpf.RelayTcConfig(c)); err != nil {
		return fmt.Errorf("set TC program config: %w", err)
	}
	shared := mapsByName(&p.objs.RelayMaps)
	if own != nil {
		shared[bpf.RelayTcMapTcVerdicts] = own.TcVerdicts
		shared[bpf.RelayTcMapTcScratch] = own.TcScratch
	}
	repl := map[string]*ebpf.Map{}
	for name, ms := range spec.Maps {
		m, ok := shared[name]
		if !ok {
			continue // the engine's own (tc_verdicts, tc_scratch) and .rodata
		}
		// Sized by the loader from the XDP program's configuration.
		ms.MaxEntries = m.MaxEntries()
		repl[name] = m
	}
	if err := spec.LoadAndAssign(objs, &ebpf.CollectionOptions{MapReplacements: repl}); err != nil {
		var ve *ebpf.VerifierError
		if errors.As(err, &ve) {
			return fmt.Errorf("load TC program: %w\n%s", err, strings.Join(ve.Log, "\n"))
		}
		return fmt.Errorf("load TC program: %w", err)
	}
	return nil
}

// Reconfigure loads the engine again with the XDP program's current
// configuration (after its Reconfigure) and swaps it into every attachment
// (the tcx link's update, the cls_bpf filter's replace): no packet sees a
// detached interface. The engine's own maps (its counters) carry over.
func (t *TC) Reconfigure(p *Program) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	var next bpf.RelayTcObjects
	if err := loadTC(p, &next, &t.objs.RelayTcMaps); err != nil {
		return err
	}
	var moved []tcAttachment
	for _, a := range t.links {
		if err := a.hook.update(progFor(&next, a.l3)); err != nil {
			for _, m := range moved {
				_ = m.hook.update(progFor(&t.objs, m.l3))
			}
			_ = next.Close()
			return fmt.Errorf("swap the TC program on %s: %w", a.name, err)
		}
		moved = append(moved, a)
	}
	// The maps in next are clones of ours: close them, keep the programs.
	_ = next.RelayTcMaps.Close()
	old := t.objs.RelayTcPrograms
	t.objs.RelayTcPrograms = next.RelayTcPrograms
	return old.Close()
}

// progFor is the engine's program for a device with an Ethernet header, or
// without a link-layer header (l3).
func progFor(objs *bpf.RelayTcObjects, l3 bool) *ebpf.Program {
	if l3 {
		return objs.TcTurnRelayL3
	}
	return objs.TcTurnRelay
}

// ErrLinkLayer: the engine reads no skb of this device's link layer (it
// knows Ethernet and none).
var ErrLinkLayer = errors.New("link layer the TC engine does not read")

// linkLayerL3 tells whether a device of that link type (netlink's name of its
// ARPHRD type) gives TC ingress programs an skb that starts at the IP header
// (no header_ops): tunl0 (ipip), WireGuard and tun (none), GRE, SIT, ip6
// tunnels, PPP, raw IP. Ethernet and loopback devices give the Ethernet header.
func linkLayerL3(encap string) (bool, error) {
	switch encap {
	case "ether", "loopback":
		return false, nil
	case "none", "ipip", "tunnel6", "gre", "ip6gre", "sit", "ppp", "unknown519" /* ARPHRD_RAWIP */ :
		return true, nil
	}
	return false, fmt.Errorf("%w: %s", ErrLinkLayer, encap)
}

// mapsByName lists the maps of a bpf2go Maps struct by their names in the
// object (the ebpf struct tags).
func mapsByName(ms *bpf.RelayMaps) map[string]*ebpf.Map {
	out := map[string]*ebpf.Map{}
	v := reflect.ValueOf(ms).Elem()
	for i := range v.NumField() {
		if m, ok := v.Field(i).Interface().(*ebpf.Map); ok && m != nil {
			out[v.Type().Field(i).Tag.Get("ebpf")] = m
		}
	}
	return out
}

// Prog returns the TC program for devices with an Ethernet header (for
// BPF_PROG_RUN in tests).
func (t *TC) Prog() *ebpf.Program { return t.objs.TcTurnRelay }

// ProgL3 returns the TC program for devices without a link-layer header.
func (t *TC) ProgL3() *ebpf.Program { return t.objs.TcTurnRelayL3 }

// Verdicts returns the TC engine's verdict counters, summed over CPUs,
// indexed by reason (bpf.RelayReason below bpf.RelayTcTcReasonTC_REASON_GSO,
// bpf.RelayTcTcReason from it).
func (t *TC) Verdicts() ([]uint64, error) {
	n := bpf.RelayTcTcReasonTC_REASON_MAX
	out := make([]uint64, n)
	for r := range uint32(n) {
		var per []uint64
		if err := t.objs.TcVerdicts.Lookup(r, &per); err != nil {
			return nil, fmt.Errorf("TC verdict %d: %w", r, err)
		}
		for _, c := range per {
			out[r] += c
		}
	}
	return out, nil
}

// Attach attaches the engine at the interface's ingress (AttachMethod: tcx
// after any program already there, or a cls_bpf filter after every filter
// there). Call it from the interface's network namespace.
func (t *TC) Attach(iface string) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	ifc, err := interfaceByName(iface)
	if err != nil {
		return err
	}
	if a, ok := t.links[ifc.Index]; ok {
		a.name = iface // renamed, still attached
		t.links[ifc.Index] = a
		return nil
	}
	nl, err := netlink.LinkByIndex(ifc.Index)
	if err != nil {
		return fmt.Errorf("interface %q: %w", iface, err)
	}
	l3, err := linkLayerL3(nl.Attrs().EncapType)
	if err != nil {
		return fmt.Errorf("attach TC to %s: %w", iface, err)
	}
	prog := progFor(&t.objs, l3)
	var hook tcHook
	if t.how == TCAttachClsact {
		hook, err = attachClsact(ifc.Index, t.owner.handle, prog)
	} else {
		var l link.Link
		l, err = link.AttachTCX(link.TCXOptions{Program: prog, Attach: ebpf.AttachTCXIngress, Interface: ifc.Index})
		hook = tcxHook{l}
	}
	if err != nil {
		return fmt.Errorf("attach TC (%s) to %s: %w", t.how, iface, err)
	}
	t.links[ifc.Index] = tcAttachment{hook: hook, name: iface, l3: l3}
	return nil
}

// Detach detaches the engine from the interface of that name.
func (t *TC) Detach(iface string) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	for ifindex, a := range t.links {
		if a.name == iface {
			delete(t.links, ifindex)
			return a.hook.detach()
		}
	}
	return nil
}

// Attached returns the names of the interfaces the engine is attached to.
func (t *TC) Attached() []string {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := make([]string, 0, len(t.links))
	for _, a := range t.links {
		out = append(out, a.name)
	}
	return out
}

// Close detaches the engine everywhere (removing its filters: clsact) and
// frees it (the shared maps stay with the XDP program).
func (t *TC) Close() error {
	t.mu.Lock()
	defer t.mu.Unlock()
	var errs []error
	for ifindex, a := range t.links {
		delete(t.links, ifindex)
		errs = append(errs, a.hook.detach())
	}
	errs = append(errs, t.objs.Close())
	t.owner.release()
	t.owner = nil
	return errors.Join(errs...)
}

// AttachMatching attaches the engine to every interface that matches one of
// the patterns (see MatchIface: "pod:veth", link kinds such as "kind:vxlan",
// names such as "cali*"): pods' host-side veths and tunnel devices, where
// the media of local pods and overlays enters. It returns the
// names it attached to now; Discover follows the interfaces that come later.
func (t *TC) AttachMatching(patterns ...string) ([]string, error) {
	if err := CheckIfacePatterns(patterns); err != nil {
		return nil, err
	}
	links, err := netlink.LinkList()
	if err != nil {
		return nil, fmt.Errorf("list interfaces: %w", err)
	}
	var attached []string
	var errs []error
	for _, l := range links {
		name := l.Attrs().Name
		if !MatchIface(patterns, ifaceOf(l)) {
			continue
		}
		if err := t.Attach(name); err != nil {
			errs = append(errs, err)
		} else {
			attached = append(attached, name)
		}
	}
	return attached, errors.Join(errs...)
}
