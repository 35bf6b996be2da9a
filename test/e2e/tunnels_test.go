package e2e

import "github.com/l7mp/stunnerd-xdp/test/netns"

// tunnelShapeCases are TestNodeShapeTwins' rows for the tunnel and VLAN node
// shapes (issue 34): devices whose modules this machine's kernel may lack, in
// which case the row skips, naming the kernel (netns.ErrNoKernelDevice); the
// kernel matrix (make test-kernels) runs them on Debian's 5.10, 6.1 and 6.12.
// The expectations say what the engines do once the kernel path loads there.
var tunnelShapeCases = []shapeCase{
	{name: "calico-ipip", shape: netns.CalicoIPIP,
		engagesC2P: true, engagesP2C: true,
		why: "Felix masquerades what leaves tunl0 from the node IP to tunl0's 10.244.0.0 (--random-fully): the NAT gate installs " +
			"the binding from the translated relay, as in vxlan-masq; client->peer: XDP passes (tunl0 takes no XDP frames) and the " +
			"TC engine on the NIC redirects the skb into tunl0, whose transmit takes the outer destination from the route on " +
			"the skb (ip_tunnel_xmit, NBMA: rt_nexthop), which an skb at TC ingress does not carry yet: dev_caps marks tunl0 " +
			"DEV_XMIT_NEEDS_ROUTE (an ipip device without a remote end) and the engine redirects with bpf_redirect_neigh, which " +
			"routes it out of tunl0 and attaches the route (bpf_redirect: 0 of 20 delivered, tx_fifo_errors +20, on 5.10, 6.1 and 6.12). " +
			"peer->client comes back through the tunnel to 10.244.0.0, decapsulated onto tunl0, a device without a link-layer header " +
			"(kind:ipip in the default --tc-iface): the engine's L3 program parses from the IP header, puts an Ethernet header in " +
			"front (bpf_skb_change_head) and redirects into the NIC (5.10's ip_tunnel_rcv leaves the outer headers in front of the " +
			"decapsulated packet, mac_len 34: the engine passes it, pass_l3_outer_headers, and pion/turn relays it there)"},
	{name: "wireguard", shape: netns.WireGuard,
		engagesC2P: true, engagesP2C: true,
		why: "Felix masquerades what leaves wireguard.cali from the node IP to its 10.244.0.0: the NAT gate installs the binding " +
			"from the translated relay; client->peer: XDP passes (wireguard.cali takes no XDP frames) and the TC engine on the NIC " +
			"(the FIB follows the rule to table 1) redirects the skb into wireguard.cali, whose transmit needs no route on the skb " +
			"(the peer is the allowed IPs' match for the inner destination; a scratch TC program's bpf_redirect: 20 of 20 on 5.10, 6.1 and 6.12); " +
			"peer->client arrives encrypted (UDP 51820: not ours, " +
			"passed), decrypted onto wireguard.cali, a device without a link-layer header (kind:wireguard in the default " +
			"--tc-iface): the engine's L3 program relays it into the NIC"},
	{name: "gre", shape: netns.GRE,
		engagesC2P: true, engagesP2C: true,
		why: "client->peer: XDP passes (gre1 takes no XDP frames) and the TC engine on the NIC redirects the skb into gre1, which " +
			"has a fixed remote end and no header_ops: it encapsulates to its remote without a route on the skb (a scratch TC " +
			"program's bpf_redirect: 20 of 20 on 5.10, 6.1 and 6.12; a GRE device " +
			"without a remote end is marked as tunl0 is and gets bpf_redirect_neigh); the pod's replies to the node IP leave node 2 through its NIC and " +
			"arrive on the NIC: XDP_TX"},
	{name: "vlan-nic", shape: netns.VLANNIC,
		attach:     map[string]string{"eth0.100": "generic"},
		engagesC2P: true, engagesP2C: true,
		why: "the node IP is on eth0.100, a VLAN device without native XDP: auto mode attaches it generic (eth0 carries no " +
			"address: not attached); both directions enter and leave through eth0.100, whose generic XDP_TX goes out through the " +
			"skb path (generic_xdp_tx): the VLAN device tags it and hands it to eth0"},
}
