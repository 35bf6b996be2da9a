package byteorder

import (
	"encoding/binary"
	"testing"
)

func TestHtons(t *testing.T) {
	for _, v := range []uint16{0, 1, 0x1234, 3478, 0xff00, 0xffff} {
		var mem [2]byte
		binary.NativeEndian.PutUint16(mem[:], Htons(v))
		if got := binary.BigEndian.Uint16(mem[:]); got != v {
			t.Errorf("Htons(%#x) lays out %x in memory, want %#x big-endian", v, mem, v)
		}
		if Htons(Htons(v)) != v {
			t.Errorf("Htons is not its own inverse at %#x", v)
		}
	}
}
