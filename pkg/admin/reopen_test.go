package admin

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

// TestReopenReadiness: an agent that closed its readiness endpoint when a
// newer agent took the node serves it again, on the same address, when
// that agent gave the node back (an upgrade rolled back). While the newer
// agent still holds the port (it drains) the endpoint is bound once the
// port is free. Before, it stayed closed: the node's readiness and
// liveness probes found nothing on the port once the newer agent was gone.
func TestReopenReadiness(t *testing.T) {
	s, err := Start(context.Background(), Options{
		ReadinessAddr: "127.0.0.1:0", Ready: func() (bool, string) { return true, "" },
		Logger:    slog.New(slog.NewTextHandler(io.Discard, nil)),
		bindRetry: 20 * time.Millisecond,
	})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	addr := s.ReadinessAddr()
	if err := s.ReopenReadiness(context.Background()); err != nil {
		t.Fatalf("reopen while served: %v", err)
	}
	if code, _ := get(t, "http://"+addr+"/healthz/ready"); code != http.StatusOK {
		t.Fatalf("readiness before the yield: %d", code)
	}
	if err := s.CloseReadiness(); err != nil {
		t.Fatal(err)
	}
	if c, err := net.DialTimeout("tcp", addr, time.Second); err == nil {
		c.Close()
		t.Fatal("the readiness port still accepts after CloseReadiness")
	}
	// The newer agent holds the port while it drains.
	newer, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.ReopenReadiness(context.Background()); err != nil {
		t.Fatalf("reopen while the port is held: %v, want it bound later", err)
	}
	time.Sleep(100 * time.Millisecond) // a few binds fail
	newer.Close()
	deadline := time.Now().Add(5 * time.Second)
	for {
		resp, err := (&http.Client{Timeout: time.Second}).Get("http://" + addr + "/healthz/ready")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				break
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("readiness not served again once the port is free: %v", err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	if l := s.Listener(EndpointReadiness); l == nil || l.Addr().String() != addr {
		t.Errorf("the readiness listener to hand over is %v, want the one bound again on %s", l, addr)
	}
	// Closing again closes the new one.
	if err := s.CloseReadiness(); err != nil {
		t.Fatal(err)
	}
	if c, err := net.DialTimeout("tcp", addr, time.Second); err == nil {
		c.Close()
		t.Error("the readiness port still accepts after the second CloseReadiness")
	}
}

// TestReopenReadinessNeverBoundAtFirst: a readiness endpoint whose port was
// held when the agent started, and that it closed before binding it (a
// newer agent took the node), is judged by its new listener once served
// again: the first one's bind error no longer makes the agent unready.
func TestReopenReadinessNeverBoundAtFirst(t *testing.T) {
	busy, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := busy.Addr().String()
	s, err := Start(context.Background(), Options{
		ReadinessAddr: addr, Ready: func() (bool, string) { return true, "" },
		Logger:    slog.New(slog.NewTextHandler(io.Discard, nil)),
		bindRetry: time.Hour,
	})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if err := s.CloseReadiness(); err != nil {
		t.Fatal(err)
	}
	busy.Close()
	if err := s.ReopenReadiness(context.Background()); err != nil {
		t.Fatal(err)
	}
	resp, err := (&http.Client{Timeout: 2 * time.Second}).Get("http://" + addr + "/healthz/ready")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Errorf("readiness served again: %d %q, want 200", resp.StatusCode, body)
	}
}

// TestReopenReadinessRetried: a readiness endpoint that cannot be served
// again after a take-back for another reason than its port still being
// held (here, no descriptor left) is tried again until it is served, and
// no longer once the agent yields the node again. Before, one failure left
// the agent unready for good, and the chart's liveness probe restarted it.
func TestReopenReadinessRetried(t *testing.T) {
	var failing atomic.Bool
	s, err := Start(context.Background(), Options{
		ReadinessAddr: "127.0.0.1:0", Ready: func() (bool, string) { return true, "" },
		Logger:      slog.New(slog.NewTextHandler(io.Discard, nil)),
		reopenRetry: 10 * time.Millisecond,
		Listen: func(ctx context.Context, _, addr string) (net.Listener, error) {
			if failing.Load() {
				return nil, syscall.EMFILE
			}
			return ListenAlone(ctx, addr)
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	addr := s.ReadinessAddr()
	served := func() bool {
		resp, err := (&http.Client{Timeout: time.Second}).Get("http://" + addr + "/healthz/ready")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	}

	if err := s.CloseReadiness(); err != nil {
		t.Fatal(err)
	}
	failing.Store(true)
	if err := s.ReopenReadiness(context.Background()); !errors.Is(err, syscall.EMFILE) {
		t.Fatalf("reopen with no descriptor left: %v, want EMFILE", err)
	}
	time.Sleep(50 * time.Millisecond) // a few tries fail
	if served() {
		t.Fatal("readiness served while its listen fails")
	}
	failing.Store(false)
	deadline := time.Now().Add(5 * time.Second)
	for !served() {
		if time.Now().After(deadline) {
			t.Fatal("readiness not served again once its listen works: the failed reopen was not retried")
		}
		time.Sleep(10 * time.Millisecond)
	}

	// A yield ends the retries: the port stays closed to the newer agent.
	if err := s.CloseReadiness(); err != nil {
		t.Fatal(err)
	}
	failing.Store(true)
	if err := s.ReopenReadiness(context.Background()); err == nil {
		t.Fatal("reopen with no descriptor left succeeded")
	}
	if err := s.CloseReadiness(); err != nil {
		t.Fatal(err)
	}
	failing.Store(false)
	time.Sleep(200 * time.Millisecond) // retries would have served it by now
	if c, err := net.DialTimeout("tcp", addr, time.Second); err == nil {
		c.Close()
		t.Error("readiness served again after the agent yielded the node once more")
	}
}
