package loader

import (
	"encoding/binary"
	"errors"
	"fmt"
	"time"

	mdnetlink "github.com/mdlayher/netlink"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/l7mp/stunnerd-xdp/internal/xdpfeatures"
)

// Below Linux 6.3 the kernel does not say which devices transmit XDP frames
// (no netdev xdp-features). devCaps then decides per device from what it can
// read, conservatively: a wrong "transmits" loses every frame redirected
// there (the driver drops it after the program returned XDP_REDIRECT), a
// wrong "does not" only sends the flow through the stack.
//
//   - A veth transmits a redirected frame into its peer only while the peer
//     runs an XDP program in the driver (veth_xdp_xmit drops frames without
//     the peer's rq->xdp_prog; a generic program does not set it, and GRO's
//     NAPI, 5.13+, is not counted on). The peer may be in another namespace
//     (a pod's eth0): it is read there through IFLA_TARGET_NETNSID (4.20+).
//   - A NIC transmits redirected frames when its driver has ndo_xdp_xmit and
//     the device runs an XDP program in the driver itself: the drivers below
//     allocate their XDP transmit queues only then (virtio_net, ixgbe, i40e,
//     ice, mlx5, ena, bnxt_en, igb, sfc all refuse ndo_xdp_xmit without one).
//   - Everything else (bridges, VLANs, tunnels, macvlan, drivers not listed,
//     a device whose driver cannot be read) transmits none.
//
// Nothing notifies a change of a peer's program in another namespace, so the
// fallback reads everything again every fallbackPoll as well: a pod that
// detaches its XDP program may lose up to that long of redirected frames.

// fallbackPoll is how often the fallback reads every device again.
var fallbackPoll = time.Second

// dialXDPFeatures opens the xdp-features client; tests replace it to run the
// fallback on kernels that have xdp-features.
var dialXDPFeatures = xdpfeatures.Dial

// nativeDrivers are the drivers known to run XDP in the driver (XDP_TX on
// their own queues), by ethtool driver name, and whether they transmit
// frames redirected from another device (ndo_xdp_xmit, from 5.10 on) while
// running an XDP program themselves. Drivers whose ndo_xdp_xmit came after
// 5.10 (qede 5.11, igc 5.13, hv_netvsc 5.16) or never (mlx4_en, ixgbevf)
// transmit none here.
var nativeDrivers = map[string]bool{
	"virtio_net": true,
	"mlx5_core":  true,
	"ixgbe":      true,
	"i40e":       true,
	"ice":        true,
	"ena":        true,
	"bnxt_en":    true,
	"igb":        true,
	"sfc":        true,
	"mlx4_en":    false,
	"ixgbevf":    false,
	"qede":       false,
	"hv_netvsc":  false,
	"igc":        false,
}

// xdpAttachedDrv is IFLA_XDP_ATTACHED's XDP_ATTACHED_DRV: one program, in
// the driver. (XDP_ATTACHED_MULTI, a driver and a generic program at once,
// is not read further: counted as none.)
const xdpAttachedDrv = 1

// fallback reads the devices' XDP transmit abilities without xdp-features.
// Its sockets belong to the namespace of the thread that opened it.
type fallback struct {
	rtnl    *mdnetlink.Conn // RTM_GETLINK of a veth's peer in another namespace
	ioctlFD int             // ethtool's driver name
}

func newFallback() (*fallback, error) {
	c, err := mdnetlink.Dial(unix.NETLINK_ROUTE, nil)
	if err != nil {
		return nil, fmt.Errorf("rtnetlink: %w", err)
	}
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		c.Close()
		return nil, fmt.Errorf("ethtool socket: %w", err)
	}
	return &fallback{rtnl: c, ioctlFD: fd}, nil
}

func (f *fallback) close() {
	f.rtnl.Close()
	unix.Close(f.ioctlFD)
}

// features decides, for every device of links, the xdp-features the kernel
// would report (what capOf reads: Basic, NDOXmit); devices left out are known
// to transmit none. modes are this program's own attachments.
func (f *fallback) features(links []netlink.Link, modes map[int]Mode) map[int]xdpfeatures.Act {
	byIndex := make(map[int]netlink.Link, len(links))
	for _, l := range links {
		byIndex[l.Attrs().Index] = l
	}
	out := make(map[int]xdpfeatures.Act, len(links))
	for _, l := range links {
		a := l.Attrs()
		if l.Type() == "veth" {
			act := xdpfeatures.Basic | xdpfeatures.Redirect
			if f.vethPeerNative(l, byIndex, modes) {
				act |= xdpfeatures.NDOXmit
			}
			out[a.Index] = act
			continue
		}
		xmit, known := nativeDrivers[f.driver(a.Name)]
		if !known {
			continue
		}
		act := xdpfeatures.Basic | xdpfeatures.Redirect
		if xmit && (modes[a.Index] == ModeNative || nativeProg(a)) {
			act |= xdpfeatures.NDOXmit
		}
		out[a.Index] = act
	}
	return out
}

// nativeProg says whether the link runs an XDP program in its driver.
func nativeProg(a *netlink.LinkAttrs) bool {
	return a.Xdp != nil && a.Xdp.AttachMode == xdpAttachedDrv
}

// vethPeerNative says whether the veth's peer runs an XDP program in the
// driver; false when the peer cannot be read.
func (f *fallback) vethPeerNative(l netlink.Link, byIndex map[int]netlink.Link, modes map[int]Mode) bool {
	a := l.Attrs()
	if a.ParentIndex == 0 {
		return false
	}
	if a.NetNsID < 0 { // the peer is in this namespace
		p, ok := byIndex[a.ParentIndex]
		return ok && (modes[a.ParentIndex] == ModeNative || nativeProg(p.Attrs()))
	}
	p, err := f.linkIn(a.NetNsID, a.ParentIndex)
	return err == nil && nativeProg(p.Attrs())
}

// linkIn reads the link of that ifindex in the namespace this one knows as
// nsid (RTM_GETLINK with IFLA_TARGET_NETNSID, 4.20+), without entering it.
func (f *fallback) linkIn(nsid, ifindex int) (netlink.Link, error) {
	ifi := make([]byte, unix.SizeofIfInfomsg)
	binary.NativeEndian.PutUint32(ifi[4:8], uint32(ifindex))
	ae := mdnetlink.NewAttributeEncoder()
	ae.Int32(unix.IFLA_TARGET_NETNSID, int32(nsid))
	attrs, err := ae.Encode()
	if err != nil {
		return nil, err
	}
	msgs, err := f.rtnl.Execute(mdnetlink.Message{
		Header: mdnetlink.Header{Type: unix.RTM_GETLINK, Flags: mdnetlink.Request},
		Data:   append(ifi, attrs...),
	})
	if err != nil {
		return nil, fmt.Errorf("ifindex %d in netns id %d: %w", ifindex, nsid, err)
	}
	for _, m := range msgs {
		if m.Header.Type != unix.RTM_NEWLINK {
			continue
		}
		return netlink.LinkDeserialize(nil, m.Data)
	}
	return nil, errors.New("no link in the answer")
}

// driver is the device's ethtool driver name ("" when it has none).
func (f *fallback) driver(name string) string {
	info, err := unix.IoctlGetEthtoolDrvinfo(f.ioctlFD, name)
	if err != nil {
		return ""
	}
	return unix.ByteSliceToString(info.Driver[:])
}
