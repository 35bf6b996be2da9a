package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestReport: samples are counted only with the program on the stack, the
// program's own by the line whose JIT range holds their offset.
func TestReport(t *testing.T) {
	lines := filepath.Join(t.TempDir(), "lines.txt")
	table := "ffffffffc0000000:200 0 relay.c:10 int xdp_turn_relay(struct xdp_md *ctx)\n" +
		"ffffffffc0000000:200 40 relay.c:20 parse\n" +
		"ffffffffc0000000:200 80 relay.c:30 lookup\n"
	if err := os.WriteFile(lines, []byte(table), 0o644); err != nil {
		t.Fatal(err)
	}
	script := `
ffffffffc0000044 bpf_prog_abc_xdp_turn_relay+0x44
ffffffff81000000 veth_xdp_rcv_skb+0x10

ffffffffc0000090 bpf_prog_abc_xdp_turn_relay+0x90
ffffffff81000000 veth_xdp_rcv_skb+0x10

ffffffffc0000050 bpf_prog_abc_xdp_turn_relay+0x50

ffffffffd0000050 bpf_prog_def_xdp_turn_relay+0x50

ffffffff81234567 dev_hash_map_redirect+0x7
ffffffffc0000120 bpf_prog_abc_xdp_turn_relay+0x120
ffffffff81000000 veth_xdp_rcv_skb+0x10

ffffffff81000000 udp_sendmsg+0x10
ffffffff81000001 __sys_sendto+0x10
`
	var out strings.Builder
	if err := report(lines, strings.NewReader(script), &out); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"5 samples with xdp_turn_relay on the stack",
		"3  60.0%  bpf_prog_abc_xdp_turn_relay",
		"1  20.0%  bpf_prog_def_xdp_turn_relay",
		"1  20.0%  dev_hash_map_redirect",
		"4 samples in the program itself",
		"2  50.0%  relay.c:20 parse",
		"1  25.0%  relay.c:30 lookup",
		"1  25.0%  (no line table for the program at ffffffffd0000050)",
	} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("report lacks %q:\n%s", want, out.String())
		}
	}
	if err := report(lines, strings.NewReader("ffffffff81000000 udp_sendmsg+0x10\n"), &out); err == nil {
		t.Error("a capture without the program gave no error")
	}
}
