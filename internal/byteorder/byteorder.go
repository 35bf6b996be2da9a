// Package byteorder converts the ports and channel numbers the BPF maps hold
// in network byte order (the program compares them with packet bytes as they
// are) to and from Go's integers, on any host byte order.
package byteorder

import "encoding/binary"

// Htons returns v in network byte order, as a host-order uint16 whose memory
// holds v's big-endian bytes. It is its own inverse (ntohs).
func Htons(v uint16) uint16 {
	var b [2]byte
	binary.BigEndian.PutUint16(b[:], v)
	return binary.NativeEndian.Uint16(b[:])
}
