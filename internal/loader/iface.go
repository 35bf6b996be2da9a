package loader

import (
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"time"

	"github.com/vishvananda/netlink"
)

func interfaceByName(name string) (*net.Interface, error) {
	ifc, err := net.InterfaceByName(name)
	if err != nil {
		return nil, fmt.Errorf("interface %q: %w", name, err)
	}
	return ifc, nil
}

// InterfacesFor returns the interfaces that carry the given addresses, in order
// and without duplicates: the default for --xdp-iface. Unspecified addresses
// are skipped; an address no interface carries is an error.
func InterfacesFor(addrs ...netip.Addr) ([]string, error) {
	ifcs, err := net.Interfaces()
	if err != nil {
		return nil, fmt.Errorf("list interfaces: %w", err)
	}
	var out []string
	seen := map[string]bool{}
	for _, want := range addrs {
		if !want.IsValid() || want.IsUnspecified() {
			continue
		}
		found := ""
		for _, ifc := range ifcs {
			as, err := ifc.Addrs()
			if err != nil {
				continue
			}
			for _, a := range as {
				if ipn, ok := a.(*net.IPNet); ok {
					if ip, ok := netip.AddrFromSlice(ipn.IP); ok && ip.Unmap() == want.Unmap() {
						found = ifc.Name
					}
				}
			}
		}
		if found == "" {
			return nil, fmt.Errorf("no interface carries %v", want)
		}
		if !seen[found] {
			seen[found] = true
			out = append(out, found)
		}
	}
	return out, nil
}

// WatchLinks calls changed after every link event of the network namespace (a
// device added, deleted, renamed or changed) until stop is closed. A broken
// subscription is made again after a second; the caller's periodic check
// covers the gap.
func WatchLinks(stop <-chan struct{}, changed func(), log *slog.Logger) {
	for {
		updates := make(chan netlink.LinkUpdate, 64)
		done := make(chan struct{})
		err := netlink.LinkSubscribeWithOptions(updates, done, netlink.LinkSubscribeOptions{
			ErrorCallback: func(err error) { log.Debug("netlink link events", "error", err) },
		})
		if err != nil {
			log.Warn("no netlink link events: interface changes are seen at the next attach retry", "error", err)
		} else if !follow(stop, updates, changed) {
			close(done)
			for range updates { // closed by the receiver once the socket is
			}
			return
		}
		close(done)
		select {
		case <-stop:
			return
		case <-time.After(time.Second):
		}
	}
}

// follow calls changed for each update until stop (false) or the end of the
// subscription (true).
func follow(stop <-chan struct{}, updates <-chan netlink.LinkUpdate, changed func()) bool {
	for {
		select {
		case <-stop:
			return false
		case _, ok := <-updates:
			if !ok {
				return true
			}
			changed()
		}
	}
}
