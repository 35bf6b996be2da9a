// Package steering lets two stunnerd-xdp processes serve the same TURN
// listener addresses on one node, which is what a rolling update with surge
// does: the new pod starts while the old one drains.
//
// Every listener socket is bound with SO_REUSEPORT and registered in a
// reuseport socket array shared through pinned maps (one directory per network
// namespace). An SK_REUSEPORT program (bpf/steer.c) sends a UDP client that has
// an allocation to the process that owns the allocation, and everything else
// (new clients, STUN Binding, TCP connections) to the socket registered last:
// the new process takes every new session, the old one keeps its own until
// they end.
//
// # Who takes the new flows
//
// The steer_active entry of a group names the sockets new flows go to. A
// process holds it while it is in service and nobody newer is: its
// generation, fixed at Open, is above every generation registered in the
// maps before it (the start time, or one more than the newest seen, so a
// clock step back cannot make a newer process older). Each process re-asserts
// the entry periodically (Assert), not only at Register: the entry is taken
// when it is missing, names an empty slot (the socket closed: its process
// exited or was killed, kill -9 included, since the kernel empties the
// reuseport array slot when the socket goes) or names an older generation.
// So a newer process that lost the entry (an older one restarted during the
// overlap, then retired and deleted it) takes it back within an interval.
//
// The states of one process, as the daemon drives them:
//
//	serving      registered, not retired: holds the entry unless a newer
//	             serving process does
//	draining     Retire: never takes the entry; its clients keep coming
//	             (steer_flows); a successor is a live socket of another
//	             process named by the entry (Successor)
//	standing in  Unretire after every socket of every newer process vanished
//	             (Newer: the successor died, not merely retired): serving
//	             again until a newer process registers, when the daemon
//	             retires it again
//
// Liveness is the reuseport array itself: a slot holds a socket exactly as
// long as the socket is open, which no heartbeat or clock can fake or delay.
//
// # Several Gateways on a node
//
// The daemons of every Gateway of a node share the directory, each in its
// own groups (listener ports). A process stands in only for a newer process
// of its own groups: Newer reads the group of each slot from steer_slot_grp,
// a map this package creates beside the program's (the program does not
// read it, and the pinned maps' layouts stay those of earlier versions, which
// keep working in the same directory and ignore it). A slot claimed by such
// a version has no record of its socket there: its group is unknown, and it
// counts for every process, as all slots did before.
//
// # Locks and the pin directory
//
// Processes serialise changes under flock(2) on the directory's registry
// subdirectory, and hold a shared flock on the directory for their lifetime
// (the last one out removes the pins). Every flock is taken with LOCK_NB and
// retried until a deadline (ErrLockTimeout), so a holder that hangs cannot
// hang the others. The directories must be owned by the process's user (or
// root) and writable by nobody else (ErrUnsafeDir): whoever can write there
// can replace the pinned maps and steer the node's TURN traffic.
package steering

import (
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"structs"
	"sync"
	"syscall"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/btf"
	"golang.org/x/sys/unix"

	"github.com/l7mp/stunnerd-xdp/bpf"
)

// Errors callers branch on.
var (
	// ErrLockTimeout: another process held the steering lock past the
	// deadline.
	ErrLockTimeout = errors.New("steering lock held by another process past the deadline")
	// ErrUnsafeDir: the pin directory is a symlink, or another user owns it
	// or can write to it.
	ErrUnsafeDir = errors.New("unsafe steering pin directory")
	// ErrHandoverUnsupported: the kernel's SO_REUSEPORT programs do not see
	// the listener socket (sk_reuseport_md.sk, Linux 5.14+), whose address
	// the steering program keys its groups by: no listener handover on this
	// node (the listeners bind exclusively). Retrying does not change it.
	ErrHandoverUnsupported = errors.New("listener handover needs sk_reuseport_md.sk (Linux 5.14+)")
)

// reuseportSeesSocket tells whether the kernel gives SO_REUSEPORT programs
// the listener socket (sk_reuseport_md.sk), from its BTF (where the context
// types of every program type are). Without BTF the load itself tells.
func reuseportSeesSocket() bool {
	spec, err := btf.LoadKernelSpec()
	if err != nil {
		return true
	}
	var md *btf.Struct
	if err := spec.TypeByName("sk_reuseport_md", &md); err != nil {
		return true
	}
	return hasMember(md.Members, "sk")
}

// hasMember looks for a member by name, in anonymous unions too (the uapi's
// __bpf_md_ptr wraps each pointer in one).
func hasMember(ms []btf.Member, name string) bool {
	for _, m := range ms {
		if m.Name == name {
			return true
		}
		if u, ok := m.Type.(*btf.Union); ok && m.Name == "" && hasMember(u.Members, name) {
			return true
		}
	}
	return false
}

// DefaultLockTimeout bounds every wait for a steering lock. Holders keep the
// locks for a few map operations.
const DefaultLockTimeout = 5 * time.Second

// Slots is the number of sockets the node's processes can register together.
const Slots = 256

// DefaultDir is the parent of the per-namespace pin directories.
const DefaultDir = "/sys/fs/bpf/stunnerd-xdp"

// DirFor returns the pin directory for the caller's network namespace:
// processes share steering exactly when they share the namespace (hostNetwork
// pods on one node do).
func DirFor(parent string) (string, error) {
	var st unix.Stat_t
	if err := unix.Stat("/proc/self/ns/net", &st); err != nil {
		return "", fmt.Errorf("network namespace: %w", err)
	}
	return filepath.Join(parent, fmt.Sprintf("netns-%d", st.Ino)), nil
}

// Protocol of a listener socket.
type Protocol uint8

const (
	UDP Protocol = unix.IPPROTO_UDP
	TCP Protocol = unix.IPPROTO_TCP
)

// Group is the address and protocol a listener socket is bound to.
type Group struct {
	Protocol Protocol
	Addr     netip.AddrPort
}

func (g Group) key() bpf.SteerGroup { return bpf.FlowGroup(uint8(g.Protocol), g.Addr) }

func (g Group) String() string {
	p := "udp"
	if g.Protocol == TCP {
		p = "tcp"
	}
	return p + "/" + g.Addr.String()
}

// Steering is one process's view of the node's shared steering maps.
type Steering struct {
	dir  string
	lock *os.File // shared lock on dir for the process's lifetime
	objs bpf.SteerObjects
	// slotGroups is steer_slot_grp: per slot, the group of the socket
	// claimed there (slotGroup).
	slotGroups *ebpf.Map
	gen        uint64 // this process's generation: newer ones take the new flows
	// lockTimeout bounds each wait for a flock.
	lockTimeout time.Duration

	mu    sync.Mutex
	slots map[uint32]registration // the slots this process registered
	// sets holds, per group, the active entry naming this process's latest
	// sockets of the group: what Assert writes.
	sets    map[Group]uint32
	retired bool // draining: take no new flows until Unretire

	closeOnce sync.Once
	closeErr  error
}

type registration struct {
	group  Group
	cookie uint64 // of the socket, to tell it from a later one in the slot
}

// slotGroup is a value of steer_slot_grp: the group of the socket with the
// cookie. A record whose cookie is not the slot's socket's is stale: the slot
// was claimed since by a version that does not write the map.
type slotGroup struct {
	_      structs.HostLayout
	Cookie uint64
	Group  bpf.SteerGroup
	_      [4]byte
}

// slotGroupsSpec is steer_slot_grp's layout, which every version that pins it
// must keep: a process that meets a pin of another layout cannot open the
// directory.
var slotGroupsSpec = ebpf.MapSpec{
	Name:       "steer_slot_grp",
	Type:       ebpf.Array,
	KeySize:    4,
	ValueSize:  32,
	MaxEntries: Slots,
	Pinning:    ebpf.PinByName,
}

// Open loads the steering program over the pinned maps in dir, creating them
// (and dir, which must be on a bpffs) if this is the first process.
func Open(dir string) (*Steering, error) { return openWith(dir, DefaultLockTimeout) }

func openWith(dir string, lockTimeout time.Duration) (*Steering, error) {
	if !reuseportSeesSocket() {
		return nil, ErrHandoverUnsupported
	}
	for range 10 {
		s, retry, err := open(dir, lockTimeout)
		if !retry {
			return s, err
		}
	}
	return nil, fmt.Errorf("steering maps in %s: the directory keeps being removed", dir)
}

func open(dir string, lockTimeout time.Duration) (*Steering, bool, error) {
	reg := filepath.Join(dir, "registry")
	if err := os.MkdirAll(reg, 0o700); err != nil {
		return nil, false, fmt.Errorf("steering maps: %w", err)
	}
	// The parent may be shared (a bpffs root is 1777): its sticky bit keeps
	// others from renaming our directory away.
	for _, c := range []struct {
		path   string
		sticky bool
	}{{filepath.Dir(dir), true}, {dir, false}, {reg, false}} {
		if err := checkDir(c.path, c.sticky); err != nil {
			return nil, false, fmt.Errorf("steering maps: %w", err)
		}
	}
	var fs unix.Statfs_t
	if err := unix.Statfs(dir, &fs); err != nil {
		return nil, false, fmt.Errorf("steering maps: %w", err)
	}
	if fs.Type != unix.BPF_FS_MAGIC {
		return nil, false, fmt.Errorf("steering maps: %s is not on a bpf filesystem (mount bpffs on /sys/fs/bpf)", dir)
	}
	f, err := os.Open(dir)
	if err != nil {
		return nil, false, fmt.Errorf("steering maps: %w", err)
	}
	// The last process out removes the pins under an exclusive lock (Close);
	// holding a shared one keeps them while we run.
	if err := flock(f, unix.LOCK_SH, lockTimeout); err != nil {
		f.Close()
		return nil, false, fmt.Errorf("steering maps: lock %s: %w", dir, err)
	}
	if !sameFile(f, dir) {
		f.Close() // removed while we waited for the lock
		return nil, true, nil
	}
	s := &Steering{dir: dir, lock: f, lockTimeout: lockTimeout, slots: map[uint32]registration{}, sets: map[Group]uint32{}}
	opts := &ebpf.CollectionOptions{Maps: ebpf.MapOptions{PinPath: dir}}
	// Under the registry lock: two first processes would both create pins,
	// and a generation must be above those registered before.
	err = s.exclusive(func() error {
		if err := bpf.LoadSteerObjects(&s.objs, opts); err != nil {
			return err
		}
		spec := slotGroupsSpec
		if s.slotGroups, err = ebpf.NewMapWithOptions(&spec, opts.Maps); err != nil {
			s.objs.Close()
			return fmt.Errorf("steering slot groups: %w", err)
		}
		if s.gen, err = s.nextGeneration(); err != nil {
			s.objs.Close()
			s.slotGroups.Close()
			return fmt.Errorf("steering slots: %w", err)
		}
		return nil
	})
	if err != nil {
		f.Close()
		if errors.Is(err, ebpf.ErrMapIncompatible) {
			return nil, false, fmt.Errorf("steering maps in %s were made by an incompatible version: %w", dir, err)
		}
		return nil, false, fmt.Errorf("load the steering program: %w", err)
	}
	return s, false, nil
}

// checkDir refuses a directory another user could change: a symlink, one
// owned by someone other than us or root, or one others can write to (unless
// sticky is allowed and set).
func checkDir(path string, sticky bool) error {
	var st unix.Stat_t
	if err := unix.Lstat(path, &st); err != nil {
		return err
	}
	switch {
	case st.Mode&unix.S_IFMT != unix.S_IFDIR:
		return fmt.Errorf("%w: %s is not a directory", ErrUnsafeDir, path)
	case st.Uid != uint32(os.Geteuid()) && st.Uid != 0:
		return fmt.Errorf("%w: %s is owned by uid %d", ErrUnsafeDir, path, st.Uid)
	case st.Mode&0o022 != 0 && !(sticky && st.Mode&unix.S_ISVTX != 0):
		return fmt.Errorf("%w: %s is writable by group or others (mode %o)", ErrUnsafeDir, path, st.Mode&0o7777)
	}
	return nil
}

// flock takes the lock without blocking in the kernel, retrying until the
// timeout: a holder that hangs makes us fail, not hang.
func flock(f *os.File, how int, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	wait := time.Millisecond
	for {
		err := unix.Flock(int(f.Fd()), how|unix.LOCK_NB)
		if err == nil || !errors.Is(err, unix.EWOULDBLOCK) && !errors.Is(err, unix.EINTR) {
			return err
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%w: %s after %v", ErrLockTimeout, f.Name(), timeout)
		}
		time.Sleep(wait)
		wait = min(2*wait, 50*time.Millisecond)
	}
}

// nextGeneration is the start time, or one above the newest generation any
// process registered, whichever is greater. Under the registry lock.
func (s *Steering) nextGeneration() (uint64, error) {
	gen := uint64(time.Now().UnixNano())
	var info bpf.SteerSlotInfo
	for slot := uint32(0); slot < Slots; slot++ {
		if err := s.objs.SteerSlots.Lookup(slot, &info); err != nil {
			return 0, err
		}
		gen = max(gen, info.Generation+1)
	}
	return gen, nil
}

func sameFile(f *os.File, path string) bool {
	a, err1 := f.Stat()
	b, err2 := os.Stat(path)
	return err1 == nil && err2 == nil && os.SameFile(a, b)
}

// Dir is the pin directory.
func (s *Steering) Dir() string { return s.dir }

// Register adds one listener socket of a group; see RegisterSet.
func (s *Steering) Register(rc syscall.RawConn, g Group) (uint32, error) {
	slots, err := s.RegisterSet([]syscall.RawConn{rc}, g)
	if err != nil {
		return 0, err
	}
	return slots[0], nil
}

// RegisterSet adds a process's sockets of one group (one per read loop), each
// bound with SO_REUSEPORT, to the shared array in consecutive slots and,
// unless a newer process already serves the group or this one retired, makes
// them the sockets new flows of the group go to: the packet's 4-tuple hash
// picks one, so a client stays on one socket until AddFlow pins it there. It
// returns the sockets' slots, the values AddFlow records for their clients.
func (s *Steering) RegisterSet(rcs []syscall.RawConn, g Group) ([]uint32, error) {
	if len(rcs) == 0 || len(rcs) > Slots {
		return nil, fmt.Errorf("steering %v: %d sockets (1-%d)", g, len(rcs), Slots)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	slots := make([]uint32, len(rcs))
	cookies := make([]uint64, len(rcs))
	err := s.exclusive(func() error {
		first, err := s.freeRun(len(rcs))
		if err != nil {
			return err
		}
		for i, rc := range rcs {
			slots[i] = first + uint32(i)
			if cookies[i], err = s.claim(slots[i], rc, g); err != nil {
				for _, slot := range slots[:i] {
					_ = s.objs.SteerSockets.Delete(slot)
				}
				return err
			}
		}
		for i, slot := range slots {
			s.slots[slot] = registration{group: g, cookie: cookies[i]}
		}
		s.sets[g] = first | uint32(len(rcs))<<16
		if s.retired {
			return nil
		}
		return s.assertLocked(g, s.sets[g])
	})
	if err != nil {
		return nil, fmt.Errorf("steering %v: %w", g, err)
	}
	return slots, nil
}

// assertLocked makes the sockets of the active entry v take the group's new
// flows, unless a live socket of a newer process does. Under the registry
// lock.
func (s *Steering) assertLocked(g Group, v uint32) error {
	if _, alive := s.alive(activeFirst(v)); !alive {
		return nil // our socket closed without Unregister: nothing to steer to
	}
	var cur uint32
	err := s.objs.SteerActive.Lookup(g.key(), &cur)
	switch {
	case err == nil && cur == v:
		return nil
	case err == nil:
		if info, alive := s.alive(activeFirst(cur)); alive && info.Generation > s.gen {
			return nil // a newer process took over: it keeps the new flows
		}
	case !errors.Is(err, ebpf.ErrKeyNotExist):
		return err
	}
	return s.objs.SteerActive.Put(g.key(), v)
}

// Assert re-takes the new flows of every group this process serves, where
// the active entry is missing, names a closed socket or an older process (see
// the package comment); a retired process asserts nothing. The daemon calls
// it periodically: the entry written at Register does not survive every
// sequence of restarts and retirements of the others.
func (s *Steering) Assert() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.assertAllLocked()
}

func (s *Steering) assertAllLocked() error {
	if s.retired || len(s.sets) == 0 {
		return nil
	}
	return s.exclusive(func() error {
		var errs []error
		for g, v := range s.sets {
			if err := s.assertLocked(g, v); err != nil {
				errs = append(errs, fmt.Errorf("steering %v: %w", g, err))
			}
		}
		return errors.Join(errs...)
	})
}

// claim puts the socket of the group into a free slot and attaches the
// program to its reuseport group; it returns the socket's cookie. Under the
// registry lock.
func (s *Steering) claim(slot uint32, rc syscall.RawConn, g Group) (uint64, error) {
	// A slot is free when its socket closed; a process killed with live
	// allocations leaves entries naming it behind.
	if err := s.purge(slot); err != nil {
		return 0, err
	}
	var cerr error
	if err := rc.Control(func(fd uintptr) {
		if cerr = s.objs.SteerSockets.Update(slot, uint64(fd), ebpf.UpdateNoExist); cerr != nil {
			cerr = fmt.Errorf("add the socket to the steering array: %w", cerr)
			return
		}
		if cerr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_ATTACH_REUSEPORT_EBPF, s.objs.SteerReuseport.FD()); cerr != nil {
			cerr = fmt.Errorf("attach the steering program: %w", cerr)
		}
	}); err != nil {
		return 0, err
	}
	var cookie uint64
	if cerr == nil {
		cerr = s.objs.SteerSockets.Lookup(slot, &cookie)
	}
	// The group first: once steer_slots names the socket, Newer reads the
	// group, and a record not written yet would count the socket for every
	// group.
	if cerr == nil {
		cerr = s.slotGroups.Put(slot, slotGroup{Cookie: cookie, Group: g.key()})
	}
	if cerr == nil {
		cerr = s.objs.SteerSlots.Put(slot, bpf.SteerSlotInfo{Cookie: cookie, Generation: s.gen})
	}
	if cerr != nil {
		_ = s.objs.SteerSockets.Delete(slot)
		return 0, cerr
	}
	return cookie, nil
}

// An active entry holds the first slot of the newest process's sockets in its
// low 16 bits and their number in the high 16 (0: one, as written by versions
// with one socket per listener).
func activeFirst(v uint32) uint32 { return v & 0xffff }

func activeHas(v, slot uint32) bool {
	n := max(v>>16, 1)
	return slot >= activeFirst(v) && slot < activeFirst(v)+n
}

// alive reports whether the slot holds the socket its registration names.
func (s *Steering) alive(slot uint32) (bpf.SteerSlotInfo, bool) {
	var (
		cookie uint64
		info   bpf.SteerSlotInfo
	)
	if s.objs.SteerSockets.Lookup(slot, &cookie) != nil || s.objs.SteerSlots.Lookup(slot, &info) != nil {
		return info, false
	}
	return info, info.Cookie == cookie
}

// exclusive runs f under an exclusive lock on the registry directory, which
// serialises changes to the slots between processes.
func (s *Steering) exclusive(f func() error) error {
	reg := filepath.Join(s.dir, "registry")
	if err := os.Mkdir(reg, 0o700); err != nil && !errors.Is(err, os.ErrExist) {
		return err
	}
	d, err := os.Open(reg)
	if err != nil {
		return err
	}
	defer d.Close()
	if err := flock(d, unix.LOCK_EX, s.lockTimeout); err != nil {
		return err
	}
	return f()
}

// freeRun finds n consecutive free slots and returns the first.
func (s *Steering) freeRun(n int) (uint32, error) {
	var cookie uint64
	run := 0
	for i := uint32(0); i < Slots; i++ {
		err := s.objs.SteerSockets.Lookup(i, &cookie)
		switch {
		case errors.Is(err, ebpf.ErrKeyNotExist):
			if run++; run == n {
				return i + 1 - uint32(n), nil
			}
		case err != nil:
			return 0, fmt.Errorf("steering array slot %d: %w", i, err)
		default:
			run = 0
		}
	}
	return 0, fmt.Errorf("no %d consecutive free slots among the %d of the steering array", n, Slots)
}

// purge removes the flow and active entries that name the slot.
func (s *Steering) purge(slot uint32) error {
	if err := deleteNaming[bpf.SteerFlow](s.objs.SteerFlows, func(v uint32) bool { return v == slot }); err != nil {
		return fmt.Errorf("flow map: %w", err)
	}
	if err := deleteNaming[bpf.SteerGroup](s.objs.SteerActive, func(v uint32) bool { return activeHas(v, slot) }); err != nil {
		return fmt.Errorf("active map: %w", err)
	}
	return nil
}

// deleteNaming deletes the entries of a slot-valued hash map whose value names
// the slot.
func deleteNaming[K any](m *ebpf.Map, names func(uint32) bool) error {
	var (
		k     K
		v     uint32
		stale []K
	)
	it := m.Iterate()
	for it.Next(&k, &v) {
		if names(v) {
			stale = append(stale, k)
		}
	}
	if err := it.Err(); err != nil {
		return err
	}
	for _, k := range stale {
		if err := m.Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return err
		}
	}
	return nil
}

// Unregister takes the socket out of the steering: new flows stop coming to
// it, and the entries of its clients go (pion/turn does not report the
// allocations a closing server drops).
func (s *Steering) Unregister(slot uint32) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	r, ok := s.slots[slot]
	if !ok {
		return nil
	}
	delete(s.slots, slot)
	if v, ok := s.sets[r.group]; ok && activeHas(v, slot) {
		delete(s.sets, r.group)
	}
	return s.exclusive(func() error {
		var cookie uint64
		err := s.objs.SteerSockets.Lookup(slot, &cookie)
		if errors.Is(err, ebpf.ErrKeyNotExist) || err == nil && cookie != r.cookie {
			return nil // the socket closed and another took the slot: not ours to touch
		}
		if err != nil {
			return fmt.Errorf("steering %v: read the slot: %w", r.group, err)
		}
		if err := s.purge(slot); err != nil {
			return fmt.Errorf("steering %v: %w", r.group, err)
		}
		if err := s.objs.SteerSockets.Delete(slot); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return fmt.Errorf("steering %v: remove the socket: %w", r.group, err)
		}
		return nil
	})
}

func flowKey(g Group, client netip.AddrPort) bpf.SteerFlow {
	return bpf.FlowKey(g.key(), client)
}

// FlowMap is steer_flows, every daemon's UDP allocations on the node: the
// relay's listener shield reads it as node_flows.
func (s *Steering) FlowMap() *ebpf.Map { return s.objs.SteerFlows }

// AddFlow steers the client's datagrams on the group to the slot. Called when
// pion/turn creates the client's allocation, before the response leaves.
func (s *Steering) AddFlow(g Group, client netip.AddrPort, slot uint32) error {
	if err := s.objs.SteerFlows.Put(flowKey(g, client), slot); err != nil {
		return fmt.Errorf("steer %v client %v: %w", g, client, err)
	}
	return nil
}

// RemoveFlow forgets the client, unless another slot has taken it since.
func (s *Steering) RemoveFlow(g Group, client netip.AddrPort, slot uint32) error {
	k := flowKey(g, client)
	var cur uint32
	err := s.objs.SteerFlows.Lookup(k, &cur)
	if errors.Is(err, ebpf.ErrKeyNotExist) || err == nil && cur != slot {
		return nil // forgotten already, or another slot's now
	}
	if err != nil {
		return fmt.Errorf("unsteer %v client %v: %w", g, client, err)
	}
	if err := s.objs.SteerFlows.Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return fmt.Errorf("unsteer %v client %v: %w", g, client, err)
	}
	return nil
}

// Retire stops steering new flows to this process's sockets, now and for any
// it registers later: a draining daemon refuses them. Clients with
// allocations keep coming. New flows go to a successor's socket once one
// registers, and meanwhile by the kernel's hash.
func (s *Steering) Retire() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.retired = true
	return s.exclusive(func() error {
		for slot, r := range s.slots {
			var cur uint32
			if err := s.objs.SteerActive.Lookup(r.group.key(), &cur); err != nil || !activeHas(cur, slot) {
				continue
			}
			if err := s.objs.SteerActive.Delete(r.group.key()); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
				return fmt.Errorf("steering %v: %w", r.group, err)
			}
		}
		return nil
	})
}

// Unretire undoes Retire: the process takes the new flows of its groups
// again (Assert), until a newer process registers. The daemon calls it when
// the successor it drained for is gone and no other process serves.
func (s *Steering) Unretire() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.retired = false
	return s.assertAllLocked()
}

// Successor reports whether a live socket of another process takes the new
// flows of one of this process's listeners.
func (s *Steering) Successor() (bool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, r := range s.slots {
		var cur uint32
		err := s.objs.SteerActive.Lookup(r.group.key(), &cur)
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			continue
		}
		if err != nil {
			return false, fmt.Errorf("steering %v: %w", r.group, err)
		}
		if _, mine := s.slots[activeFirst(cur)]; mine {
			continue
		}
		// A claim purges the active entries naming the slot, so a live
		// registration here is a socket of this group.
		if _, alive := s.alive(activeFirst(cur)); alive {
			return true, nil
		}
	}
	return false, nil
}

// Newer reports whether a process that registered after this one still has
// a live socket in one of this process's groups, in service or draining: a
// successor that retired (its pod deleted too, as in a node drain) is alive,
// one that was killed is not (its sockets left the array when they closed).
// Another Gateway's daemons, in other groups, do not count; a socket whose
// group is unknown (claimed by an earlier version) does, as does every socket
// when this process has no registration (it has no group to tell by).
func (s *Steering) Newer() (bool, error) {
	s.mu.Lock()
	mine := make(map[bpf.SteerGroup]bool, len(s.slots))
	for _, r := range s.slots {
		mine[r.group.key()] = true
	}
	s.mu.Unlock()
	var (
		cookie uint64
		info   bpf.SteerSlotInfo
		rec    slotGroup
	)
	for slot := uint32(0); slot < Slots; slot++ {
		err := s.objs.SteerSockets.Lookup(slot, &cookie)
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			continue
		}
		if err == nil {
			err = s.objs.SteerSlots.Lookup(slot, &info)
		}
		if err != nil {
			return false, fmt.Errorf("steering array slot %d: %w", slot, err)
		}
		if info.Cookie != cookie || info.Generation <= s.gen {
			continue
		}
		if len(mine) == 0 {
			return true, nil
		}
		if err := s.slotGroups.Lookup(slot, &rec); err != nil {
			return false, fmt.Errorf("steering slot %d group: %w", slot, err)
		}
		if rec.Cookie != cookie || mine[rec.Group] {
			return true, nil
		}
	}
	return false, nil
}

// Stats are the program's verdicts since the maps were created, summed over
// CPUs: node-wide, whichever process asks.
type Stats struct {
	Owner  uint64 `json:"owner"`  // a client with an allocation went to its daemon
	Active uint64 `json:"active"` // a new flow went to the newest daemon
	Hash   uint64 `json:"hash"`   // no usable entry: the kernel's hash chose
}

// Stats reads the verdict counters.
func (s *Steering) Stats() (Stats, error) {
	var st Stats
	for i, p := range []*uint64{&st.Owner, &st.Active, &st.Hash} {
		var per []uint64
		if err := s.objs.SteerStats.Lookup(uint32(i), &per); err != nil {
			return st, fmt.Errorf("steering counters: %w", err)
		}
		for _, n := range per {
			*p += n
		}
	}
	return st, nil
}

// Flows counts the flow entries of every process on the node.
func (s *Steering) Flows() (int, error) {
	var (
		k bpf.SteerFlow
		v uint32
		n int
	)
	it := s.objs.SteerFlows.Iterate()
	for it.Next(&k, &v) {
		n++
	}
	return n, it.Err()
}

// Close releases the program and maps. The last process out (no other holds
// the directory) removes the pins; otherwise they stay for the others.
func (s *Steering) Close() error {
	s.closeOnce.Do(func() { s.closeErr = s.close() })
	return s.closeErr
}

func (s *Steering) close() error {
	s.mu.Lock()
	slots := make([]uint32, 0, len(s.slots))
	for slot := range s.slots {
		slots = append(slots, slot)
	}
	s.mu.Unlock()
	var errs []error
	for _, slot := range slots {
		errs = append(errs, s.Unregister(slot))
	}
	errs = append(errs, s.objs.Close(), s.slotGroups.Close())
	if unix.Flock(int(s.lock.Fd()), unix.LOCK_EX|unix.LOCK_NB) == nil {
		errs = append(errs, os.RemoveAll(s.dir))
	}
	errs = append(errs, s.lock.Close())
	return errors.Join(errs...)
}
