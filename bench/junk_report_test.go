package bench

import (
	"strings"
	"testing"
)

func TestJunkReport(t *testing.T) {
	row := func(server string, rate float64, echoes, allocates int) JunkRow {
		return JunkRow{Server: server, TargetPPS: rate, JunkSent: 1000, JunkPPS: 100000, EchoesSent: 1000, Echoes: echoes,
			AllocatesTried: 10, Allocates: allocates, ServerCores: 0.1, Counted: server != ServerCoturn}
	}
	r := &Report{Expected: ExpectedRows{JunkRows: 4}, Junk: []JunkRow{
		row(ServerXDPNative, -1, 1000, 10), row(ServerXDPNative, 0, 995, 10), row(ServerXDPOff, 0, 950, 10), row(ServerCoturn, 0, 700, 10)}}
	r.Junk[0].JunkSent = 0
	if errs := r.validateJunk(); len(errs) != 0 {
		t.Fatal(errs)
	}
	tr, ok := r.junkTarget()
	if !ok || tr.Met != "yes" || !strings.Contains(tr.Measured, "XDP: 10/10 Allocates, 99.5 % echoes") {
		t.Fatalf("%+v", tr)
	}
	// Below the bar in a second round: the worst round decides.
	r.Junk = append(r.Junk, row(ServerXDPOff, 0, 800, 10))
	r.Expected.JunkRows++
	if tr, _ := r.junkTarget(); tr.Met != "no" || !strings.Contains(tr.Measured, "off: 10/10 Allocates, 80.0 % echoes") {
		t.Fatalf("%+v", tr)
	}
	r.Junk[2].EchoesSent = 0
	if errs := r.validateJunk(); len(errs) != 1 {
		t.Fatalf("%v", errs)
	}
	var b strings.Builder
	writeJunk(&b, r)
	if !strings.Contains(b.String(), "| coturn | 0 | max |") {
		t.Fatal(b.String())
	}
}
