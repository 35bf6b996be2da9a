package userspace

import (
	"net"
	"testing"

	"github.com/pion/stun/v3"
)

func TestRelayedData(t *testing.T) {
	dataInd, err := stun.Build(stun.TransactionID, stun.NewType(stun.MethodData, stun.ClassIndication),
		stun.RawAttribute{Type: stun.AttrData, Value: make([]byte, 33)})
	if err != nil {
		t.Fatal(err)
	}
	sendInd, _ := stun.Build(stun.TransactionID, stun.NewType(stun.MethodSend, stun.ClassIndication),
		stun.RawAttribute{Type: stun.AttrData, Value: make([]byte, 33)})
	resp, _ := stun.Build(stun.TransactionID, stun.BindingSuccess, &stun.XORMappedAddress{IP: net.IPv4(1, 2, 3, 4), Port: 5})
	for _, c := range []struct {
		name string
		msg  []byte
		n    int
		ok   bool
	}{
		{"channel data", []byte{0x40, 0x00, 0x00, 0x03, 1, 2, 3, 0}, 3, true},
		{"data indication", dataInd.Raw, 33, true},
		{"send indication is not to a client", sendInd.Raw, 0, false},
		{"binding response", resp.Raw, 0, false},
		{"short", []byte{0x40, 0}, 0, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			n, ok := relayedData(c.msg)
			if n != c.n || ok != c.ok {
				t.Fatalf("relayedData = %d, %v; want %d, %v", n, ok, c.n, c.ok)
			}
		})
	}
}
