package daemon

import (
	"net"
	"syscall"

	"golang.org/x/sys/unix"
)

// listenConfig makes the listener sockets: big buffers, SO_REUSEPORT when
// steering or when a listener has several sockets (shared, one per read loop),
// and plain TCP (Go picks MPTCP by default, which the reuseport array does not
// take).
func (d *Daemon) listenConfig(shared bool) net.ListenConfig {
	reuse := d.steer != nil || shared
	buf := d.config().SocketBuffer
	lc := net.ListenConfig{Control: func(_, _ string, c syscall.RawConn) error {
		var serr error
		err := c.Control(func(fd uintptr) {
			// Bigger buffers absorb bursts on the userspace path; FORCE works
			// as root beyond net.core.rmem_max.
			_ = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_RCVBUFFORCE, buf)
			_ = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_SNDBUFFORCE, buf)
			if reuse {
				serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_REUSEPORT, 1)
			}
		})
		if err != nil {
			return err
		}
		return serr
	}}
	lc.SetMultipathTCP(false)
	return lc
}
