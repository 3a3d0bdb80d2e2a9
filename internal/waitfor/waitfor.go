// Package waitfor polls a condition in tests. State that another goroutine
// writes is waited for where the test asserts on it, never with a fixed
// sleep and never through something that happens before it is written.
package waitfor

import (
	"testing"
	"time"
)

// Timeout bounds Until: generous, for a loaded CI machine.
const Timeout = 10 * time.Second

// Until polls cond every few milliseconds until it holds, and fails t,
// naming what it waited for, if it does not within Timeout.
func Until(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(Timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", Timeout, what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// Returns runs fn on a goroutine of its own and returns its error. It fails
// t, naming what, if fn has not returned within Timeout: a call that would
// block for ever (an open or a read of a fifo) fails the test instead of
// hanging it. The goroutine is left blocked then.
func Returns(t testing.TB, what string, fn func() error) error {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- fn() }()
	select {
	case err := <-done:
		return err
	case <-time.After(Timeout):
		t.Fatalf("%s did not return within %s", what, Timeout)
		return nil
	}
}
