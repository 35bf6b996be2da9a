package fallback

import (
	"errors"
	"fmt"
	"log/slog"
	"sync"

	"github.com/l7mp/stunnerd-xdp/internal/channelmap"
	"github.com/l7mp/stunnerd-xdp/internal/loader"
	"github.com/l7mp/stunnerd-xdp/internal/mirror"
)

// Switch moves the relay between the XDP path and the userspace path. Sessions
// never notice: pion/turn keeps every allocation and socket either way; only
// where the packets of bound channels are relayed changes. The program is
// loaded on the first Enable and kept (with its maps) until Close, so flipping
// back and forth costs an attach, not a load.
type Switch struct {
	log    *slog.Logger
	mirror *mirror.Mirror
	cfg    loader.Config
	ifaces []string

	mu   sync.Mutex
	prog *loader.Program
	maps *channelmap.Maps
	// offloaded says the mirror writes into maps. It changes only when the
	// program starts or stops running anywhere: moving the bindings costs a
	// write per binding and forgets what the program learned about each.
	offloaded bool
	failed    map[string]string // last attach error per interface, to log each once
}

// NewSwitch builds a switch that starts on the userspace path.
func NewSwitch(log *slog.Logger, m *mirror.Mirror, cfg loader.Config, ifaces []string) *Switch {
	return &Switch{log: log, mirror: m, cfg: cfg, ifaces: ifaces, failed: map[string]string{}}
}

// Enable attaches XDP to the interfaces in the given mode (auto: native, else
// generic). An interface that cannot attach stays on userspace; Enable fails
// only when none could, and then everything stays in userspace. It is called
// again while an interface is missing: what is attached stays as it is.
//
// The bindings go into the maps after the first attach: until then the
// program passes every packet to pion/turn (it knows no binding), which is the
// userspace path, so nothing is lost; installing first would move every
// binding in and out again on each failed retry.
func (s *Switch) Enable(mode loader.Mode) (map[string]loader.Mode, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if mode == loader.ModeOff {
		return s.attachedLocked(), s.disableLocked()
	}
	if len(s.ifaces) == 0 {
		return nil, errors.New("no interfaces to attach XDP to")
	}
	if s.prog == nil {
		prog, err := loader.Load(s.cfg, s.log)
		if err != nil {
			return nil, err
		}
		s.prog, s.maps = prog, channelmap.New(prog.Maps())
	}
	attached := s.prog.Attached()
	var errs []error
	for _, iface := range s.ifaces {
		if got, ok := attached[iface]; ok && (got == mode || mode == loader.ModeAuto) {
			continue
		}
		if _, ok := attached[iface]; ok {
			// A different mode was asked for: reattach.
			if err := s.prog.Detach(iface); err != nil {
				errs = append(errs, err)
				continue
			}
			delete(attached, iface)
		}
		got, err := s.prog.Attach(iface, mode)
		if err != nil {
			errs = append(errs, err)
			// Enable is retried while another daemon holds the interface:
			// say each new reason once.
			if s.failed[iface] != err.Error() {
				s.failed[iface] = err.Error()
				s.log.Warn("XDP not attached, interface served from userspace", "iface", iface, "error", err)
			} else {
				s.log.Debug("XDP still not attached", "iface", iface, "error", err)
			}
			continue
		}
		delete(s.failed, iface)
		attached[iface] = got
		s.log.Info("XDP attached", "iface", iface, "mode", string(got))
	}
	if len(attached) == 0 {
		s.setOffloadLocked(false)
		return nil, fmt.Errorf("no interface took the XDP program: %w", errors.Join(errs...))
	}
	s.setOffloadLocked(true)
	return attached, nil
}

// setOffloadLocked points the mirror at the maps (on) or at nothing, when
// that is a change.
func (s *Switch) setOffloadLocked(on bool) {
	if on == s.offloaded {
		return
	}
	s.offloaded = on
	if on {
		s.mirror.SetOffload(s.maps)
		return
	}
	s.mirror.SetOffload(nil)
}

// Disable detaches XDP everywhere and empties the maps: pion/turn relays all.
func (s *Switch) Disable() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.disableLocked()
}

func (s *Switch) disableLocked() error {
	var errs []error
	// Detach first: until then the kernel relays with complete maps, and after
	// it pion/turn's relay sockets see every packet.
	for iface := range s.attachedLocked() {
		if err := s.prog.Detach(iface); err != nil {
			errs = append(errs, err)
		}
		s.log.Info("XDP detached", "iface", iface)
	}
	s.setOffloadLocked(false)
	return errors.Join(errs...)
}

// Close detaches and frees the program and its maps.
func (s *Switch) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	err := s.disableLocked()
	if s.prog != nil {
		err = errors.Join(err, s.prog.Close())
		s.prog, s.maps = nil, nil
	}
	return err
}

// Attached returns the mode of each interface the program runs on now, by the
// interfaces' current names: one renamed since the attach is listed under its
// new name, one deleted is not listed.
func (s *Switch) Attached() map[string]loader.Mode {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.attachedLocked()
}

func (s *Switch) attachedLocked() map[string]loader.Mode {
	if s.prog == nil {
		return map[string]loader.Mode{}
	}
	return s.prog.Attached()
}

// Missing returns the managed interfaces the program is not attached to.
func (s *Switch) Missing() []string {
	attached := s.Attached()
	var out []string
	for _, iface := range s.ifaces {
		if _, ok := attached[iface]; !ok {
			out = append(out, iface)
		}
	}
	return out
}

// Maps returns the binding maps, nil until the program was first loaded.
func (s *Switch) Maps() *channelmap.Maps {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.maps
}

// Interfaces returns the interfaces the switch manages.
func (s *Switch) Interfaces() []string { return append([]string(nil), s.ifaces...) }

// Reconfigure changes the program's load-time configuration (UDP listener
// ports). A loaded program is reloaded over its maps and swapped into its
// links; otherwise the next Enable loads with the new configuration.
func (s *Switch) Reconfigure(cfg loader.Config) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.cfg = cfg
	if s.prog == nil {
		return nil
	}
	return s.prog.Reconfigure(cfg)
}
