package admin

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"testing"
)

// TestReadinessHandover: a second agent binds the same ports (SO_REUSEPORT;
// the old code failed with "address already in use"); once the old one
// closes its readiness endpoint, every probe reaches the new one.
func TestReadinessHandover(t *testing.T) {
	startAt := func(addr string, ready bool) *Servers {
		t.Helper()
		s, err := Start(context.Background(), Options{
			ReadinessAddr: addr, Ready: func() (bool, string) { return ready, "not yet" },
			Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
		})
		if err != nil {
			t.Fatalf("readiness on %s: %v", addr, err)
		}
		t.Cleanup(func() { s.Close() })
		return s
	}
	old := startAt("127.0.0.1:0", true)
	addr := old.ReadinessAddr()
	next := startAt(addr, false)
	if err := old.CloseReadiness(); err != nil {
		t.Fatal(err)
	}
	// A probe queued on the closing socket may be reset (the host's
	// namespace has no tcp_migrate_req): the prober tries again.
	for answered, tries := 0, 0; answered < 20; tries++ {
		if tries > 200 {
			t.Fatal("probes keep failing after the hand-over")
		}
		resp, err := http.Get("http://" + addr + "/healthz/ready")
		if err != nil {
			continue
		}
		resp.Body.Close()
		answered++
		if resp.StatusCode == http.StatusOK {
			t.Fatal("a probe reached the old agent after it closed its readiness endpoint")
		}
	}
	_ = next
}
