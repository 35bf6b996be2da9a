package loader

import (
	"errors"
	"log/slog"
	"time"

	"github.com/vishvananda/netlink/nl"
	"golang.org/x/sys/unix"
)

// fibGroups are the rtnetlink multicast groups whose messages may change what
// bpf_fib_lookup answers: neighbours (a MAC, a state), routes and rules of both
// families, addresses (local routes), links (up/down, MTU) and the devices'
// forwarding settings (netconf).
var fibGroups = []uint{
	unix.RTNLGRP_NEIGH,
	unix.RTNLGRP_IPV4_ROUTE, unix.RTNLGRP_IPV6_ROUTE,
	unix.RTNLGRP_IPV4_RULE, unix.RTNLGRP_IPV6_RULE,
	unix.RTNLGRP_IPV4_IFADDR, unix.RTNLGRP_IPV6_IFADDR,
	unix.RTNLGRP_LINK,
	unix.RTNLGRP_IPV4_NETCONF, unix.RTNLGRP_IPV6_NETCONF,
}

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
	changed()
	go func() {
		defer func() { s.Close() }()
		// Receive returns at least this often to look at stop.
		_ = s.SetReceiveTimeout(&unix.Timeval{Usec: 200000})
		for {
			select {
			case <-stop:
				return
			default:
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
