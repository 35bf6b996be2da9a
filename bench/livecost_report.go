package bench

import (
	"fmt"
	"sort"
	"strings"
)

// Live-cost rows: the relay program attached to the rig's server interfaces,
// real datagrams from sockets in the client and peer namespaces (senders with
// their default offloads: CHECKSUM_PARTIAL frames), the kernel's BPF run-time
// statistics of the relay program beside those of the trivial XDP_PASS
// program on the receiving veth, over the same interval.
const (
	liveC2P4 = "client→peer, IPv4 client"
	liveP2C4 = "peer→client, IPv4 client"
	liveC2P6 = "client→peer, IPv6 client"
	liveP2C6 = "peer→client, IPv6 client"
	// The same with tx checksum offload off on the sender: full checksums, as
	// real NICs deliver them.
	liveC2P4Full = "client→peer, IPv4 client, full checksum"
	liveP2C4Full = "peer→client, IPv4 client, full checksum"
	// Branches of the same program that end early: the differences between
	// them and the relay row are the cost breakdown.
	liveParse   = "breakdown: parse only (UDP to no listener or relay port: pass_not_ours)"
	liveLookups = "breakdown: parse + listener and binding lookups (unbound channel: pass_no_channel)"
	liveFIB     = "breakdown: parse + lookups + bpf_fib_lookup (peer without neighbour: pass_fib_no_neigh)"
	// Scale: the same relay rows with 100,000 more bindings in the maps.
	liveC2P4Many     = "client→peer, IPv4 client, full checksum, 100,000 more bindings installed"
	liveP2C4Many     = "peer→client, IPv4 client, full checksum, 100,000 more bindings installed"
	liveManyBindings = 100000
	// Many bindings with traffic, in turn from one sender (one CPU's cache).
	liveC2P4Active1k       = "client→peer, IPv4 client, 1,024 bindings sending in turn (a quarter of the per-CPU flow cache)"
	liveC2P4Active8k       = "client→peer, IPv4 client, 8,192 bindings sending in turn (twice the per-CPU flow cache: mostly misses)"
	liveC2P4Active1kNoFlow = "client→peer, IPv4 client, 1,024 bindings sending in turn, flow cache off"
	liveC2P4Active8kNoFlow = "client→peer, IPv4 client, 8,192 bindings sending in turn, flow cache off"
	// The caches' worth: the relay rows with the flow caches off (the program
	// loaded without them), and with both caches off (FIB generation 0).
	liveC2P4NoFlow  = "client→peer, IPv4 client, full checksum, flow cache off (destination and binding hash lookups on every packet)"
	liveP2C4NoFlow  = "peer→client, IPv4 client, full checksum, flow cache off (binding hash lookup on every packet)"
	liveC2P4NoCache = "client→peer, IPv4 client, full checksum, flow and next-hop caches off (hash lookups and bpf_fib_lookup on every packet)"
	liveP2C4NoCache = "peer→client, IPv4 client, full checksum, flow and next-hop caches off (hash lookups and bpf_fib_lookup on every packet)"
	// The rate limit's cost: the full-checksum relay rows with a packet and a
	// byte limit far above the offered rate (every packet charged, none over),
	// and a row whose every packet is over the limit and dropped.
	liveC2P4Rate     = "client→peer, IPv4 client, full checksum, rate limit on (under it: charged and relayed)"
	liveP2C4Rate     = "peer→client, IPv4 client, full checksum, rate limit on (under it: charged and relayed)"
	liveC2P4RateDrop = "client→peer, IPv4 client, over the rate limit (rate_limited: XDP_DROP)"
)

// writeLiveCost writes the live program cost section, the cost breakdown and
// the map memory table.
func (r *Report) writeLiveCost(b *strings.Builder) {
	if len(r.LiveCost) > 0 {
		b.WriteString("\n### 1a. Live program cost per packet (kernel BPF statistics)\n\n")
		lt := table{head: []string{"traffic", "every run ends in", "runs", "relay program ns/run (median)",
			"trivial XDP_PASS ns/run (median, same intervals)", "× trivial (median of per-interval ratios)", "relay ns/run per interval"}}
		byName := map[string]LiveCostRow{}
		for _, l := range r.LiveCost {
			byName[l.Name] = l
			trivial, ratio := "–", "–"
			if len(l.FloorNs) > 0 {
				trivial, ratio = f(l.FloorMedianNs, 0), f(l.Ratio, 2)
			}
			per := make([]string, len(l.RelayNs))
			for i, v := range l.RelayNs {
				per[i] = f(v, 0)
			}
			lt.add(l.Name, l.Reason, f(float64(l.Runs), 0), f(l.RelayMedianNs, 0), trivial, ratio, strings.Join(per, " / "))
		}
		b.WriteString(lt.String())
		fmt.Fprintf(b, "\nMethod: the relay program attached (native) to both server veths with bindings installed through "+
			"internal/channelmap; 100-byte datagrams from sockets in the client and peer namespaces at %.0f packets/s, "+
			"one traffic kind at a time, in rounds; per interval the growth of run_time_ns / run_cnt of the relay program "+
			"(`kernel.bpf_stats_enabled=1`) and of the trivial XDP_PASS program on the veth that receives the relayed frames "+
			"(peer0 for client→peer, cl0 for peer→client). Senders keep their default offloads (their UDP checksums arrive "+
			"CHECKSUM_PARTIAL, as from containers), except the \"full checksum\" rows (tx checksum offload off on the sender, "+
			"as real NICs deliver them). Every run of an interval must end in the row's verdict (checked against the "+
			"verdict counters).\n", r.LiveCost[0].RatePPS)
		if p, l, fib, c2p := byName[liveParse], byName[liveLookups], byName[liveFIB], byName[liveC2P4Full]; p.Runs > 0 && l.Runs > 0 && fib.Runs > 0 && c2p.Runs > 0 {
			bt := table{head: []string{"part (client→peer, IPv4, full checksum)", "ns/run"}}
			bt.add("parse (Ethernet, IP, UDP) and the verdict counter", f(p.RelayMedianNs, 0))
			bt.add("the relayed packet after parsing: ChannelData, flow cache hit, checks, cached next hop, checksum, resize, rewrite, redirect, counters", f(c2p.RelayMedianNs-p.RelayMedianNs, 0))
			bt.add("total (client→peer, full checksum)", f(c2p.RelayMedianNs, 0))
			if nf := byName[liveC2P4NoFlow]; nf.Runs > 0 {
				bt.add("the same with the flow cache off (listener-destination and binding hash lookups): what the flow cache saves", f(nf.RelayMedianNs-c2p.RelayMedianNs, 0))
				if nc := byName[liveC2P4NoCache]; nc.Runs > 0 {
					bt.add("the same with the next-hop cache off too (bpf_fib_lookup on every packet): what the next-hop cache saves", f(nc.RelayMedianNs-nf.RelayMedianNs, 0))
				}
			}
			if rl := byName[liveC2P4Rate]; rl.Runs > 0 {
				bt.add("the same with a rate limit on (ktime, the allocation bucket's lock and lookup, the charge): what limiting costs", f(rl.RelayMedianNs-c2p.RelayMedianNs, 0))
			}
			bt.add("a packet the caches cannot answer, to its early exit: ChannelData parse, flow cache miss, destination and binding lookups (unbound channel)", f(l.RelayMedianNs-p.RelayMedianNs, 0))
			bt.add("… then the checks and a bpf_fib_lookup ending in no neighbour (a failing lookup costs more than a successful one)", f(fib.RelayMedianNs-l.RelayMedianNs, 0))
			b.WriteString("\nCost breakdown from variants of the same row and the program's early exits (differences of medians):\n\n")
			b.WriteString(bt.String())
		}
	}
	if len(r.MapOps) > 0 {
		b.WriteString("\n### Binding writes at scale\n\n")
		ot := table{head: []string{"operation", "bindings", "per second", "p50 µs", "p99 µs", "max µs"}}
		for _, o := range r.MapOps {
			ot.add(o.Op, f(float64(o.Bindings), 0), f(o.PerSecond, 0), f(o.P50Us, 1), f(o.P99Us, 1), f(o.MaxUs, 0))
		}
		b.WriteString(ot.String())
		b.WriteString("\nEach operation is one internal/channelmap call (Upsert: state slot, peer→client and client→peer " +
			"entries; Delete: both entries and the counters folded into the totals), timed one by one from one goroutine " +
			"while the maps fill from empty to the row's size and empty again.\n")
	}
	if len(r.Memory) > 0 {
		b.WriteString("\n### Map memory\n\n")
		rows := append([]MemoryRow(nil), r.Memory...)
		sort.Slice(rows, func(i, j int) bool {
			if rows[i].Bindings != rows[j].Bindings {
				return rows[i].Bindings < rows[j].Bindings
			}
			return rows[i].CPUs < rows[j].CPUs
		})
		var names []string
		for n := range rows[0].Maps {
			names = append(names, n)
		}
		sort.Strings(names)
		mt := table{head: append(append([]string{"bindings", "CPUs"}, names...), "total MiB", "bytes per binding", "how")}
		for _, m := range rows {
			cells := []string{f(float64(m.Bindings), 0), f(float64(m.CPUs), 0)}
			for _, n := range names {
				cells = append(cells, f(float64(m.Maps[n])/(1<<20), 1))
			}
			how := "computed from entry sizes"
			if m.Measured {
				how = "kernel-reported (fdinfo memlock)"
			}
			cells = append(cells, f(float64(m.Total)/(1<<20), 1), f(float64(m.Total)/float64(m.Bindings), 0), how)
			mt.add(cells...)
		}
		b.WriteString("Per map, MiB:\n\n")
		b.WriteString(mt.String())
	}
}
