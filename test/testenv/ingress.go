package testenv

import (
	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"
)

// IngressPrograms returns the programs at the ingress of the device of the
// calling thread's namespace: tcx's (6.6+) and the cls_bpf filters' (on its
// clsact or ingress qdisc), whichever way the TC engine attached there.
func IngressPrograms(name string) ([]ebpf.ProgramID, error) {
	l, err := netlink.LinkByName(name)
	if err != nil {
		return nil, err
	}
	var ids []ebpf.ProgramID
	if r, err := link.QueryPrograms(link.QueryOptions{Target: l.Attrs().Index, Attach: ebpf.AttachTCXIngress}); err == nil {
		for _, p := range r.Programs {
			ids = append(ids, p.ID)
		}
	}
	fs, err := netlink.FilterList(l, netlink.HANDLE_MIN_INGRESS)
	if err != nil {
		return nil, err
	}
	for _, f := range fs {
		if b, ok := f.(*netlink.BpfFilter); ok {
			ids = append(ids, ebpf.ProgramID(b.Id))
		}
	}
	return ids, nil
}
