package listener

import (
	"net"
	"testing"
	"time"

	"github.com/pion/turn/v4"
)

// TestHookGate: close waits for a hook that is running, and hooks after it
// do nothing; hooks that were never set stay unset.
func TestHookGate(t *testing.T) {
	var g gate
	inHook, release := make(chan struct{}), make(chan struct{})
	calls := 0
	h := g.wrap(turn.EventHandler{OnAllocationDeleted: func(_, _ net.Addr, _, _, _ string) {
		calls++
		if calls == 1 {
			close(inHook)
			<-release
		}
	}})
	if h.OnChannelCreated != nil {
		t.Error("wrap set a hook that was not set")
	}
	go h.OnAllocationDeleted(nil, nil, "UDP", "u", "r")
	<-inHook
	closed := make(chan struct{})
	go func() { g.close(); close(closed) }()
	select {
	case <-closed:
		t.Fatal("close returned while a hook ran")
	case <-time.After(50 * time.Millisecond):
	}
	close(release)
	<-closed
	h.OnAllocationDeleted(nil, nil, "UDP", "u", "r")
	if calls != 1 {
		t.Errorf("%d calls, want 1: a hook ran after close", calls)
	}
}
