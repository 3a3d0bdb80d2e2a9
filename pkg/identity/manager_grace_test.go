package identity

import (
	"errors"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/internal/waitfor"
)

// TestManagerReplacedPodKeepsCertificate: a pod is replaced (its last pod
// on the node left, the new one comes seconds later) while the CA is down.
// Before, the identity was forgotten with the old pod, and the new one had
// no certificate until the CA came back, though one was valid seconds
// before; now the kept certificate is served again at once, with no CA
// request, and is not served meanwhile.
func TestManagerReplacedPodKeepsCertificate(t *testing.T) {
	m, f, clock := onFakeClock(t)
	m.Sync([]ID{idWeb})
	addAndWait(t, m, idWeb)
	first := stateOf(m, idWeb).Serial
	f.caDown()

	m.Sync(nil) // the old pod left
	if _, err := m.Certificate(idWeb); !errors.Is(err, ErrNoCertificate) {
		t.Errorf("certificate of an identity whose last pod left still served: err = %v", err)
	}
	if got := unavailable(m, UnavailableNotKept); got != 1 {
		t.Errorf("unavailable{not_enrolled} = %v, want 1", got)
	}
	if info := stateOf(m, idWeb); info.State != StateGrace || info.Serial != first {
		t.Errorf("after the last pod left: state %s serial %s, want %s with serial %s", info.State, info.Serial, StateGrace, first)
	}
	clock.Advance(10 * time.Second)
	m.Sync([]ID{idWeb}) // the replacement
	c, err := m.Certificate(idWeb)
	if err != nil {
		t.Fatalf("replacement pod within the grace period, CA down: %v", err)
	}
	if got := c.Leaf.SerialNumber.Text(16); got != first {
		t.Errorf("replacement served serial %s, want the kept %s", got, first)
	}
	if info := stateOf(m, idWeb); info.State != StateValid {
		t.Errorf("state after the replacement = %s, want valid", info.State)
	}
	if n := f.callCount(); n != 1 {
		t.Errorf("%d CA requests, want the first only", n)
	}
}

// TestManagerGraceEnds: an identity in its grace period is renewed when due
// (a replacement must get a certificate that lasts), not otherwise; being
// forgotten again does not extend the grace, so those kept are no more than
// the identities whose last pod left within it; after the grace it is gone,
// and coming back asks the CA anew.
func TestManagerGraceEnds(t *testing.T) {
	ca := newCA(t, "cluster.local")
	clock := newFakeClock()
	f := &clockSigner{ca: ca, clock: clock.Now} // signs at the clock advanced past the first certificate's end
	m := New(ManagerOptions{Signer: f, Trust: ca, TTL: time.Hour, Clock: clock.Now, ReleaseGrace: time.Hour})
	defer m.Close()
	m.clockCheck = 20 * time.Millisecond
	addAndWait(t, m, idWeb)
	first := stateOf(m, idWeb).Serial

	m.Sync(nil)
	clock.Advance(31 * time.Minute) // past the refresh time (at most half the hour)
	waitfor.Until(t, "the renewal due within the grace period", func() bool {
		info := stateOf(m, idWeb)
		return info.Serial != "" && info.Serial != first
	})
	if n := f.callCount(); n != 2 {
		t.Errorf("%d CA requests, want 2", n)
	}
	if s := stateOf(m, idWeb).State; s != StateGrace {
		t.Errorf("state after the renewal = %s, want %s", s, StateGrace)
	}
	m.Sync(nil) // forgotten again: the grace still ends an hour after the pod left
	clock.Advance(30 * time.Minute)
	waitfor.Until(t, "the identity dropped after the grace", func() bool { return len(m.Snapshot()) == 0 })
	if _, err := m.Certificate(idWeb); !errors.Is(err, ErrNoCertificate) {
		t.Errorf("dropped identity: err = %v", err)
	}

	addAndWait(t, m, idWeb)
	if n := f.callCount(); n != 3 {
		t.Errorf("%d CA requests after coming back past the grace, want 3", n)
	}
}

// TestManagerCloseDropsGrace: closing the manager drops the identities kept
// after their last pod left at once; those of pods still there stay
// readable.
func TestManagerCloseDropsGrace(t *testing.T) {
	ca := newCA(t, "cluster.local")
	m := NewManager(ca, time.Hour, nil)
	addAndWait(t, m, idWeb)
	addAndWait(t, m, idCart)
	m.Sync([]ID{idWeb})
	if s := stateOf(m, idCart).State; s != StateGrace {
		t.Fatalf("state = %s, want %s", s, StateGrace)
	}
	m.Close()
	if snap := m.Snapshot(); len(snap) != 1 || snap[0].ID != idWeb {
		t.Errorf("snapshot after Close = %+v, want %s only", snap, idWeb)
	}
	m.Forget(idWeb) // after Close: dropped at once, no worker left to end a grace
	if n := len(m.Snapshot()); n != 0 {
		t.Errorf("%d identities after Close and Forget", n)
	}
}

// TestManagerNoGraceWhenNegative: a negative ReleaseGrace drops an identity
// with its last pod, as before grace periods.
func TestManagerNoGraceWhenNegative(t *testing.T) {
	ca := newCA(t, "cluster.local")
	m := New(ManagerOptions{Signer: ca, Trust: ca, TTL: time.Hour, ReleaseGrace: -1})
	defer m.Close()
	addAndWait(t, m, idWeb)
	m.Sync(nil)
	if n := len(m.Snapshot()); n != 0 {
		t.Errorf("%d identities kept with no grace", n)
	}
}
