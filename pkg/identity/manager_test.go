package identity

import (
	"errors"
	"sync"
	"testing"
	"time"
)

// fakeClock is a settable time source.
type fakeClock struct {
	mu  sync.Mutex
	now time.Time
}

// newFakeClock starts at a whole second, the resolution of certificate
// times, so expiry arithmetic in tests is exact.
func newFakeClock() *fakeClock { return &fakeClock{now: time.Now().Truncate(time.Second)} }

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	c.now = c.now.Add(d)
	c.mu.Unlock()
}

var (
	idWeb  = ID{TrustDomain: "cluster.local", Namespace: "shop", ServiceAccount: "web"}
	idCart = ID{TrustDomain: "cluster.local", Namespace: "shop", ServiceAccount: "cart"}
)

func TestManagerCachesAndRotates(t *testing.T) {
	clock := newFakeClock()
	m := NewManager(newCA(t, "cluster.local"), time.Hour, clock.Now)

	first, err := m.Certificate(idWeb)
	if err != nil {
		t.Fatal(err)
	}
	clock.Advance(29 * time.Minute)
	same, err := m.Certificate(idWeb)
	if err != nil {
		t.Fatal(err)
	}
	if same != first {
		t.Error("certificate re-minted before half-life")
	}
	clock.Advance(2 * time.Minute) // 31 min: past half of 1h
	rotated, err := m.Certificate(idWeb)
	if err != nil {
		t.Fatal(err)
	}
	if rotated.Leaf.SerialNumber.Cmp(first.Leaf.SerialNumber) == 0 {
		t.Error("certificate not re-minted past half-life")
	}
	if !rotated.Leaf.NotAfter.After(first.Leaf.NotAfter) {
		t.Error("rotated certificate does not live longer")
	}
	// The old certificate value is untouched: connections holding it keep it.
	if first.Leaf.URIs[0].String() != idWeb.String() || len(first.Certificate) != 1 {
		t.Error("rotation modified the previous certificate")
	}
}

func TestManagerSnapshotStates(t *testing.T) {
	clock := newFakeClock()
	m := NewManager(newCA(t, "cluster.local"), time.Hour, clock.Now)
	if _, err := m.Certificate(idWeb); err != nil {
		t.Fatal(err)
	}
	if _, err := m.Certificate(idCart); err != nil {
		t.Fatal(err)
	}

	snap := m.Snapshot()
	if len(snap) != 2 || snap[0].ID != idCart || snap[1].ID != idWeb {
		t.Fatalf("snapshot = %+v, want cart then web", snap)
	}
	for _, ci := range snap {
		if ci.State != StateValid {
			t.Errorf("%s: state %s, want valid", ci.ID, ci.State)
		}
		if ci.ExpiresIn != time.Hour {
			t.Errorf("%s: expires in %s, want 1h", ci.ID, ci.ExpiresIn)
		}
		if ci.Serial == "" || ci.Issuer != "O=cluster.local" {
			t.Errorf("%s: serial %q issuer %q", ci.ID, ci.Serial, ci.Issuer)
		}
	}

	clock.Advance(40 * time.Minute)
	if s := m.Snapshot()[0]; s.State != StateExpiring || s.ExpiresIn != 20*time.Minute {
		t.Errorf("after 40m: %+v, want expiring in 20m", s)
	}
	clock.Advance(30 * time.Minute)
	if s := m.Snapshot()[0]; s.State != StateExpired || s.ExpiresIn != -10*time.Minute {
		t.Errorf("after 70m: %+v, want expired 10m ago", s)
	}
	// The next use replaces the expired certificate.
	if _, err := m.Certificate(idCart); err != nil {
		t.Fatal(err)
	}
	if s := m.Snapshot()[0]; s.State != StateValid {
		t.Errorf("after re-mint: state %s, want valid", s.State)
	}
}

func TestManagerForget(t *testing.T) {
	m := NewManager(newCA(t, "cluster.local"), time.Hour, nil)
	first, err := m.Certificate(idWeb)
	if err != nil {
		t.Fatal(err)
	}
	m.Forget(idWeb)
	m.Forget(idCart) // absent: no-op
	if snap := m.Snapshot(); len(snap) != 0 {
		t.Errorf("snapshot after Forget = %+v", snap)
	}
	again, err := m.Certificate(idWeb)
	if err != nil {
		t.Fatal(err)
	}
	if again.Leaf.SerialNumber.Cmp(first.Leaf.SerialNumber) == 0 {
		t.Error("forgotten certificate came back")
	}
}

func TestManagerRefusesForeignTrustDomain(t *testing.T) {
	m := NewManager(newCA(t, "cluster.local"), 0, nil)
	if _, err := m.Certificate(ID{"example.org", "a", "b"}); err == nil {
		t.Error("minted a certificate for another trust domain")
	}
	if _, err := m.Certificate(ID{}); !errors.Is(err, ErrInvalidID) {
		t.Errorf("zero id: err = %v, want ErrInvalidID", err)
	}
	if snap := m.Snapshot(); len(snap) != 0 {
		t.Errorf("failed mints were cached: %+v", snap)
	}
}

func TestManagerConcurrent(t *testing.T) {
	clock := newFakeClock()
	m := NewManager(newCA(t, "cluster.local"), time.Hour, clock.Now)
	var wg sync.WaitGroup
	for i := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			id := idWeb
			if i%2 == 0 {
				id = idCart
			}
			for range 20 {
				if _, err := m.Certificate(id); err != nil {
					t.Error(err)
					return
				}
				clock.Advance(time.Minute)
				m.Snapshot()
			}
		}()
	}
	wg.Wait()
}
