package hbone

import (
	"context"
	"errors"
	"io"
	"net"
	"os"
	"sync"
	"syscall"
	"testing"
	"time"
)

// A tunnel whose application reads nothing, and sends nothing, holds its
// relay in a write to the application's socket and a read from it. Closing
// the server's connections failed the streams but woke neither, so a
// Shutdown past its deadline (a pod's stop, the agent's drain) waited for
// that relay for as long as the application lived, with the tunnel's
// handler slot, goroutines and socket. Close must close the upstreams too.
func TestShutdownTimeoutClosesUpstreamThatReadsNothing(t *testing.T) {
	e := newEnv(t, dialTarget, ServerOptions{}, PoolOptions{})
	stop := make(chan struct{})
	release := sync.OnceFunc(func() { close(stop) })
	defer release()
	app := startUpstream(t, func(c *net.TCPConn) { <-stop })
	s, err := e.connect(context.Background(), app)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	buf := make([]byte, 1<<20)
	for total := 0; ; {
		_ = s.SetWriteDeadline(time.Now().Add(300 * time.Millisecond))
		n, err := s.Write(buf)
		total += n
		if errors.Is(err, os.ErrDeadlineExceeded) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		if total > 256<<20 {
			t.Fatalf("wrote %d bytes to an application that reads nothing", total)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- e.srv.Shutdown(ctx) }()
	select {
	case err := <-done:
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("shutdown = %v, want deadline exceeded", err)
		}
	case <-time.After(5 * time.Second):
		release() // let the test end
		t.Fatal("Shutdown did not return within 5 s of its deadline: a relay to an application that reads nothing holds it")
	}
}

// The same relay ends when the client resets the stream: before, it held
// the application's socket, its goroutines and the connection's handler
// slot (and the tunnel's limit slot, released when the relay ends) until
// the application sent or read something, however long after the client
// had gone.
func TestStreamResetClosesUpstreamThatReadsNothing(t *testing.T) {
	e := newEnv(t, dialTarget, ServerOptions{}, PoolOptions{})
	stop := make(chan struct{})
	release := sync.OnceFunc(func() { close(stop) })
	defer release()
	appClosed := make(chan struct{})
	app := startUpstream(t, func(c *net.TCPConn) {
		<-stop
		// The relay closed its socket: a read finds the end at once.
		_ = c.SetReadDeadline(time.Now().Add(time.Second))
		if _, err := io.Copy(io.Discard, c); err == nil || errors.Is(err, net.ErrClosed) || isReset(err) {
			close(appClosed)
		}
	})
	s, err := e.connect(context.Background(), app)
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 1<<20)
	for total := 0; ; {
		_ = s.SetWriteDeadline(time.Now().Add(300 * time.Millisecond))
		n, err := s.Write(buf)
		total += n
		if errors.Is(err, os.ErrDeadlineExceeded) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		if total > 256<<20 {
			t.Fatalf("wrote %d bytes to an application that reads nothing", total)
		}
	}
	s.Close() // RST_STREAM(CANCEL)
	deadline := time.Now().Add(5 * time.Second)
	for e.srv.Stats().HandlersHeld != 0 {
		if time.Now().After(deadline) {
			t.Fatalf("5 s after the client reset the stream its relay still holds a handler slot (%d held)", e.srv.Stats().HandlersHeld)
		}
		time.Sleep(10 * time.Millisecond)
	}
	release()
	select {
	case <-appClosed:
	case <-time.After(5 * time.Second):
		t.Fatal("the application's connection was not closed")
	}
}

func isReset(err error) bool { return errors.Is(err, syscall.ECONNRESET) }
