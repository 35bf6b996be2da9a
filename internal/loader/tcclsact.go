package loader

import (
	"errors"
	"fmt"
	"math"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// TCAttach is how the TC engine hooks an interface's ingress.
type TCAttach string

const (
	// TCAttachAuto is clsact on every kernel: where tcx exists (6.6+), its
	// programs run before the device's qdisc filters, so a tcx engine would
	// redirect past the bandwidth plugin's ingress qdisc (a u32 filter
	// mirred to an ifb with a TBF: the pod's egress limit) and any policer;
	// the node's traffic control keeps its say only when the engine runs
	// after it (issue 35).
	TCAttachAuto TCAttach = "auto"
	// TCAttachTCX: a tcx bpf_link, after the programs already there. A link
	// is this process's: a crash detaches the engine. tcx programs run before
	// the device's clsact/ingress qdisc filters (the bandwidth plugin's):
	// only where asked (tests and benchmarks compare the two).
	TCAttachTCX TCAttach = "tcx"
	// TCAttachClsact: a cls_bpf filter in direct-action mode on the device's
	// ingress qdisc (a clsact made when there is none), at a priority after
	// every other filter, so that those keep their say (a u32 mirred to an
	// ifb, a policer) and the engine sees only what they let through. A
	// filter is not a link: it outlives the process. The engine removes its
	// own at detach and close, and a stale one of a crashed daemon at the
	// next start (sweepClsact).
	TCAttachClsact TCAttach = "clsact"
)

// tcxSupported tells whether the kernel has tcx, by asking it to attach prog
// to an interface that cannot exist: a kernel with tcx answers ENODEV,
// cilium/ebpf turns an older kernel's answer into ErrNotSupported.
func tcxSupported(prog *ebpf.Program) bool {
	l, err := link.AttachTCX(link.TCXOptions{Program: prog, Attach: ebpf.AttachTCXIngress, Interface: math.MaxUint32})
	if err == nil {
		_ = l.Close()
	}
	return !errors.Is(err, ebpf.ErrNotSupported)
}

// tcHook is the engine's hold on one interface's ingress: a tcx link or a
// cls_bpf filter.
type tcHook interface {
	// update swaps the program in place: no packet sees the hook empty.
	update(prog *ebpf.Program) error
	// detach removes the engine from the interface.
	detach() error
}

type tcxHook struct{ link.Link }

func (h tcxHook) update(prog *ebpf.Program) error { return h.Update(prog) }
func (h tcxHook) detach() error                   { return h.Close() }

// The engine's cls_bpf filters: in the protocol-all filter chain at
// clsactPriority, named clsactName, each daemon's under its own handle
// (tcOwner).
const (
	// clsactPriority is the last priority: filters run in ascending order,
	// and one added later without a priority gets one below the lowest
	// (tc's auto priority), so every other filter runs first.
	clsactPriority = math.MaxUint16
	clsactName     = "stunnerd-xdp"
)

// clsactHook is the engine's filter on one interface.
type clsactHook struct {
	ifindex int
	handle  uint32
	// ownQdisc: the engine made the clsact qdisc (there was no ingress
	// qdisc), so it removes it when it leaves it empty; it never removes
	// one it found.
	ownQdisc bool
}

func (h *clsactHook) filter(prog *ebpf.Program) *netlink.BpfFilter {
	f := &netlink.BpfFilter{
		FilterAttrs: netlink.FilterAttrs{
			LinkIndex: h.ifindex,
			Parent:    netlink.HANDLE_MIN_INGRESS,
			Handle:    h.handle,
			Priority:  clsactPriority,
			Protocol:  unix.ETH_P_ALL,
		},
		Name:         clsactName,
		DirectAction: true,
	}
	if prog != nil {
		f.Fd = prog.FD()
	}
	return f
}

// attachClsact puts prog at the interface's ingress as a cls_bpf filter under
// handle, on the ingress qdisc there (clsact, or the older ingress qdisc: both
// take filters at ffff:fff2), making a clsact qdisc when there is none.
func attachClsact(ifindex int, handle uint32, prog *ebpf.Program) (*clsactHook, error) {
	h := &clsactHook{ifindex: ifindex, handle: handle}
	has, err := hasIngressQdisc(ifindex)
	if err != nil {
		return nil, err
	}
	if !has {
		q := &netlink.GenericQdisc{QdiscType: "clsact", QdiscAttrs: netlink.QdiscAttrs{
			LinkIndex: ifindex, Handle: netlink.MakeHandle(0xffff, 0), Parent: netlink.HANDLE_CLSACT,
		}}
		switch err := netlink.QdiscAdd(q); {
		case err == nil:
			h.ownQdisc = true
		case !errors.Is(err, unix.EEXIST): // EEXIST: another made one meanwhile
			return nil, fmt.Errorf("add a clsact qdisc: %w", err)
		}
	}
	// Replace, not add: a filter of a crashed daemon that held the same
	// handle, which the sweep missed, is taken over.
	if err := netlink.FilterReplace(h.filter(prog)); err != nil {
		if h.ownQdisc {
			_ = h.deleteQdiscIfEmpty()
		}
		return nil, fmt.Errorf("add a cls_bpf filter: %w", err)
	}
	return h, nil
}

func (h *clsactHook) update(prog *ebpf.Program) error {
	return netlink.FilterReplace(h.filter(prog))
}

// detach removes the filter, and the qdisc when the engine made it and no
// filter is left on it. A device that is gone took both with it.
func (h *clsactHook) detach() error {
	err := netlink.FilterDel(h.filter(nil))
	if gone(err) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("delete the cls_bpf filter: %w", err)
	}
	if h.ownQdisc {
		return h.deleteQdiscIfEmpty()
	}
	return nil
}

func (h *clsactHook) deleteQdiscIfEmpty() error {
	l, err := netlink.LinkByIndex(h.ifindex)
	if err != nil {
		return nil // gone, with its qdisc
	}
	for _, parent := range []uint32{netlink.HANDLE_MIN_INGRESS, netlink.HANDLE_MIN_EGRESS} {
		fs, err := netlink.FilterList(l, parent)
		if err != nil || len(fs) > 0 {
			return nil // another's filters: the qdisc stays with them
		}
	}
	q := &netlink.GenericQdisc{QdiscType: "clsact", QdiscAttrs: netlink.QdiscAttrs{
		LinkIndex: h.ifindex, Handle: netlink.MakeHandle(0xffff, 0), Parent: netlink.HANDLE_CLSACT,
	}}
	if err := netlink.QdiscDel(q); err != nil && !gone(err) {
		return fmt.Errorf("delete the clsact qdisc the engine made: %w", err)
	}
	return nil
}

// hasIngressQdisc tells whether the device has a clsact or ingress qdisc.
func hasIngressQdisc(ifindex int) (bool, error) {
	l, err := netlink.LinkByIndex(ifindex)
	if err != nil {
		return false, err
	}
	qs, err := netlink.QdiscList(l)
	if err != nil {
		return false, fmt.Errorf("list qdiscs: %w", err)
	}
	for _, q := range qs {
		if q.Attrs().Parent == netlink.HANDLE_INGRESS {
			return true, nil
		}
	}
	return false, nil
}

// gone tells whether a netlink error says the device or the filter is not
// there (any more).
func gone(err error) bool {
	return errors.Is(err, unix.ENODEV) || errors.Is(err, unix.ENOENT)
}

// tcOwner is a daemon's claim on one cls_bpf filter handle in a network
// namespace: an abstract unix socket bound to a name made of the handle. The
// kernel releases the name when the process ends however it ends, so a
// filter whose handle's name is free is a stale one of a daemon that died,
// and one whose name is bound belongs to a live daemon (another Gateway's,
// or the previous pod of a rolling update, still relaying its sessions).
type tcOwner struct {
	handle uint32
	fd     int
}

// clsactHandles is the range of handles daemons claim: one each, the lowest
// free one.
const (
	clsactHandleBase = 0x57d10000 // "stunnerd" in a handle's few hex digits
	clsactHandles    = 1024
)

func ownerName(handle uint32) string { return fmt.Sprintf("@stunnerd-xdp/tc-filter/%08x", handle) }

// claimHandle binds the handle's name: nil when a live process holds it.
func claimHandle(handle uint32) (*tcOwner, error) {
	fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("socket for the TC filter handle: %w", err)
	}
	if err := unix.Bind(fd, &unix.SockaddrUnix{Name: ownerName(handle)}); err != nil {
		unix.Close(fd)
		if errors.Is(err, unix.EADDRINUSE) {
			return nil, nil
		}
		return nil, fmt.Errorf("bind the TC filter handle's name: %w", err)
	}
	return &tcOwner{handle: handle, fd: fd}, nil
}

// claimFreeHandle claims the lowest handle no live daemon holds.
func claimFreeHandle() (*tcOwner, error) {
	for i := range uint32(clsactHandles) {
		o, err := claimHandle(clsactHandleBase + i)
		if err != nil || o != nil {
			return o, err
		}
	}
	return nil, fmt.Errorf("all %d TC filter handles are held by live daemons", clsactHandles)
}

func (o *tcOwner) release() {
	if o != nil {
		unix.Close(o.fd)
	}
}

// isOurs tells whether a tc filter is one the engine makes.
func isOurs(f netlink.Filter) bool {
	b, ok := f.(*netlink.BpfFilter)
	a := f.Attrs()
	return ok && b.Name == clsactName && a.Priority == clsactPriority &&
		a.Handle >= clsactHandleBase && a.Handle < clsactHandleBase+clsactHandles
}

// sweepClsact removes the engine's filters that no live daemon holds (a
// crashed daemon's; own's handle is this one's, which has attached nothing
// yet) from every interface of the namespace, and returns where it removed
// them.
func sweepClsact(own *tcOwner) ([]string, error) {
	links, err := netlink.LinkList()
	if err != nil {
		return nil, fmt.Errorf("list interfaces: %w", err)
	}
	stale := map[uint32]bool{own.handle: true}
	// The handles of dead daemons are held until their filters are gone: a
	// daemon starting meanwhile cannot claim one and attach under it.
	var held []*tcOwner
	defer func() {
		for _, o := range held {
			o.release()
		}
	}()
	var swept []string
	var errs []error
	for _, l := range links {
		fs, err := netlink.FilterList(l, netlink.HANDLE_MIN_INGRESS)
		if err != nil {
			continue // no ingress qdisc, or gone
		}
		for _, f := range fs {
			if !isOurs(f) {
				continue
			}
			h := f.Attrs().Handle
			dead, known := stale[h]
			if !known {
				o, err := claimHandle(h)
				if err != nil {
					errs = append(errs, err)
					continue
				}
				if dead = o != nil; dead {
					held = append(held, o)
				}
				stale[h] = dead
			}
			if !dead {
				continue
			}
			if err := netlink.FilterDel(f); err != nil && !gone(err) {
				errs = append(errs, fmt.Errorf("delete a stale TC filter on %s: %w", l.Attrs().Name, err))
				continue
			}
			swept = append(swept, l.Attrs().Name)
		}
	}
	return swept, errors.Join(errs...)
}
