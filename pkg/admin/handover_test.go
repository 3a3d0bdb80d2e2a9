package admin

import (
	"context"
	"io"
	"log/slog"
	"net"
	"net/http"
	"testing"
)

// TestReadinessHandover: a second agent takes the very socket of the
// first one's readiness endpoint (the tunnel's hand-over passes it; here a
// duplicate); once the old one closes its readiness endpoint, every probe
// reaches the new one.
func TestReadinessHandover(t *testing.T) {
	var taken net.Listener
	startAt := func(addr string, ready bool) *Servers {
		t.Helper()
		s, err := Start(context.Background(), Options{
			ReadinessAddr: addr, Ready: func() (bool, string) { return ready, "not yet" },
			Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
			Listen: func(ctx context.Context, name, addr string) (net.Listener, error) {
				if taken != nil {
					return taken, nil
				}
				return ListenAlone(ctx, addr)
			},
		})
		if err != nil {
			t.Fatalf("readiness on %s: %v", addr, err)
		}
		t.Cleanup(func() { s.Close() })
		return s
	}
	old := startAt("127.0.0.1:0", true)
	addr := old.ReadinessAddr()
	f, err := old.Listener(EndpointReadiness).(*net.TCPListener).File()
	if err != nil {
		t.Fatal(err)
	}
	taken, err = net.FileListener(f)
	f.Close()
	if err != nil {
		t.Fatal(err)
	}
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
