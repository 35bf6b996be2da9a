package testenv

import (
	"encoding/binary"
	"errors"
	"net"

	"golang.org/x/sys/unix"
)

// RawSocket sends whole Ethernet frames out of one device (AF_PACKET), as a
// wire or a pod puts them on the link: addresses, checksums and all as given.
// Open it in the device's network namespace.
type RawSocket struct {
	fd  int
	dev *net.Interface
}

// OpenRaw opens a RawSocket on the named device.
func OpenRaw(dev string) (*RawSocket, error) {
	d, err := net.InterfaceByName(dev)
	if err != nil {
		return nil, err
	}
	// Protocol 0: the socket only sends.
	fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_RAW, 0)
	if err != nil {
		return nil, err
	}
	return &RawSocket{fd: fd, dev: d}, nil
}

// MAC is the device's address, the source of what it sends.
func (s *RawSocket) MAC() net.HardwareAddr { return s.dev.HardwareAddr }

// Send sends frame to the destination MAC in its first six bytes, with the
// EtherType of bytes 12-13.
func (s *RawSocket) Send(frame []byte) error {
	if len(frame) < 14 {
		return errors.New("a frame shorter than an Ethernet header")
	}
	sa := &unix.SockaddrLinklayer{Ifindex: s.dev.Index, Protocol: binary.NativeEndian.Uint16(frame[12:14]), Halen: 6}
	copy(sa.Addr[:], frame[0:6])
	return unix.Sendto(s.fd, frame, 0, sa)
}

// Close closes the socket.
func (s *RawSocket) Close() error { return unix.Close(s.fd) }

// SendNonIP sends n minimal Ethernet frames of a local experimental
// EtherType (IEEE 802 0x88B5, no IP) out of from, addressed to to's MAC: on a
// veth pair they arrive at to's ingress, where a TC program sees them. Call
// it from the devices' network namespace.
func SendNonIP(from, to string, n int) error {
	dst, err := net.InterfaceByName(to)
	if err != nil {
		return err
	}
	s, err := OpenRaw(from)
	if err != nil {
		return err
	}
	defer s.Close()
	frame := make([]byte, 60)
	copy(frame[0:6], dst.HardwareAddr)
	copy(frame[6:12], s.MAC())
	frame[12], frame[13] = 0x88, 0xb5
	for range n {
		if err := s.Send(frame); err != nil {
			return err
		}
	}
	return nil
}
