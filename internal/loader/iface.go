package loader

import (
	"fmt"
	"net"
	"net/netip"
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
