package loader

import (
	"encoding/binary"
	"errors"
	"hash/fnv"
	"log/slog"
	"sync"
	"time"

	"github.com/vishvananda/netlink/nl"
	"golang.org/x/sys/unix"
)

// fibGroups are the rtnetlink multicast groups whose messages may change what
// bpf_fib_lookup answers: neighbours (a MAC, a state), routes and rules of both
// families, addresses (local routes), links (up/down, MTU), the devices'
// forwarding settings (netconf) and nexthop objects (`ip nexthop`: deleting
// one removes the routes that use it without a route notification, replacing
// one moves them).
var fibGroups = []uint{
	unix.RTNLGRP_NEIGH,
	unix.RTNLGRP_IPV4_ROUTE, unix.RTNLGRP_IPV6_ROUTE,
	unix.RTNLGRP_IPV4_RULE, unix.RTNLGRP_IPV6_RULE,
	unix.RTNLGRP_IPV4_IFADDR, unix.RTNLGRP_IPV6_IFADDR,
	unix.RTNLGRP_LINK,
	unix.RTNLGRP_IPV4_NETCONF, unix.RTNLGRP_IPV6_NETCONF,
	unix.RTNLGRP_NEXTHOP,
}

// Path MTU exceptions. bpf_fib_lookup checks a packet's length against the
// route exceptions (the path MTUs the kernel learned from ICMP
// fragmentation-needed and packet-too-big errors), but the kernel sends no
// notification when it makes or changes one: a cached next hop would keep
// taking packets above a path MTU lowered since. Two watches stand in:
//
//   - the errors themselves: raw ICMP and ICMPv6 sockets, filtered in the
//     kernel to destination-unreachable and packet-too-big, get a copy of each
//     one that reaches the node; each invalidates the cache at once (the
//     kernel makes the exception after handing out the copies) and again
//     pmtuSettle later, at most once per pmtuSettle each: at most 2/pmtuSettle
//     invalidations a second (100) however many errors arrive, each costing one
//     bpf_fib_lookup per binding and direction;
//   - the exceptions: every ExceptionPollInterval one RTM_GETROUTE dump per
//     family with RTM_F_CLONED (strictly checked: the exceptions only; it
//     walks the FIB, microseconds on a node's few hundred routes) is compared
//     with the last. The kernel dumps only the exceptions a lookup of the
//     stack has used since they were made (a route cached in them), so this
//     catches what the first missed (a copy lost to a full socket buffer) once
//     the stack has sent on that path.
//
// Between a lowered path MTU and the invalidation, packets above it leave
// through the cached hop (and, on a real path, are lost there as they were
// before the ICMP error came).
var ExceptionPollInterval = time.Second

const pmtuSettle = 20 * time.Millisecond

// WatchFIB calls changed after every rtnetlink message of the caller's network
// namespace that can change a FIB lookup's answer, until stop is closed, so
// that the program's cached next hops are resolved again. It calls changed
// once the subscription is up, and again whenever messages may have been lost
// (a socket overrun, a read error): a spurious call costs one bpf_fib_lookup
// per binding and direction, a missed one would keep a stale next hop. Call it
// on a thread in the namespace of the attached interfaces (the socket belongs
// to it); it returns once subscribed.
func WatchFIB(stop <-chan struct{}, changed func(), log *slog.Logger) error {
	s, err := nl.Subscribe(unix.NETLINK_ROUTE, fibGroups...)
	if err != nil {
		return err
	}
	ex, err := newExceptionWatch()
	if err != nil {
		s.Close()
		return err
	}
	if _, err := ex.changed(); err != nil {
		log.Warn("reading the route exceptions (path MTUs) for the next-hop cache", "error", err)
	}
	// changed is called from the ICMP watch's goroutines too: one at a time.
	var mu sync.Mutex
	inner := changed
	changed = func() {
		mu.Lock()
		defer mu.Unlock()
		inner()
	}
	icmp := newICMPWatch(log)
	changed()
	icmp.start(stop, changed)
	go func() {
		defer func() { s.Close(); ex.close() }()
		// Receive returns at least this often to look at stop.
		_ = s.SetReceiveTimeout(&unix.Timeval{Usec: 200000})
		for {
			select {
			case <-stop:
				return
			default:
			}
			if time.Since(ex.at) >= ExceptionPollInterval {
				if c, err := ex.changed(); c || err != nil {
					if err != nil {
						log.Warn("reading the route exceptions (path MTUs) for the next-hop cache", "error", err)
					}
					changed()
				}
			}
			msgs, _, err := s.Receive()
			switch {
			case err == nil:
				if len(msgs) > 0 {
					changed()
				}
			case errors.Is(err, unix.EAGAIN):
			case errors.Is(err, unix.ENOBUFS):
				changed() // overrun: something changed that we did not read
			default:
				log.Warn("reading rtnetlink events for the next-hop cache; reading on in a second", "error", err)
				changed()
				select {
				case <-stop:
					return
				case <-time.After(time.Second):
				}
			}
		}
	}()
	return nil
}

// exceptionWatch tells whether the route exceptions changed since its last
// look, on a netlink socket of the namespace it was made in.
type exceptionWatch struct {
	h   *nl.SocketHandle
	sum uint64    // of the exceptions at the last look
	at  time.Time // of the last look
}

func newExceptionWatch() (*exceptionWatch, error) {
	s, err := nl.Subscribe(unix.NETLINK_ROUTE)
	if err != nil {
		return nil, err
	}
	// Strict checking makes an RTM_F_CLONED dump return the exceptions
	// only, not the routes too.
	if err := unix.SetsockoptInt(s.GetFd(), unix.SOL_NETLINK, unix.NETLINK_GET_STRICT_CHK, 1); err != nil {
		s.Close()
		return nil, err
	}
	// A dump that does not answer must not stop the watch.
	_ = s.SetReceiveTimeout(&unix.Timeval{Sec: 1})
	_ = s.SetSendTimeout(&unix.Timeval{Sec: 1})
	return &exceptionWatch{h: &nl.SocketHandle{Socket: s}}, nil
}

func (w *exceptionWatch) close() { w.h.Socket.Close() }

// changed dumps the exceptions of both families and reports whether they
// differ from the last look (an error counts as a change).
func (w *exceptionWatch) changed() (bool, error) {
	w.at = time.Now()
	var sum uint64
	for _, family := range []int{unix.AF_INET, unix.AF_INET6} {
		req := nl.NewNetlinkRequest(unix.RTM_GETROUTE, unix.NLM_F_DUMP)
		// Every other field zero: under strict checking a table, protocol,
		// type or scope would filter the dump.
		req.AddData(&nl.RtMsg{RtMsg: unix.RtMsg{Family: uint8(family), Flags: unix.RTM_F_CLONED}})
		req.Sockets = map[int]*nl.SocketHandle{unix.NETLINK_ROUTE: w.h}
		err := req.ExecuteIter(unix.NETLINK_ROUTE, unix.RTM_NEWROUTE, func(m []byte) bool {
			sum += exceptionSum(m)
			return true
		})
		if err != nil {
			return true, err
		}
	}
	c := sum != w.sum
	w.sum = sum
	return c, nil
}

// exceptionSum is a hash of one dumped exception without what changes while it
// stands (its expiry and use counters): the sum over a dump does not depend on
// the dump's order.
func exceptionSum(m []byte) uint64 {
	if len(m) < unix.SizeofRtMsg {
		return 0
	}
	h := fnv.New64a()
	_, _ = h.Write(m[:unix.SizeofRtMsg])
	attrs, err := nl.ParseRouteAttr(m[unix.SizeofRtMsg:])
	if err != nil {
		_, _ = h.Write(m[unix.SizeofRtMsg:])
		return h.Sum64()
	}
	for _, a := range attrs {
		switch a.Attr.Type {
		case unix.RTA_CACHEINFO, unix.RTA_EXPIRES:
			continue
		}
		_, _ = h.Write([]byte{byte(a.Attr.Type), byte(a.Attr.Type >> 8)})
		_, _ = h.Write(a.Value)
	}
	return h.Sum64()
}

// icmpWatch invalidates the next-hop cache when an ICMP error may have given a
// path a lower MTU (see ExceptionPollInterval).
type icmpWatch struct {
	fds []int
	v6  []bool

	mu      sync.Mutex
	last    time.Time // the last immediate invalidation
	pending bool      // a later one is scheduled
}

// Socket options of linux/icmp.h and linux/icmpv6.h.
const (
	icmpFilter   = 1 // ICMP_FILTER: a mask of the types to block
	icmpv6Filter = 1 // ICMPV6_FILTER: a 256-bit mask of the types to block

	icmpDestUnreach = 3 // ICMP_DEST_UNREACH
	icmpFragNeeded  = 4 // its code ICMP_FRAG_NEEDED
	icmpv6TooBig    = 2 // ICMPV6_PKT_TOOBIG
)

// newICMPWatch opens the raw sockets in the caller's namespace; a family the
// kernel refuses is left out (logged).
func newICMPWatch(log *slog.Logger) *icmpWatch {
	w := &icmpWatch{}
	// ICMP_FILTER: a 32-bit mask, host order.
	v4 := binary.NativeEndian.AppendUint32(nil, ^uint32(1<<icmpDestUnreach))
	if fd, err := openICMP(unix.AF_INET, unix.IPPROTO_ICMP, unix.SOL_RAW, icmpFilter, v4); err == nil {
		w.fds, w.v6 = append(w.fds, fd), append(w.v6, false)
	} else {
		// Without CAP_NET_RAW (the DaemonSet's default): only the poll.
		log.Info("ICMP errors not watched for the next-hop cache: a lowered path MTU is seen by the exception poll only", "error", err)
	}
	// struct icmp6_filter: eight 32-bit words, host order.
	var mask [8]uint32
	for i := range mask {
		mask[i] = ^uint32(0)
	}
	mask[icmpv6TooBig>>5] &^= 1 << (icmpv6TooBig & 31)
	v6 := make([]byte, 0, 32)
	for _, m := range mask {
		v6 = binary.NativeEndian.AppendUint32(v6, m)
	}
	if fd, err := openICMP(unix.AF_INET6, unix.IPPROTO_ICMPV6, unix.SOL_ICMPV6, icmpv6Filter, v6); err == nil {
		w.fds, w.v6 = append(w.fds, fd), append(w.v6, true)
	} else {
		log.Debug("no ICMPv6 watch for the next-hop cache", "error", err)
	}
	return w
}

// openICMP opens a raw socket of the family and protocol with the type filter
// (level, option) and a receive timeout, to look at stop.
func openICMP(family, proto, level, opt int, filter []byte) (int, error) {
	fd, err := unix.Socket(family, unix.SOCK_RAW|unix.SOCK_CLOEXEC, proto)
	if err != nil {
		return -1, err
	}
	err = unix.SetsockoptString(fd, level, opt, string(filter))
	if err == nil {
		err = unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &unix.Timeval{Usec: 200000})
	}
	if err != nil {
		unix.Close(fd)
		return -1, err
	}
	return fd, nil
}

func (w *icmpWatch) start(stop <-chan struct{}, changed func()) {
	for i, fd := range w.fds {
		go w.read(fd, w.v6[i], stop, changed)
	}
}

func (w *icmpWatch) read(fd int, v6 bool, stop <-chan struct{}, changed func()) {
	defer unix.Close(fd)
	buf := make([]byte, 128) // the headers; the rest is cut
	for {
		select {
		case <-stop:
			return
		default:
		}
		n, _, err := unix.Recvfrom(fd, buf, unix.MSG_TRUNC)
		if err != nil {
			continue // the timeout (EAGAIN), EINTR, ...
		}
		if n > len(buf) {
			n = len(buf)
		}
		if mtuError(buf[:n], v6) {
			w.trigger(stop, changed)
		}
	}
}

// mtuError tells whether an ICMP message (IPv4: with its IP header, as a raw
// socket gets it) is fragmentation-needed or packet-too-big.
func mtuError(p []byte, v6 bool) bool {
	if v6 {
		return len(p) >= 1 && p[0] == icmpv6TooBig
	}
	if len(p) < 20 {
		return false
	}
	ihl := int(p[0]&0x0F) * 4
	return len(p) >= ihl+2 && p[ihl] == icmpDestUnreach && p[ihl+1] == icmpFragNeeded
}

// trigger invalidates now, unless it did less than pmtuSettle ago, and once
// more pmtuSettle later, when the kernel has made the exception.
func (w *icmpWatch) trigger(stop <-chan struct{}, changed func()) {
	w.mu.Lock()
	now := time.Now()
	immediate := now.Sub(w.last) >= pmtuSettle
	if immediate {
		w.last = now
	}
	later := !w.pending
	w.pending = true
	w.mu.Unlock()
	if immediate {
		changed()
	}
	if later {
		time.AfterFunc(pmtuSettle, func() {
			w.mu.Lock()
			w.pending = false
			w.mu.Unlock()
			select {
			case <-stop:
			default:
				changed()
			}
		})
	}
}
