package hbone

import (
	"errors"
	"io"
	"syscall"
	"testing"
	"time"
)

// TestRelayPassesResetOn: a TCP relay whose side is reset closes its other
// side with a reset too, as the peer's reset would have reached it without
// the relay; closed with a FIN, the relay's socket closed first and waited
// 60 s in TIME_WAIT on its port (TestResetClientLeavesNoTimeWait in
// test/netns). A relay that ends with EOF both ways still closes with FINs.
func TestRelayPassesResetOn(t *testing.T) {
	for _, reset := range []bool{true, false} {
		app, a := tcpPair(t)
		up, b := tcpPair(t)
		done := make(chan error, 1)
		go func() {
			_, _, err := Relay(a, b)
			done <- err
		}()
		if _, err := app.Write([]byte("x")); err != nil {
			t.Fatal(err)
		}
		up.SetDeadline(time.Now().Add(5 * time.Second))
		if _, err := io.ReadFull(up, make([]byte, 1)); err != nil {
			t.Fatalf("relayed byte: %v", err)
		}
		if reset {
			app.SetLinger(0)
			app.Close()
		} else {
			app.CloseWrite()
			up.CloseWrite()
		}
		_, err := up.Read(make([]byte, 1))
		switch {
		case reset && !errors.Is(err, syscall.ECONNRESET):
			t.Errorf("upstream read after the app's reset: %v, want ECONNRESET", err)
		case !reset && err != io.EOF:
			t.Errorf("upstream read after the app's FIN: %v, want EOF", err)
		}
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			t.Fatal("relay did not end")
		}
		app.Close()
		up.Close()
	}
}
