package testenv

import (
	"net"

	"golang.org/x/sys/unix"
)

// SendNonIP sends n minimal Ethernet frames of a local experimental
// EtherType (IEEE 802 0x88B5, no IP) out of from, addressed to to's MAC: on a
// veth pair they arrive at to's ingress, where a TC program sees them. Call
// it from the devices' network namespace.
func SendNonIP(from, to string, n int) error {
	src, err := net.InterfaceByName(from)
	if err != nil {
		return err
	}
	dst, err := net.InterfaceByName(to)
	if err != nil {
		return err
	}
	// Protocol 0: the socket only sends.
	fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_RAW, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	frame := make([]byte, 60)
	copy(frame[0:6], dst.HardwareAddr)
	copy(frame[6:12], src.HardwareAddr)
	frame[12], frame[13] = 0x88, 0xb5
	sa := &unix.SockaddrLinklayer{Ifindex: src.Index, Protocol: 0xb588, Halen: 6}
	copy(sa.Addr[:], dst.HardwareAddr)
	for range n {
		if err := unix.Sendto(fd, frame, 0, sa); err != nil {
			return err
		}
	}
	return nil
}
