package policywatch

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"

	"github.com/mdlayher/netlink"
	"github.com/vishvananda/netlink/nl"
	"golang.org/x/sys/unix"
)

// Policy directions, as the kernel numbers them (XFRM_POLICY_IN, _OUT, _FWD).
const (
	DirIn  = 0
	DirOut = 1
	DirFwd = 2
)

// Policy is one xfrm policy of the security policy database, as far as the
// kernel path cares: its selector, direction and priority, and whether the
// stack would send a matching packet as it is (an allow policy without
// templates: a bypass) or not (block, or templates: encrypt or drop until an
// SA exists).
type Policy struct {
	Dir      uint8
	Priority uint32
	Index    uint32
	Family   uint16 // AF_INET, AF_INET6, or 0 (AF_UNSPEC: any)
	Src, Dst netip.Prefix
	Proto    uint8 // 0: any
	// Ports and their masks, host order (a mask of 0: any port).
	SrcPort, SrcPortMask, DstPort, DstPortMask uint16
	// Block: the action is block. Templates: how many SA templates an allow
	// policy has (IPsec).
	Block     bool
	Templates int
	// Marked: the policy matches packets by mark (XFRMA_MARK). The kernel
	// path cannot tell what mark the stack's rules would give a packet, so
	// such a policy is taken to match whatever the mark.
	Marked bool
}

// Refuses tells whether the stack would not send a packet this policy
// selects as it is.
func (p Policy) Refuses() bool { return p.Block || p.Templates > 0 }

func (p Policy) String() string {
	action := "allow"
	switch {
	case p.Block:
		action = "block"
	case p.Templates > 0:
		action = fmt.Sprintf("allow with %d template(s)", p.Templates)
	}
	dir := [...]string{"in", "out", "fwd"}[min(int(p.Dir), 2)]
	return fmt.Sprintf("src %v dst %v proto %d sport %d/%#x dport %d/%#x dir %s priority %d %s",
		p.Src, p.Dst, p.Proto, p.SrcPort, p.SrcPortMask, p.DstPort, p.DstPortMask, dir, p.Priority, action)
}

// matches is the kernel's selector match (__xfrm4_selector_match,
// __xfrm6_selector_match) for a UDP packet src->dst, with the interface
// left out (a policy bound to an interface is taken to match on any). An
// unspecified address (a wildcard listener's) matches any prefix of its
// family: the packet's address is one of the node's, unknown here.
func (p Policy) matches(src, dst netip.AddrPort) bool {
	if p.Proto != 0 && p.Proto != unix.IPPROTO_UDP {
		return false
	}
	in := func(pfx netip.Prefix, a netip.Addr) bool {
		if !pfx.IsValid() {
			return true
		}
		if a.Is4() != pfx.Addr().Is4() {
			return false
		}
		return a.IsUnspecified() || pfx.Contains(a)
	}
	return in(p.Src, src.Addr()) && in(p.Dst, dst.Addr()) &&
		(src.Port()^p.SrcPort)&p.SrcPortMask == 0 && (dst.Port()^p.DstPort)&p.DstPortMask == 0
}

// Policies are the namespace's xfrm policies.
type Policies []Policy

// decides returns the policy the stack applies in direction dir to a UDP
// packet src->dst: of those that match, the one with the lowest priority
// number (the kernel's xfrm_policy_lookup_bytype). Of several at that
// priority, one that refuses is returned (the kernel takes the one inserted
// first, which the dump does not tell).
func (ps Policies) decides(dir uint8, src, dst netip.AddrPort) (Policy, bool) {
	var best Policy
	found := false
	for _, p := range ps {
		if p.Dir != dir || !p.matches(src, dst) {
			continue
		}
		if !found || p.Priority < best.Priority || p.Priority == best.Priority && p.Refuses() && !best.Refuses() {
			best, found = p, true
		}
	}
	return best, found
}

// Refuses tells whether the stack would block or encrypt the UDP flow
// between a local socket (a relay or a listener) and a remote one (a peer or
// a client) in either direction: what a local socket sends meets the out
// policies, what it receives the in ones. It returns the policy that does.
func (ps Policies) Refuses(local, remote netip.AddrPort) (Policy, bool) {
	if p, ok := ps.decides(DirOut, local, remote); ok && p.Refuses() {
		return p, true
	}
	if p, ok := ps.decides(DirIn, remote, local); ok && p.Refuses() {
		return p, true
	}
	return Policy{}, false
}

// ErrNoXfrm: the kernel has no xfrm netlink interface (no CONFIG_XFRM_USER),
// so no policy can be configured through it.
var ErrNoXfrm = errors.New("the kernel has no xfrm netlink interface")

// ListPolicies reads the xfrm policies of the calling thread's network
// namespace (main and sub policies; socket policies are not in the database).
func ListPolicies() (Policies, error) {
	var msgs [][]byte
	var err error
	// A dump that a change interrupted may be incomplete: read again.
	for range 3 {
		req := nl.NewNetlinkRequest(nl.XFRM_MSG_GETPOLICY, unix.NLM_F_DUMP)
		req.AddData(nl.NewIfInfomsg(unix.AF_UNSPEC))
		if msgs, err = req.Execute(unix.NETLINK_XFRM, nl.XFRM_MSG_NEWPOLICY); !errors.Is(err, nl.ErrDumpInterrupted) {
			break
		}
	}
	if errors.Is(err, unix.EPROTONOSUPPORT) {
		return nil, ErrNoXfrm
	}
	if err != nil {
		return nil, fmt.Errorf("xfrm policies: %w", err)
	}
	ps := make(Policies, 0, len(msgs))
	for _, m := range msgs {
		p, err := parsePolicy(m)
		if err != nil {
			return nil, err
		}
		ps = append(ps, p)
	}
	return ps, nil
}

// parsePolicy decodes an XFRM_MSG_NEWPOLICY payload (struct
// xfrm_userpolicy_info and its attributes).
func parsePolicy(m []byte) (Policy, error) {
	if len(m) < nl.SizeofXfrmUserpolicyInfo {
		return Policy{}, fmt.Errorf("xfrm policy: %d bytes, want at least %d", len(m), nl.SizeofXfrmUserpolicyInfo)
	}
	info := nl.DeserializeXfrmUserpolicyInfo(m)
	sel := info.Sel
	p := Policy{
		Dir: info.Dir, Priority: info.Priority, Index: info.Index, Family: sel.Family, Proto: sel.Proto,
		SrcPort: swap16(sel.Sport), SrcPortMask: swap16(sel.SportMask),
		DstPort: swap16(sel.Dport), DstPortMask: swap16(sel.DportMask),
		Block: info.Action == 1, // XFRM_POLICY_BLOCK
	}
	var ok bool
	if p.Src, ok = prefix(sel.Family, sel.Saddr, sel.PrefixlenS); !ok {
		return Policy{}, fmt.Errorf("xfrm policy: source prefix length %d", sel.PrefixlenS)
	}
	if p.Dst, ok = prefix(sel.Family, sel.Daddr, sel.PrefixlenD); !ok {
		return Policy{}, fmt.Errorf("xfrm policy: destination prefix length %d", sel.PrefixlenD)
	}
	attrs, err := nl.ParseRouteAttr(m[nl.SizeofXfrmUserpolicyInfo:])
	if err != nil {
		return Policy{}, fmt.Errorf("xfrm policy attributes: %w", err)
	}
	for _, a := range attrs {
		switch a.Attr.Type {
		case nl.XFRMA_TMPL:
			p.Templates += len(a.Value) / nl.SizeofXfrmUserTmpl
		case nl.XFRMA_MARK:
			p.Marked = true
		}
	}
	return p, nil
}

// swap16 turns a selector's network-order port into host order.
func swap16(v uint16) uint16 { return v>>8 | v<<8 }

// prefix is a selector's address and prefix length; invalid (any address)
// for AF_UNSPEC.
func prefix(family uint16, a nl.XfrmAddress, bits uint8) (netip.Prefix, bool) {
	switch family {
	case unix.AF_INET:
		if bits > 32 {
			return netip.Prefix{}, false
		}
		return netip.PrefixFrom(netip.AddrFrom4([4]byte(a[:4])), int(bits)).Masked(), true
	case unix.AF_INET6:
		if bits > 128 {
			return netip.Prefix{}, false
		}
		return netip.PrefixFrom(netip.AddrFrom16(a), int(bits)).Masked(), true
	}
	return netip.Prefix{}, true
}

// XfrmEvents is a subscription to the policy notifications of the network
// namespace it was opened in.
type XfrmEvents struct {
	conn *netlink.Conn
}

// WatchXfrm subscribes to xfrm's policy notifications (XFRMNLGRP_POLICY) in
// the calling thread's network namespace.
func WatchXfrm() (*XfrmEvents, error) {
	c, err := netlink.Dial(unix.NETLINK_XFRM, &netlink.Config{})
	if errors.Is(err, unix.EPROTONOSUPPORT) {
		return nil, ErrNoXfrm
	}
	if err != nil {
		return nil, fmt.Errorf("xfrm netlink: %w", err)
	}
	if err := c.JoinGroup(nl.XFRMNLGRP_POLICY); err != nil {
		c.Close()
		return nil, fmt.Errorf("xfrm netlink: joining the policy group: %w", err)
	}
	return &XfrmEvents{conn: c}, nil
}

// Close ends the subscription; a Next waiting returns an error.
func (e *XfrmEvents) Close() error { return e.conn.Close() }

// Next waits until a policy was added, changed, deleted or flushed (or
// notifications were lost, which may hide one) and returns what happened,
// for the logs. The caller lists the policies afresh.
func (e *XfrmEvents) Next() (string, error) {
	msgs, err := e.conn.Receive()
	if errors.Is(err, unix.ENOBUFS) {
		return "notifications lost", nil
	}
	if err != nil {
		return "", err
	}
	var what []string
	for _, m := range msgs {
		switch m.Header.Type {
		case nl.XFRM_MSG_NEWPOLICY:
			what = append(what, "policy added")
		case nl.XFRM_MSG_UPDPOLICY:
			what = append(what, "policy updated")
		case nl.XFRM_MSG_DELPOLICY:
			what = append(what, "policy deleted")
		case nl.XFRM_MSG_FLUSHPOLICY:
			what = append(what, "policies flushed")
		case nl.XFRM_MSG_POLEXPIRE:
			what = append(what, "policy expired")
		default:
			what = append(what, "message "+fmt.Sprint(m.Header.Type))
		}
	}
	return strings.Join(slices.Compact(what), ", "), nil
}

// RefuseAll stands for policies that could not be read: it matches every
// flow, in both directions, and blocks it.
var RefuseAll = Policy{Dir: DirOut, Priority: 0, Block: true}
