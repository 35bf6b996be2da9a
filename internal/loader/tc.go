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
// attached at ingress with tcx, or where the kernel has no tcx (before 6.6)
// with a cls_bpf filter on a clsact qdisc (TCAttach). It shares every map with
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
// configuration (listener ports, relay range, flow cache seed), attached with
// tcx where the kernel has it, else clsact (LoadTCWith). After the XDP
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
	tcx := tcxSupported(t.objs.TcTurnRelay)
	switch how {
	case TCAttachAuto:
		how = TCAttachClsact
		if tcx {
			how = TCAttachTCX
		}
	case TCAttachTCX:
		if !tcx {
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
	var moved []tcHook
	for _, a := range t.links {
		if err := a.hook.update(next.TcTurnRelay); err != nil {
			for _, h := range moved {
				_ = h.update(t.objs.TcTurnRelay)
			}
			_ = next.Close()
			return fmt.Errorf("swap the TC program on %s: %w", a.name, err)
		}
		moved = append(moved, a.hook)
	}
	// The maps in next are clones of ours: close them, keep the program.
	_ = next.RelayTcMaps.Close()
	old := t.objs.TcTurnRelay
	t.objs.TcTurnRelay = next.TcTurnRelay
	return old.Close()
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

// Prog returns the TC program (for BPF_PROG_RUN in tests).
func (t *TC) Prog() *ebpf.Program { return t.objs.TcTurnRelay }

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
	var hook tcHook
	if t.how == TCAttachClsact {
		hook, err = attachClsact(ifc.Index, t.owner.handle, t.objs.TcTurnRelay)
	} else {
		var l link.Link
		l, err = link.AttachTCX(link.TCXOptions{Program: t.objs.TcTurnRelay, Attach: ebpf.AttachTCXIngress, Interface: ifc.Index})
		hook = tcxHook{l}
	}
	if err != nil {
		return fmt.Errorf("attach TC (%s) to %s: %w", t.how, iface, err)
	}
	t.links[ifc.Index] = tcAttachment{hook: hook, name: iface}
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
