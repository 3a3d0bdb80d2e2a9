package maps

import (
	"context"
	"errors"
	"testing"

	"golang.org/x/sys/unix"
)

// TestClaimGivenUpIsTakenBack: a newer agent that stops while it holds the
// node gives it up (Release), and the older agent it took the node from,
// still running, takes it back (Reclaim). Before, the older agent stayed
// yielded for as long as it ran: after an upgrade rolled back, or a new
// agent that failed its start after claiming, nothing enrolled, detached
// or repaired the node's pods. A claim made since the release wins, and a
// release never clears another agent's claim.
func TestClaimGivenUpIsTakenBack(t *testing.T) {
	ctx := context.Background()
	root := tempBPFFS(t)
	if err := PinLayout(root); err != nil {
		t.Fatal(err)
	}
	claim := func() *Claim {
		c, err := ClaimNode(ctx, root, nil)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	reclaim := func(c *Claim, want bool, when string) {
		t.Helper()
		got, err := c.Reclaim(ctx)
		if err != nil || got != want {
			t.Errorf("%s: Reclaim = %v, %v; want %v", when, got, err, want)
		}
	}
	old := claim()
	reclaim(old, false, "held by the agent itself")
	next := claim()
	if old.Held() || !next.Held() {
		t.Fatalf("after a newer claim: old held %v, new held %v", old.Held(), next.Held())
	}
	reclaim(old, false, "while the newer agent holds the node")
	if _, err := old.Guard(ctx); !errors.Is(err, ErrNotHeld) {
		t.Fatalf("old agent's guard while the newer one holds the node: %v", err)
	}
	// The newer agent stops (a rollback): the older takes the node back.
	if err := next.Release(ctx); err != nil {
		t.Fatal(err)
	}
	if next.Held() || old.Held() {
		t.Fatalf("given up: old held %v, new held %v; want neither", old.Held(), next.Held())
	}
	reclaim(old, true, "given up by the newer agent")
	if !old.Held() {
		t.Fatal("the older agent does not hold the node after taking it back")
	}
	rel, err := old.Guard(ctx)
	if err != nil {
		t.Fatalf("old agent's guard after taking the node back: %v", err)
	}
	rel()
	// A release by an agent that no longer holds the node clears nothing.
	if err := next.Release(ctx); err != nil {
		t.Fatal(err)
	}
	if !old.Held() {
		t.Fatal("a release by an agent that lost the node cleared the holder's claim")
	}
	// Given up, then claimed by a third agent before the older one looks:
	// the older one stays yielded.
	third := claim()
	if err := old.Release(ctx); err != nil { // old no longer holds it: nothing
		t.Fatal(err)
	}
	if !third.Held() {
		t.Fatal("a release by an agent that lost the node cleared the newest claim")
	}
	if err := third.Release(ctx); err != nil {
		t.Fatal(err)
	}
	fourth := claim()
	reclaim(old, false, "claimed by another agent after the release")
	if !fourth.Held() || old.Held() {
		t.Errorf("the older agent took the node from the newest claim: old held %v, newest held %v", old.Held(), fourth.Held())
	}
}

// TestClaimThenRunsUnderTheLock: what an agent does as it claims the node
// or takes it back (ClaimNodeThen, ReclaimThen: point the pinned links at
// its programs) runs once the claim is written and before the pin root's
// exclusive lock is let go, so no other agent's change or claim comes
// between; and not at all when nothing is taken back.
func TestClaimThenRunsUnderTheLock(t *testing.T) {
	ctx := context.Background()
	root := tempBPFFS(t)
	if err := PinLayout(root); err != nil {
		t.Fatal(err)
	}
	// locked reports whether another process's shared lock (a Guard of
	// another agent) would have to wait.
	locked := func() bool {
		fd, err := unix.Open(root, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		if err != nil {
			t.Fatal(err)
		}
		defer unix.Close(fd)
		err = unix.Flock(fd, unix.LOCK_SH|unix.LOCK_NB)
		return errors.Is(err, unix.EWOULDBLOCK)
	}
	var old *Claim
	ran := 0
	var err error
	old, err = ClaimNodeThen(ctx, root, nil, func() {
		ran++
		if !locked() {
			t.Error("the claim's then runs without the pin root's exclusive lock")
		}
	})
	if err != nil || ran != 1 {
		t.Fatalf("claim: %v, then ran %d times, want once", err, ran)
	}
	defer old.Close()
	then := func() {
		ran++
		if !old.Held() {
			t.Error("the take-back's then runs before the claim is written back")
		}
		if !locked() {
			t.Error("the take-back's then runs without the pin root's exclusive lock")
		}
	}
	next, err := ClaimNode(ctx, root, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer next.Close()
	ran = 0
	if back, err := old.ReclaimThen(ctx, then); back || err != nil || ran != 0 {
		t.Fatalf("take-back while the newer agent holds the node: %v %v, then ran %d times, want none", back, err, ran)
	}
	if err := next.Release(ctx); err != nil {
		t.Fatal(err)
	}
	if back, err := old.ReclaimThen(ctx, then); !back || err != nil || ran != 1 {
		t.Fatalf("take-back once given up: %v %v, then ran %d times, want once", back, err, ran)
	}
	if locked() {
		t.Error("the pin root stays locked after the take-back")
	}
}
