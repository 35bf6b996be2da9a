package bpf_test

import (
	"testing"

	"github.com/cilium/ebpf"

	"github.com/l7mp/stunnerd-xdp/bpf"
	"github.com/l7mp/stunnerd-xdp/test/testenv"
)

// TestFibGenComesBackAbove: after the caches were off, the generation comes
// back above every one before, so nothing cached then is valid again.
func TestFibGenComesBackAbove(t *testing.T) {
	testenv.RequireRoot(t)
	m, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.Array, KeySize: 4, ValueSize: 4, MaxEntries: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	defer bpf.ForgetFibGen(m)
	read := func() uint32 {
		var g uint32
		if err := m.Lookup(uint32(0), &g); err != nil {
			t.Fatal(err)
		}
		return g
	}
	if err := bpf.BumpFibGen(m); err != nil || read() != 0 {
		t.Fatalf("a bump while off: generation %d (%v), want 0", read(), err)
	}
	for range 3 {
		if err := bpf.EnableFibGen(m); err != nil {
			t.Fatal(err)
		}
	}
	high := read()
	if err := bpf.DisableFibGen(m); err != nil || read() != 0 {
		t.Fatalf("off: generation %d (%v), want 0", read(), err)
	}
	if err := bpf.EnableFibGen(m); err != nil {
		t.Fatal(err)
	}
	if g := read(); g <= high {
		t.Fatalf("on again at generation %d, at or below %d from before", g, high)
	}
}
