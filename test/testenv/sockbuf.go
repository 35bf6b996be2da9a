package testenv

import (
	"fmt"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"
)

// ReadBuffer gives c a receive buffer of at least size bytes, whatever the machine's
// net.core.rmem_max says, and fails t if it cannot. SetReadBuffer is capped at
// rmem_max (212,992 bytes on a fresh Debian machine: asking for 4 MiB silently
// gets 416 KiB), so a test that lets datagrams queue before it reads would pass or
// lose them depending on a sysctl; SO_RCVBUFFORCE (root) is not capped.
func ReadBuffer(t testing.TB, c syscall.Conn, size int) {
	t.Helper()
	if err := ForceReadBuffer(c, size); err != nil {
		t.Fatal(err)
	}
}

// WriteBuffer is ReadBuffer for the send buffer (SO_SNDBUFFORCE, net.core.wmem_max).
func WriteBuffer(t testing.TB, c syscall.Conn, size int) {
	t.Helper()
	if err := forceBuffer(c, unix.SO_SNDBUFFORCE, unix.SO_SNDBUF, "SO_SNDBUF", size); err != nil {
		t.Fatal(err)
	}
}

// ForceReadBuffer is ReadBuffer for programs without a testing.TB (the test tools):
// SO_RCVBUFFORCE, else SO_RCVBUF, and an error if the socket got less than size.
func ForceReadBuffer(c syscall.Conn, size int) error {
	return forceBuffer(c, unix.SO_RCVBUFFORCE, unix.SO_RCVBUF, "SO_RCVBUF", size)
}

func forceBuffer(c syscall.Conn, force, plain int, name string, size int) error {
	raw, err := c.SyscallConn()
	if err != nil {
		return err
	}
	var got int
	var serr error
	err = raw.Control(func(fd uintptr) {
		// Without CAP_NET_ADMIN the forced option fails; the plain one is capped
		// at the sysctl, which the check below reports.
		if unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, force, size) != nil {
			_ = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, plain, size)
		}
		got, serr = unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, plain)
	})
	if err == nil {
		err = serr
	}
	if err != nil {
		return fmt.Errorf("%s: %w", name, err)
	}
	// The kernel reports (and allows) twice the size asked for: the other half
	// is its bookkeeping.
	if got < size {
		return fmt.Errorf("%s of %d bytes asked, %d granted (not root, and capped by net.core.[rw]mem_max)", name, size, got)
	}
	return nil
}
