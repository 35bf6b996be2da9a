package natcheck

import (
	"errors"
	"net/netip"
	"path/filepath"
	"strings"
	"testing"

	"github.com/ti-mo/conntrack"
	"golang.org/x/sys/unix"
)

func udpFlow(status conntrack.Status, orig, reply [2]string) conntrack.Flow {
	ap := netip.MustParseAddrPort
	f := conntrack.NewFlow(unix.IPPROTO_UDP, status, ap(orig[0]).Addr(), ap(orig[1]).Addr(), ap(orig[0]).Port(), ap(orig[1]).Port(), 0, 0)
	f.TupleReply.IP.SourceAddress, f.TupleReply.Proto.SourcePort = ap(reply[0]).Addr(), ap(reply[0]).Port()
	f.TupleReply.IP.DestinationAddress, f.TupleReply.Proto.DestinationPort = ap(reply[1]).Addr(), ap(reply[1]).Port()
	return f
}

func TestClassify(t *testing.T) {
	const relay, clusterIP, pod = "10.0.0.5:50000", "10.96.0.10:5001", "10.244.1.7:5001"
	seen := conntrack.StatusConfirmed | conntrack.StatusSeenReply
	for _, tc := range []struct {
		name         string
		flow         conntrack.Flow
		want         Verdict
		whyHasPrefix string
	}{
		{"plain, pion sent first", udpFlow(seen, [2]string{relay, pod}, [2]string{pod, relay}), Direct, "not translated"},
		{"plain, the peer sent first", udpFlow(seen, [2]string{pod, relay}, [2]string{relay, pod}), Direct, "not translated"},
		{"kube-proxy DNAT of a ClusterIP", udpFlow(seen|conntrack.StatusDstNAT|conntrack.StatusDstNATDone,
			[2]string{relay, clusterIP}, [2]string{pod, relay}), NATed, "DNAT"},
		{"masquerade", udpFlow(seen|conntrack.StatusSrcNAT|conntrack.StatusSrcNATDone,
			[2]string{relay, pod}, [2]string{pod, "192.0.2.1:50000"}), NATed, "SNAT"},
		{"both", udpFlow(seen|conntrack.StatusNATMask, [2]string{relay, clusterIP}, [2]string{pod, "192.0.2.1:61000"}),
			NATed, "SNAT and DNAT"},
		// IPVS alters the reply tuple without setting the NAT bits.
		{"reply altered without NAT bits", udpFlow(seen, [2]string{relay, clusterIP}, [2]string{pod, relay}), NATed, "reply tuple"},
		{"port translated only", udpFlow(seen, [2]string{relay, pod}, [2]string{"10.244.1.7:6001", relay}), NATed, "reply tuple"},
		{"NAT bits on a mirrored tuple", udpFlow(seen|conntrack.StatusDstNAT, [2]string{relay, pod}, [2]string{pod, relay}), NATed, "DNAT"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := Classify(tc.flow)
			if got.Verdict != tc.want || !strings.HasPrefix(got.Why, tc.whyHasPrefix) {
				t.Fatalf("Classify = %v (%s), want %v (%s...)", got.Verdict, got.Why, tc.want, tc.whyHasPrefix)
			}
		})
	}
}

// Without the conntrack module nothing can NAT, and the checker must not
// open ctnetlink (which would load the module).
func TestCheckWithoutConntrack(t *testing.T) {
	c := &Checker{sysctl: filepath.Join(t.TempDir(), "nf_conntrack_count")}
	r, err := c.Check(netip.MustParseAddrPort("10.0.0.5:50000"), netip.MustParseAddrPort("10.96.0.10:5001"))
	if err != nil || r.Verdict != Direct {
		t.Fatalf("Check = %v (%s), %v; want direct", r.Verdict, r.Why, err)
	}
	if c.conn != nil {
		t.Fatal("the checker opened ctnetlink although conntrack is not loaded")
	}
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Check(netip.MustParseAddrPort("10.0.0.5:50000"), netip.MustParseAddrPort("10.96.0.10:5001")); !errors.Is(err, ErrClosed) {
		t.Fatalf("Check after Close: %v, want ErrClosed", err)
	}
}

// ClassifyRelay offloads a source NAT of the relay alone (flannel's
// masquerade) and nothing else that translates.
func TestClassifyRelay(t *testing.T) {
	const relay, pod, clusterIP, wire = "192.168.77.10:50000", "10.244.1.5:5002", "10.96.0.10:5002", "10.244.0.0:31337"
	seen := conntrack.StatusConfirmed | conntrack.StatusSeenReply
	snat := seen | conntrack.StatusSrcNAT | conntrack.StatusSrcNATDone
	ap := netip.MustParseAddrPort
	for _, tc := range []struct {
		name     string
		flow     conntrack.Flow
		want     Verdict
		wantWire string
	}{
		{"masquerade of pion's flow", udpFlow(snat, [2]string{relay, pod}, [2]string{pod, wire}), Translated, wire},
		{"masquerade keeping the port", udpFlow(snat, [2]string{relay, pod}, [2]string{pod, "10.244.0.0:50000"}), Translated, "10.244.0.0:50000"},
		{"SNAT of the port alone", udpFlow(snat, [2]string{relay, pod}, [2]string{pod, "192.168.77.10:1024"}), Translated, "192.168.77.10:1024"},
		{"untranslated", udpFlow(seen, [2]string{relay, pod}, [2]string{pod, relay}), Direct, relay},
		{"untranslated, the peer sent first", udpFlow(seen, [2]string{pod, relay}, [2]string{relay, pod}), Direct, relay},
		// A SNAT of a flow the peer started rewrites the peer as pion sees it.
		{"the peer's flow, source NATed", udpFlow(snat, [2]string{pod, relay}, [2]string{relay, "10.244.0.0:40000"}), NATed, ""},
		{"DNAT of the peer (a ClusterIP)", udpFlow(seen|conntrack.StatusDstNAT|conntrack.StatusDstNATDone,
			[2]string{relay, clusterIP}, [2]string{pod, relay}), NATed, ""},
		{"masquerade and DNAT", udpFlow(snat|conntrack.StatusDstNAT|conntrack.StatusDstNATDone,
			[2]string{relay, clusterIP}, [2]string{pod, wire}), NATed, ""},
		// IPVS and other rewrites without the bits stay in userspace.
		{"reply altered without NAT bits", udpFlow(seen, [2]string{relay, pod}, [2]string{pod, wire}), NATed, ""},
		{"peer's port rewritten", udpFlow(snat, [2]string{relay, pod}, [2]string{"10.244.1.5:6002", wire}), NATed, ""},
		{"SNAT bit on a mirrored tuple", udpFlow(snat, [2]string{relay, pod}, [2]string{pod, relay}), NATed, ""},
		{"another relay's entry", udpFlow(snat, [2]string{"192.168.77.10:50001", pod}, [2]string{pod, wire}), NATed, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := ClassifyRelay(tc.flow, ap(relay), ap(pod))
			if tc.name == "DNAT of the peer (a ClusterIP)" || tc.name == "masquerade and DNAT" {
				got = ClassifyRelay(tc.flow, ap(relay), ap(clusterIP))
			}
			var wantWire netip.AddrPort
			if tc.wantWire != "" {
				wantWire = ap(tc.wantWire)
			}
			if got.Verdict != tc.want || got.Wire != wantWire {
				t.Fatalf("ClassifyRelay = %v wire %v (%s), want %v wire %v", got.Verdict, got.Wire, got.Why, tc.want, wantWire)
			}
		})
	}
}

func TestVerdictString(t *testing.T) {
	for v, want := range map[Verdict]string{Unknown: "unknown", Direct: "direct", NATed: "nat", Translated: "snat", Verdict(9): "unknown"} {
		if v.String() != want {
			t.Errorf("%d.String() = %q, want %q", v, v.String(), want)
		}
	}
}
