package bpf_test

import (
	"testing"

	"github.com/cilium/ebpf"

	"github.com/l7mp/stunnerd-xdp/bpf"
	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// TestFibGenComesBackAbove: after the caches were off, the generation comes
// back above every one before, so nothing cached then is valid again; also
// through another FibGen over the same map (what it remembers is in the map).
func TestFibGenComesBackAbove(t *testing.T) {
	testenv.RequireRoot(t)
	spec, err := bpf.LoadRelay()
	if err != nil {
		t.Fatal(err)
	}
	m, err := ebpf.NewMap(spec.Maps["fib_gen"])
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	read := func() uint32 {
		var g uint32
		if err := m.Lookup(uint32(0), &g); err != nil {
			t.Fatal(err)
		}
		return g
	}
	g := bpf.NewFibGen(m)
	if err := g.Bump(); err != nil || read() != 0 {
		t.Fatalf("a bump while off: generation %d (%v), want 0", read(), err)
	}
	for range 3 {
		if err := g.Enable(); err != nil {
			t.Fatal(err)
		}
	}
	high := read()
	if err := g.Disable(); err != nil || read() != 0 {
		t.Fatalf("off: generation %d (%v), want 0", read(), err)
	}
	if err := bpf.NewFibGen(m).Enable(); err != nil {
		t.Fatal(err)
	}
	if g := read(); g <= high {
		t.Fatalf("on again at generation %d, at or below %d from before", g, high)
	}
}
