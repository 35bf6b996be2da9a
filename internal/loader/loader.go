// Package loader loads the XDP relay program, attaches it to interfaces through
// bpf_links held by this process (a crash closes them and so detaches the
// program), and detaches it again. It detects what each interface supports by
// trying: native first, then generic, then nothing (the userspace path). From
// the first attachment on it keeps the program's view of the namespace's
// devices live (dev_caps: the attachment modes, which devices transmit XDP
// frames, MTUs; devcaps.go) and the FIB generation moving (fibwatch.go).
// Attach every interface from one network namespace: both follow the first
// attachment's.
package loader

import (
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"math/bits"
	"os"
	"runtime"
	"strings"
	"sync"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/btf"
	"github.com/cilium/ebpf/link"
	"github.com/cilium/ebpf/rlimit"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/l7mp/stunnerd-xdp/bpf"
	"github.com/l7mp/stunnerd-xdp/internal/byteorder"
)

// Mode is how the program runs on an interface.
type Mode string

const (
	ModeAuto    Mode = "auto"    // native, else generic, else userspace
	ModeNative  Mode = "native"  // in the driver
	ModeGeneric Mode = "generic" // in the stack, after the skb is built
	ModeOff     Mode = "off"     // not attached: pion/turn relays everything
	// ModeTC is not asked for, only reported (Engines.Attached): another
	// program holds the interface's XDP hook (another Gateway's daemon on
	// the node), so the TC engine relays there alone.
	ModeTC Mode = "tc"
)

// ErrXDPBusy: another XDP program holds the interface's hook (another
// daemon on the node: a second Gateway, or the previous pod of a rolling
// update). The hook takes one program; tcx takes several (Engines).
var ErrXDPBusy = errors.New("another XDP program holds the interface")

// ParseMode parses --xdp-mode.
func ParseMode(s string) (Mode, error) {
	switch m := Mode(strings.ToLower(strings.TrimSpace(s))); m {
	case ModeAuto, ModeNative, ModeGeneric, ModeOff:
		return m, nil
	}
	return "", fmt.Errorf("invalid XDP mode %q: want auto, native, generic or off", s)
}

// Config is fixed at load time: the verifier sees it as constants.
type Config struct {
	ListenerPorts []uint16
	MinRelayPort  uint16
	MaxRelayPort  uint16
	// MaxBindings sizes the binding maps and counters.
	MaxBindings uint32
	// IPv6Clients says a listener takes IPv6: replies to those clients need
	// IPv6 forwarding on the peer-facing interfaces too (it is only checked).
	IPv6Clients bool
	// NoFlowCache leaves the flow caches unused: every packet takes the hash
	// lookups (for measuring what the caches save).
	NoFlowCache bool
	// TCNoKfunc makes the TC engine read the kernel's skb with
	// bpf_probe_read_kernel, as it does on kernels without the kfunc
	// bpf_cast_to_kern_ctx (before 6.2), even where the kernel has it (tests
	// run that path here).
	TCNoKfunc bool
	// Object is a relay object file built from other sources, loaded instead
	// of the embedded one (benchmarks measure two builds side by side over
	// one set of maps). Its maps must match the embedded object's.
	Object string
	// AllocFlows is the daemon's allocation table (internal/allocflows),
	// NodeFlows the listener steering's steer_flows: the maps the listener
	// shield reads as alloc_flows and node_flows. Nil: the program's own,
	// empty (the shield then must not test allocations).
	AllocFlows, NodeFlows *ebpf.Map
}

// Program is the loaded relay program and its maps.
type Program struct {
	objs        bpf.RelayObjects
	fibGen      *bpf.FibGen   // over objs.FibGen
	charge      *ebpf.Program // bpf/charge.c over objs' rate-limit maps
	log         *slog.Logger
	ipv6Clients bool

	mu sync.Mutex
	// links are keyed by ifindex: a bpf_link holds a device, not a name. A
	// renamed interface keeps its attachment; a deleted one loses it.
	links map[int]attachment
	// fibStop ends the FIB watcher (started with the first attachment) that
	// keeps the program's next-hop cache valid.
	fibStop  chan struct{}
	watching bool
	// fibMu orders the watcher's calls against Close: a call in flight
	// finishes before the maps close, and none runs after (fibClosed).
	fibMu     sync.Mutex
	fibClosed bool
	// caps keeps dev_caps true for the attachments' namespace (started
	// with the first attachment).
	caps *devCaps
}

type attachment struct {
	link link.Link
	mode Mode
	name string // the device's name when last looked at
	// rtnl looks the device up in the namespace it was attached in, whatever
	// thread asks.
	rtnl *netlink.Handle
}

// Load loads the program and creates its maps.
func Load(cfg Config, log *slog.Logger) (*Program, error) {
	// Kernels before 5.11 charge BPF memory to RLIMIT_MEMLOCK.
	if err := rlimit.RemoveMemlock(); err != nil {
		return nil, fmt.Errorf("remove memlock limit: %w", err)
	}
	p := &Program{log: log, links: make(map[int]attachment), ipv6Clients: cfg.IPv6Clients, fibStop: make(chan struct{})}
	if err := load(cfg, &p.objs, nil); err != nil {
		return nil, err
	}
	p.fibGen = bpf.NewFibGen(p.objs.FibGen)
	// Without it userspace could not charge the engines' buckets, and an
	// allocation would have two budgets: no kernel path rather than that.
	charge, err := loadCharge(&p.objs.RelayMaps)
	if err != nil {
		p.objs.Close()
		return nil, err
	}
	p.charge = charge
	return p, nil
}

// load loads the program with cfg into objs, creating maps or reusing the
// given ones.
func load(cfg Config, objs *bpf.RelayObjects, reuse *bpf.RelayMaps) error {
	if len(cfg.ListenerPorts) == 0 || len(cfg.ListenerPorts) > int(maxListenerPorts()) {
		return fmt.Errorf("need 1 to %d UDP listener ports, have %d", maxListenerPorts(), len(cfg.ListenerPorts))
	}
	if cfg.MinRelayPort == 0 || cfg.MaxRelayPort < cfg.MinRelayPort {
		return fmt.Errorf("invalid relay port range %d-%d", cfg.MinRelayPort, cfg.MaxRelayPort)
	}
	if cfg.MaxBindings == 0 {
		return errors.New("max bindings must be positive")
	}
	spec, err := relaySpec(cfg.Object)
	if err != nil {
		return err
	}
	var c bpf.RelayConfig
	for i, p := range cfg.ListenerPorts {
		c.ListenerPorts[i] = byteorder.Htons(p)
	}
	c.ListenerPortCount = uint16(len(cfg.ListenerPorts))
	c.MinRelayPort = cfg.MinRelayPort
	c.MaxRelayPort = cfg.MaxRelayPort
	// x86 keeps loads and stores in order (TSO): the program reads cached
	// next hops under their sequence count, without the lock. Weaker orders
	// (arm64) take the lock: BPF has no read barrier.
	if runtime.GOARCH == "amd64" || runtime.GOARCH == "386" {
		c.Tso = 1
	}
	// The flow caches: as many entries per CPU as bindings, up to the
	// program's FLOW_CACHE_SLOTS, a power of two (the index is the top
	// flow_shift bits of a hash).
	slots := flowSlots(cfg.MaxBindings, spec.Maps[bpf.RelayMapC2pFlows].MaxEntries)
	cpus, err := ebpf.PossibleCPU()
	if err != nil {
		return fmt.Errorf("flow caches: %w", err)
	}
	// A region of slots entries per possible CPU, at the CPU's number.
	spec.Maps[bpf.RelayMapC2pFlows].MaxEntries = slots * uint32(cpus)
	spec.Maps[bpf.RelayMapP2cFlows].MaxEntries = slots * uint32(cpus)
	c.FlowShift = uint32(bits.TrailingZeros32(slots))
	if !cfg.NoFlowCache {
		c.FlowCache = 1
	}
	// The TC engine takes its configuration from this one (LoadTC).
	if cfg.TCNoKfunc || !HaveCastToKernCtx() {
		c.TcNoKfunc = 1
	}
	var seed [4]byte
	if _, err := rand.Read(seed[:]); err != nil {
		return fmt.Errorf("flow cache seed: %w", err)
	}
	c.FlowSeed = binary.LittleEndian.Uint32(seed[:])
	if err := spec.Variables[bpf.RelayVarCfg].Set(c); err != nil {
		return fmt.Errorf("set program config: %w", err)
	}
	for _, name := range []string{bpf.RelayMapC2pBindings, bpf.RelayMapP2cBindings, bpf.RelayMapBindingStates, bpf.RelayMapAllocRates} {
		spec.Maps[name].MaxEntries = cfg.MaxBindings
	}
	opts := &ebpf.CollectionOptions{Programs: ebpf.ProgramOptions{LogLevel: verifierLogLevel}, MapReplacements: map[string]*ebpf.Map{}}
	if reuse != nil {
		opts.MapReplacements = map[string]*ebpf.Map{
			bpf.RelayMapShields:       reuse.Shields,
			bpf.RelayMapShieldScratch: reuse.ShieldScratch,
			bpf.RelayMapAllocFlows:    reuse.AllocFlows,
			bpf.RelayMapNodeFlows:     reuse.NodeFlows,
			bpf.RelayMapC2pBindings:   reuse.C2pBindings,
			bpf.RelayMapP2cBindings:   reuse.P2cBindings,
			bpf.RelayMapVerdicts:      reuse.Verdicts,
			bpf.RelayMapTxPorts:       reuse.TxPorts,
			bpf.RelayMapListenerDsts:  reuse.ListenerDsts,
			bpf.RelayMapWirePorts:     reuse.WirePorts,
			bpf.RelayMapNatRelayPorts: reuse.NatRelayPorts,
			bpf.RelayMapBindingStates: reuse.BindingStates,
			bpf.RelayMapFibGen:        reuse.FibGen,
			bpf.RelayMapRateLimits:    reuse.RateLimits,
			bpf.RelayMapAllocRates:    reuse.AllocRates,
			bpf.RelayMapDevCaps:       reuse.DevCaps,
			// Entries are self-describing: the new seed only moves where
			// a key's entry is looked for.
			bpf.RelayMapC2pFlows: reuse.C2pFlows,
			bpf.RelayMapP2cFlows: reuse.P2cFlows,
		}
	}
	if cfg.AllocFlows != nil {
		opts.MapReplacements[bpf.RelayMapAllocFlows] = cfg.AllocFlows
	}
	if cfg.NodeFlows != nil {
		opts.MapReplacements[bpf.RelayMapNodeFlows] = cfg.NodeFlows
	}
	if err := spec.LoadAndAssign(objs, opts); err != nil {
		var ve *ebpf.VerifierError
		if errors.As(err, &ve) {
			return fmt.Errorf("load XDP program: %w\n%s", err, strings.Join(ve.Log, "\n")) // the whole verifier log
		}
		return fmt.Errorf("load XDP program: %w", err)
	}
	return nil
}

// HaveCastToKernCtx tells whether the kernel has the kfunc
// bpf_cast_to_kern_ctx (6.2+), through which the TC engine reads the skb's
// checksum state; without it the engine reads it with bpf_probe_read_kernel.
// The kernel's BTF is read once (cilium/ebpf caches it).
func HaveCastToKernCtx() bool {
	spec, err := btf.LoadKernelSpec()
	if err != nil {
		return false
	}
	var fn *btf.Func
	return spec.TypeByName("bpf_cast_to_kern_ctx", &fn) == nil
}

// verifierLogLevel is the verifier log asked for when loading the relay and
// charge programs: none, except in the tests that read the verifier's
// statistics on kernels that do not report them otherwise (before 5.16).
var verifierLogLevel ebpf.LogLevel

// relaySpec reads the embedded relay object, or the one at path.
func relaySpec(path string) (*ebpf.CollectionSpec, error) {
	embedded, err := bpf.LoadRelay()
	if err != nil {
		return nil, fmt.Errorf("read program spec: %w", err)
	}
	if path == "" {
		return embedded, nil
	}
	spec, err := ebpf.LoadCollectionSpec(path)
	if err != nil {
		return nil, fmt.Errorf("read relay object %s: %w", path, err)
	}
	for name, m := range embedded.Maps {
		// Sizes are the loader's; the layout must be the embedded one's,
		// which the Go side writes.
		got, ok := spec.Maps[name]
		if !ok {
			return nil, fmt.Errorf("relay object %s: no map %s", path, name)
		}
		if got.Type != m.Type || got.KeySize != m.KeySize || got.ValueSize != m.ValueSize || got.Flags != m.Flags {
			return nil, fmt.Errorf("relay object %s: map %s is %v key %d value %d flags %#x, want %v key %d value %d flags %#x",
				path, name, got.Type, got.KeySize, got.ValueSize, got.Flags, m.Type, m.KeySize, m.ValueSize, m.Flags)
		}
	}
	if _, ok := spec.Programs[bpf.RelayProgXdpTurnRelay]; !ok {
		return nil, fmt.Errorf("relay object %s: no program %s", path, bpf.RelayProgXdpTurnRelay)
	}
	return spec, nil
}

// flowSlots is the power of two at or above bindings (at least 64), capped.
func flowSlots(bindings, limit uint32) uint32 {
	n := uint32(64)
	for n < bindings && n < limit {
		n <<= 1
	}
	return min(n, limit)
}

// Reconfigure loads the program again with a new configuration (listener
// ports, relay range) over the same maps, and swaps it into every attachment
// atomically through its bpf_link: bindings, counters and attachments carry
// over, no packet sees a detached interface. MaxBindings cannot change.
func (p *Program) Reconfigure(cfg Config) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if cfg.MaxBindings != p.objs.C2pBindings.MaxEntries() {
		return fmt.Errorf("max bindings cannot change while running (%d -> %d)", p.objs.C2pBindings.MaxEntries(), cfg.MaxBindings)
	}
	var next bpf.RelayObjects
	if err := load(cfg, &next, &p.objs.RelayMaps); err != nil {
		return err
	}
	p.refreshLocked()
	var moved []link.Link
	for _, a := range p.links {
		if err := a.link.Update(next.XdpTurnRelay); err != nil {
			// Put the links already moved back on the old program: one
			// program everywhere, with the old configuration.
			for _, l := range moved {
				_ = l.Update(p.objs.XdpTurnRelay)
			}
			_ = next.Close()
			return fmt.Errorf("swap the program on %s: %w", a.name, err)
		}
		moved = append(moved, a.link)
	}
	// The maps in next are clones of ours: close them, keep the new program.
	_ = next.RelayMaps.Close()
	old := p.objs.XdpTurnRelay
	p.objs.XdpTurnRelay = next.XdpTurnRelay
	// The configuration it runs with (TC.Reconfigure loads the TC engine with it).
	p.objs.RelayVariables = next.RelayVariables
	return old.Close()
}

func maxListenerPorts() uint16 { return uint16(len(bpf.RelayConfig{}.ListenerPorts)) }

// Maps returns the program's maps.
func (p *Program) Maps() *bpf.RelayMaps { return &p.objs.RelayMaps }

// Charge returns the charge program (bpf/charge.c), which userspace runs to
// charge an allocation's bucket in alloc_rates (channelmap.Maps.SetCharge).
func (p *Program) Charge() *ebpf.Program { return p.charge }

// FibGen returns the program's FIB generation, which every writer that
// invalidates its caches shares (channelmap.Maps.SetFibGen).
func (p *Program) FibGen() *bpf.FibGen { return p.fibGen }

// XDP returns the program itself (for BPF_PROG_RUN in tests and benchmarks).
func (p *Program) XDP() *ebpf.Program { return p.objs.XdpTurnRelay }

// Attach attaches the program to the interface in the given mode (auto tries
// native, then generic) and adds the interface to the redirect devmap. It
// returns the mode it got. Call it from the interface's network namespace.
func (p *Program) Attach(iface string, mode Mode) (Mode, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	// An attachment to a device that is gone must not hide a new device of
	// the same name (or a reused ifindex).
	p.refreshLocked()
	ifc, err := interfaceByName(iface)
	if err != nil {
		return ModeOff, err
	}
	if a, ok := p.links[ifc.Index]; ok {
		return a.mode, nil
	}
	var tries []Mode
	switch mode {
	case ModeAuto:
		tries = []Mode{ModeNative, ModeGeneric}
	case ModeNative, ModeGeneric:
		tries = []Mode{mode}
	default:
		return ModeOff, fmt.Errorf("attach %s: invalid mode %q", iface, mode)
	}
	var errs []error
	for _, m := range tries {
		flags := link.XDPDriverMode
		if m == ModeGeneric {
			flags = link.XDPGenericMode
		}
		l, err := link.AttachXDP(link.XDPOptions{Program: p.objs.XdpTurnRelay, Interface: ifc.Index, Flags: flags})
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", m, err))
			continue
		}
		rtnl, err := netlink.NewHandle(unix.NETLINK_ROUTE)
		if err != nil {
			_ = l.Close()
			return ModeOff, fmt.Errorf("attach XDP to %s: netlink: %w", iface, err)
		}
		// The devmap resolves the ifindex in the writer's namespace: ours.
		if err := p.objs.TxPorts.Put(uint32(ifc.Index), uint32(ifc.Index)); err != nil {
			rtnl.Close()
			_ = l.Close()
			return ModeOff, fmt.Errorf("add %s to the redirect map: %w", iface, err)
		}
		p.links[ifc.Index] = attachment{link: l, mode: m, name: iface, rtnl: rtnl}
		if err := p.capsChangedLocked(); err != nil {
			_ = p.detachLocked(ifc.Index)
			return ModeOff, fmt.Errorf("attach XDP to %s: %w", iface, err)
		}
		p.fibChangedLocked()
		if !forwardingOn("ipv4", iface) {
			p.log.Warn("IPv4 forwarding is off on the interface: bpf_fib_lookup answers FWD_DISABLED and every packet goes to userspace; set net.ipv4.conf."+iface+".forwarding=1",
				"iface", iface)
		}
		if p.ipv6Clients && !forwardingOn("ipv6", iface) {
			p.log.Warn("IPv6 forwarding is off on the interface: replies to IPv6 clients that arrive here go to userspace; set net.ipv6.conf."+iface+".forwarding=1",
				"iface", iface)
		}
		return m, nil
	}
	err = errors.Join(errs...)
	// The kernel refuses a link over a program (EBUSY), and generic beside
	// native (EEXIST): either way the hook is another program's.
	if errors.Is(err, unix.EBUSY) || errors.Is(err, unix.EEXIST) {
		return ModeOff, fmt.Errorf("attach XDP to %s: %w: %w", iface, ErrXDPBusy, err)
	}
	return ModeOff, fmt.Errorf("attach XDP to %s: %w", iface, err)
}

// Detach detaches the program from the interface of that name (its current
// name, as Attached reports it).
func (p *Program) Detach(iface string) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.refreshLocked()
	for ifindex, a := range p.links {
		if a.name == iface {
			return p.detachLocked(ifindex)
		}
	}
	return nil
}

func (p *Program) detachLocked(ifindex int) error {
	a, ok := p.links[ifindex]
	if !ok {
		return nil
	}
	delete(p.links, ifindex)
	a.rtnl.Close()
	var errs []error
	if err := p.objs.TxPorts.Delete(uint32(ifindex)); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		errs = append(errs, fmt.Errorf("remove %s from the redirect map: %w", a.name, err))
	}
	// A next hop cached through it must be looked up again (and passed).
	if err := p.fibGen.Invalidate(); err != nil {
		errs = append(errs, err)
	}
	if err := a.link.Close(); err != nil {
		errs = append(errs, fmt.Errorf("detach XDP from %s: %w", a.name, err))
	}
	if p.caps != nil {
		p.caps.setModes(p.modesLocked())
	}
	return errors.Join(errs...)
}

// modesLocked returns the attachments' modes by ifindex.
func (p *Program) modesLocked() map[int]Mode {
	modes := make(map[int]Mode, len(p.links))
	for ifindex, a := range p.links {
		modes[ifindex] = a.mode
	}
	return modes
}

// capsChangedLocked writes the attachments into dev_caps; the first one
// starts following the devices of its namespace (the caller's).
func (p *Program) capsChangedLocked() error {
	if p.caps != nil {
		p.caps.setModes(p.modesLocked())
		return nil
	}
	c, err := startDevCaps(p.objs.DevCaps, p.fibGen, p.modesLocked(), p.log)
	if err != nil {
		return err
	}
	p.caps = c
	return nil
}

// refreshLocked asks the kernel where each link still is. A deleted device
// takes its XDP program with it (the link stays, pointing nowhere: ifindex 0);
// such links are closed and forgotten. A renamed device keeps its program and
// is reported under its new name.
func (p *Program) refreshLocked() {
	for ifindex, a := range p.links {
		info, err := a.link.Info()
		if err != nil {
			p.log.Debug("cannot read the XDP link; assuming it still holds", "iface", a.name, "error", err)
			continue
		}
		if x := info.XDP(); x == nil || int(x.Ifindex) != ifindex {
			// The kernel removed the device's devmap entry with the device.
			p.log.Warn("XDP program gone with its interface", "iface", a.name, "ifindex", ifindex)
			if err := p.detachLocked(ifindex); err != nil {
				p.log.Debug("closing the link of a gone interface", "iface", a.name, "error", err)
			}
			continue
		}
		if l, err := a.rtnl.LinkByIndex(ifindex); err == nil && l.Attrs().Name != a.name {
			p.log.Info("XDP interface renamed, still attached", "from", a.name, "to", l.Attrs().Name, "ifindex", ifindex)
			a.name = l.Attrs().Name
			p.links[ifindex] = a
		}
	}
}

// fibChangedLocked is called when the devmap gained an interface: cached next
// hops are resolved again. The first attachment starts following the FIB's
// changes from the interfaces' namespace (the caller's), which turns the
// program's next-hop cache on; without that the cache stays off and every
// packet takes bpf_fib_lookup.
func (p *Program) fibChangedLocked() {
	if p.watching {
		if err := p.fibGen.Invalidate(); err != nil {
			p.log.Warn("cannot invalidate the next-hop cache; turned it off", "error", err)
		}
		return
	}
	fibGen := p.fibGen
	err := WatchFIB(p.fibStop, func() {
		p.fibMu.Lock()
		defer p.fibMu.Unlock()
		if p.fibClosed {
			return // its goroutines may outlive the stop by one call
		}
		if err := fibGen.Enable(); err != nil {
			p.log.Warn("cannot invalidate the next-hop cache; turning it off", "error", err)
			_ = fibGen.Disable()
		}
	}, p.log)
	if err != nil {
		p.log.Warn("no rtnetlink events: the next-hop cache stays off (every packet takes bpf_fib_lookup)", "error", err)
		return
	}
	p.watching = true
}

// Attached returns the mode of every interface the program is attached to
// now, under the interfaces' current names.
func (p *Program) Attached() map[string]Mode {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.refreshLocked()
	out := make(map[string]Mode, len(p.links))
	for _, a := range p.links {
		out[a.name] = a.mode
	}
	return out
}

// Close detaches from every interface and frees the program and its maps.
func (p *Program) Close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	var errs []error
	for ifindex := range p.links {
		errs = append(errs, p.detachLocked(ifindex))
	}
	if p.watching {
		close(p.fibStop)
		p.watching = false
	}
	p.fibMu.Lock()
	p.fibClosed = true
	p.fibMu.Unlock()
	if p.caps != nil {
		p.caps.close()
		p.caps = nil
	}
	errs = append(errs, p.charge.Close(), p.objs.Close())
	return errors.Join(errs...)
}

func forwardingOn(family, iface string) bool {
	b, err := os.ReadFile("/proc/sys/net/" + family + "/conf/" + iface + "/forwarding")
	return err == nil && strings.TrimSpace(string(b)) == "1"
}
