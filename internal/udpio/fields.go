package udpio

import (
	"os"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Fields are the IP header fields of one datagram that a TURN relay carries
// from what it receives to what it sends (RFC 8656 section 14, preferred
// behaviour): the TTL (IPv6: hop limit) and the TOS byte (IPv6: traffic
// class), DSCP and ECN together. The kernel reports them per datagram
// (IP_RECVTTL, IP_RECVTOS, IPV6_RECVHOPLIMIT, IPV6_RECVTCLASS) and takes them
// per datagram on a send (IP_TTL, IP_TOS, IPV6_HOPLIMIT, IPV6_TCLASS).
type Fields struct {
	TTL uint8
	TOS uint8
	// Valid: the kernel reported both (a zero Fields is "unknown", and a
	// send with it takes the socket's defaults).
	Valid bool
}

// Forwarded is what a relay sends for a datagram that arrived with f: the
// TTL one less and the TOS byte as it came; ok is false when the TTL would
// reach 0 (RFC 8656 section 14 drops it, as a router drops a packet whose
// TTL expires). Unknown fields forward as unknown.
func (f Fields) Forwarded() (Fields, bool) {
	if !f.Valid {
		return f, true
	}
	if f.TTL <= 1 {
		return Fields{}, false
	}
	f.TTL--
	return f, true
}

// Pack is f in one integer (0: unknown), for atomic stores; UnpackFields
// reverses it.
func (f Fields) Pack() uint32 {
	if !f.Valid {
		return 0
	}
	return 1<<16 | uint32(f.TTL)<<8 | uint32(f.TOS)
}

// UnpackFields is the Fields Pack made v from.
func UnpackFields(v uint32) Fields {
	if v&(1<<16) == 0 {
		return Fields{}
	}
	return Fields{TTL: uint8(v >> 8), TOS: uint8(v), Valid: true}
}

// controlSize holds the control messages a datagram brings: TTL and TOS, on
// an IPv6 socket the IPv6 pair or (for IPv4 sources) the IPv4 one. Each is a
// 16-byte header plus an int, padded: 24 bytes.
const controlSize = 64

// enableFields asks the kernel to report the fields of every datagram the
// socket receives: on an IPv6 socket the IPv6 options and, for IPv4
// datagrams on a dual-stack socket, the IPv4 ones too (a v6-only socket
// refuses those: ignored).
func enableFields(rc syscall.RawConn, family int) error {
	var serr error
	err := rc.Control(func(fd uintptr) {
		set := func(level, opt int) error {
			if err := unix.SetsockoptInt(int(fd), level, opt, 1); err != nil {
				return os.NewSyscallError("setsockopt", err)
			}
			return nil
		}
		if family == unix.AF_INET6 {
			if serr = set(unix.IPPROTO_IPV6, unix.IPV6_RECVHOPLIMIT); serr != nil {
				return
			}
			if serr = set(unix.IPPROTO_IPV6, unix.IPV6_RECVTCLASS); serr != nil {
				return
			}
		}
		if err := set(unix.IPPROTO_IP, unix.IP_RECVTTL); err != nil {
			if family == unix.AF_INET {
				serr = err
			}
			return
		}
		if err := set(unix.IPPROTO_IP, unix.IP_RECVTOS); err != nil && family == unix.AF_INET {
			serr = err
		}
	})
	if err != nil {
		return err
	}
	return serr
}

// parseFields reads the fields from a datagram's control messages, without
// allocating. IPv4 and IPv6 control messages come as the datagram's family.
func parseFields(b []byte) Fields {
	var f Fields
	var ttl, tos bool
	for len(b) >= unix.SizeofCmsghdr {
		h := (*unix.Cmsghdr)(unsafe.Pointer(&b[0]))
		if h.Len < unix.SizeofCmsghdr || int(h.Len) > len(b) {
			break
		}
		data := b[unix.SizeofCmsghdr:h.Len]
		switch {
		case h.Level == unix.IPPROTO_IP && h.Type == unix.IP_TTL && len(data) >= 4:
			f.TTL, ttl = uint8(*(*int32)(unsafe.Pointer(&data[0]))), true
		case h.Level == unix.IPPROTO_IP && h.Type == unix.IP_TOS && len(data) >= 1:
			// A single byte (IPv4's IP_RECVTOS).
			f.TOS, tos = data[0], true
		case h.Level == unix.IPPROTO_IPV6 && h.Type == unix.IPV6_HOPLIMIT && len(data) >= 4:
			f.TTL, ttl = uint8(*(*int32)(unsafe.Pointer(&data[0]))), true
		case h.Level == unix.IPPROTO_IPV6 && h.Type == unix.IPV6_TCLASS && len(data) >= 4:
			f.TOS, tos = uint8(*(*int32)(unsafe.Pointer(&data[0]))), true
		}
		next := cmsgAlign(int(h.Len))
		if next > len(b) {
			break
		}
		b = b[next:]
	}
	f.Valid = ttl && tos
	return f
}

func cmsgAlign(n int) int {
	const a = int(unsafe.Sizeof(uintptr(0)))
	return (n + a - 1) &^ (a - 1)
}

// putFields writes the control messages that send a datagram with f into b
// and returns their length: IP_TTL and IP_TOS to an IPv4 destination (also an
// IPv4-mapped one on an IPv6 socket: the kernel sends those as IPv4 and reads
// the IPv4 options), IPV6_HOPLIMIT and IPV6_TCLASS to an IPv6 one.
func putFields(b *[controlSize]byte, v6 bool, f Fields) int {
	level, ttlType, tosType := int32(unix.IPPROTO_IP), int32(unix.IP_TTL), int32(unix.IP_TOS)
	if v6 {
		level, ttlType, tosType = unix.IPPROTO_IPV6, unix.IPV6_HOPLIMIT, unix.IPV6_TCLASS
	}
	off := 0
	for _, m := range [2]struct {
		typ int32
		val int32
	}{{ttlType, int32(f.TTL)}, {tosType, int32(f.TOS)}} {
		h := (*unix.Cmsghdr)(unsafe.Pointer(&b[off]))
		h.Level, h.Type = level, m.typ
		h.SetLen(unix.CmsgLen(4))
		*(*int32)(unsafe.Pointer(&b[off+unix.CmsgLen(0)])) = m.val
		off += unix.CmsgSpace(4)
	}
	return off
}
