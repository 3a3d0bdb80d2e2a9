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
