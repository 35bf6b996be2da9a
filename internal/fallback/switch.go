package fallback

import (
	"errors"
	"fmt"
	"log/slog"
	"sync"

	"github.com/l7mp/stunnerd-xdp/internal/channelmap"
	"github.com/l7mp/stunnerd-xdp/internal/control"
	"github.com/l7mp/stunnerd-xdp/internal/loader"
)

// Switch moves the relay between the XDP path and the userspace path. Sessions
// never notice: pion/turn keeps every allocation and socket either way; only
// where the packets of bound channels are relayed changes.
type Switch struct {
	log    *slog.Logger
	mirror *control.Mirror
	prog   *loader.Program
	maps   *channelmap.Maps
	ifaces []string

	mu       sync.Mutex
	attached map[string]loader.Mode
}

// NewSwitch builds a switch over a loaded program (nil when XDP could not even
// be loaded: the switch then stays on userspace).
func NewSwitch(log *slog.Logger, mirror *control.Mirror, prog *loader.Program, maps *channelmap.Maps, ifaces []string) *Switch {
	return &Switch{log: log, mirror: mirror, prog: prog, maps: maps, ifaces: ifaces, attached: map[string]loader.Mode{}}
}

// Enable attaches XDP to the interfaces in the given mode. Bindings are
// installed before the first attach so the kernel path is complete when it
// starts. An interface that cannot attach stays on userspace; Enable fails
// only when none could.
func (s *Switch) Enable(mode loader.Mode) (map[string]loader.Mode, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if mode == loader.ModeOff {
		return s.attachedCopy(), s.disableLocked()
	}
	if s.prog == nil {
		return nil, errors.New("XDP program is not loaded")
	}
	s.mirror.SetOffload(s.maps)
	var errs []error
	for _, iface := range s.ifaces {
		got, err := s.prog.Attach(iface, mode)
		if err != nil {
			errs = append(errs, err)
			s.log.Warn("XDP not attached, interface served from userspace", "iface", iface, "error", err)
			continue
		}
		s.attached[iface] = got
		s.log.Info("XDP attached", "iface", iface, "mode", string(got))
	}
	if len(s.attached) == 0 {
		s.mirror.SetOffload(nil)
		return nil, fmt.Errorf("no interface took the XDP program: %w", errors.Join(errs...))
	}
	return s.attachedCopy(), nil
}

// Disable detaches XDP everywhere and empties the maps: pion/turn relays all.
func (s *Switch) Disable() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.disableLocked()
}

func (s *Switch) disableLocked() error {
	var errs []error
	if s.prog != nil {
		// Detach first: until then the kernel relays with complete maps.
		for iface := range s.attached {
			if err := s.prog.Detach(iface); err != nil {
				errs = append(errs, err)
			}
			s.log.Info("XDP detached", "iface", iface)
		}
	}
	s.attached = map[string]loader.Mode{}
	s.mirror.SetOffload(nil)
	return errors.Join(errs...)
}

// Attached returns the mode each interface runs in.
func (s *Switch) Attached() map[string]loader.Mode {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.attachedCopy()
}

func (s *Switch) attachedCopy() map[string]loader.Mode {
	out := make(map[string]loader.Mode, len(s.attached))
	for k, v := range s.attached {
		out[k] = v
	}
	return out
}

// Interfaces returns the interfaces the switch manages.
func (s *Switch) Interfaces() []string { return append([]string(nil), s.ifaces...) }
