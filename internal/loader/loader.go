// Package loader loads the XDP relay program, attaches it to interfaces through
// bpf_links held by this process (a crash closes them and so detaches the
// program), and detaches it again. It detects what each interface supports by
// trying: native first, then generic, then nothing (the userspace path).
package loader

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"sync"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/cilium/ebpf/rlimit"

	"github.com/l7mp/stunnerd-xdp/bpf"
)

// Mode is how the program runs on an interface.
type Mode string

const (
	ModeAuto    Mode = "auto"    // native, else generic, else userspace
	ModeNative  Mode = "native"  // in the driver
	ModeGeneric Mode = "generic" // in the stack, after the skb is built
	ModeOff     Mode = "off"     // not attached: pion/turn relays everything
)

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
}

// Program is the loaded relay program and its maps.
type Program struct {
	objs        bpf.RelayObjects
	log         *slog.Logger
	ipv6Clients bool

	mu    sync.Mutex
	links map[string]attachment
}

type attachment struct {
	link    link.Link
	mode    Mode
	ifindex int
}

// Load loads the program and creates its maps.
func Load(cfg Config, log *slog.Logger) (*Program, error) {
	// Kernels before 5.11 charge BPF memory to RLIMIT_MEMLOCK.
	if err := rlimit.RemoveMemlock(); err != nil {
		return nil, fmt.Errorf("remove memlock limit: %w", err)
	}
	p := &Program{log: log, links: make(map[string]attachment), ipv6Clients: cfg.IPv6Clients}
	if err := load(cfg, &p.objs, nil); err != nil {
		return nil, err
	}
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
	spec, err := bpf.LoadRelay()
	if err != nil {
		return fmt.Errorf("read program spec: %w", err)
	}
	var c bpf.RelayConfig
	for i, p := range cfg.ListenerPorts {
		c.ListenerPorts[i] = htons(p)
	}
	c.ListenerPortCount = uint16(len(cfg.ListenerPorts))
	c.MinRelayPort = cfg.MinRelayPort
	c.MaxRelayPort = cfg.MaxRelayPort
	if err := spec.Variables[bpf.RelayVarCfg].Set(c); err != nil {
		return fmt.Errorf("set program config: %w", err)
	}
	for _, name := range []string{bpf.RelayMapC2pBindings, bpf.RelayMapP2cBindings, bpf.RelayMapBindingCounters} {
		spec.Maps[name].MaxEntries = cfg.MaxBindings
	}
	var opts *ebpf.CollectionOptions
	if reuse != nil {
		opts = &ebpf.CollectionOptions{MapReplacements: map[string]*ebpf.Map{
			bpf.RelayMapC2pBindings:     reuse.C2pBindings,
			bpf.RelayMapP2cBindings:     reuse.P2cBindings,
			bpf.RelayMapBindingCounters: reuse.BindingCounters,
			bpf.RelayMapVerdicts:        reuse.Verdicts,
			bpf.RelayMapTxPorts:         reuse.TxPorts,
			bpf.RelayMapListenerDsts:    reuse.ListenerDsts,
		}}
	}
	if err := spec.LoadAndAssign(objs, opts); err != nil {
		var ve *ebpf.VerifierError
		if errors.As(err, &ve) {
			return fmt.Errorf("load XDP program: %+v", ve)
		}
		return fmt.Errorf("load XDP program: %w", err)
	}
	return nil
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
	var moved []link.Link
	for name, a := range p.links {
		if err := a.link.Update(next.XdpTurnRelay); err != nil {
			// Put the links already moved back on the old program: one
			// program everywhere, with the old configuration.
			for _, l := range moved {
				_ = l.Update(p.objs.XdpTurnRelay)
			}
			_ = next.Close()
			return fmt.Errorf("swap the program on %s: %w", name, err)
		}
		moved = append(moved, a.link)
	}
	// The maps in next are clones of ours: close them, keep the new program.
	_ = next.RelayMaps.Close()
	old := p.objs.XdpTurnRelay
	p.objs.XdpTurnRelay = next.XdpTurnRelay
	return old.Close()
}

func maxListenerPorts() uint16 { return uint16(len(bpf.RelayConfig{}.ListenerPorts)) }

func htons(v uint16) uint16 { return v<<8 | v>>8 }

// Maps returns the program's maps.
func (p *Program) Maps() *bpf.RelayMaps { return &p.objs.RelayMaps }

// XDP returns the program itself (for BPF_PROG_RUN in tests and benchmarks).
func (p *Program) XDP() *ebpf.Program { return p.objs.XdpTurnRelay }

// Attach attaches the program to the interface in the given mode (auto tries
// native, then generic) and adds the interface to the redirect devmap. It
// returns the mode it got. Call it from the interface's network namespace.
func (p *Program) Attach(iface string, mode Mode) (Mode, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if a, ok := p.links[iface]; ok {
		return a.mode, nil
	}
	ifc, err := interfaceByName(iface)
	if err != nil {
		return ModeOff, err
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
		// The devmap resolves the ifindex in the writer's namespace: ours.
		if err := p.objs.TxPorts.Put(uint32(ifc.Index), uint32(ifc.Index)); err != nil {
			_ = l.Close()
			return ModeOff, fmt.Errorf("add %s to the redirect map: %w", iface, err)
		}
		p.links[iface] = attachment{link: l, mode: m, ifindex: ifc.Index}
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
	return ModeOff, fmt.Errorf("attach XDP to %s: %w", iface, errors.Join(errs...))
}

// Detach detaches the program from one interface.
func (p *Program) Detach(iface string) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.detachLocked(iface)
}

func (p *Program) detachLocked(iface string) error {
	a, ok := p.links[iface]
	if !ok {
		return nil
	}
	delete(p.links, iface)
	var errs []error
	if err := p.objs.TxPorts.Delete(uint32(a.ifindex)); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		errs = append(errs, fmt.Errorf("remove %s from the redirect map: %w", iface, err))
	}
	if err := a.link.Close(); err != nil {
		errs = append(errs, fmt.Errorf("detach XDP from %s: %w", iface, err))
	}
	return errors.Join(errs...)
}

// Attached returns the mode of every interface the program is attached to.
func (p *Program) Attached() map[string]Mode {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make(map[string]Mode, len(p.links))
	for name, a := range p.links {
		out[name] = a.mode
	}
	return out
}

// Close detaches from every interface and frees the program and its maps.
func (p *Program) Close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	var errs []error
	for name := range p.links {
		errs = append(errs, p.detachLocked(name))
	}
	errs = append(errs, p.objs.Close())
	return errors.Join(errs...)
}

func forwardingOn(family, iface string) bool {
	b, err := os.ReadFile("/proc/sys/net/" + family + "/conf/" + iface + "/forwarding")
	return err == nil && strings.TrimSpace(string(b)) == "1"
}
