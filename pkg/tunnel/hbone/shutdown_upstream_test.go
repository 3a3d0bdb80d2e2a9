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

// What a stream received before it was reset still reaches an application
// that reads it: the relay closes the application's socket at once only
// when nothing waits for delivery, else after abortDeliverGrace.
func TestStreamResetDeliversWhatItReceived(t *testing.T) {
	// Small socket buffers on the relay's side too, or the kernel takes
	// everything before the reset.
	e := newEnv(t, func(ctx context.Context, req *ServerRequest) Response {
		resp := dialTarget(ctx, req)
		if c, ok := resp.Upstream.(*net.TCPConn); ok {
			_ = c.SetWriteBuffer(4 << 10)
		}
		return resp
	}, ServerOptions{}, PoolOptions{})
	const size = 2 << 20
	got := make(chan int, 1)
	l, err := net.ListenTCP("tcp", &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	// A small receive buffer, so most of the bytes wait in the stream.
	if rc, err := l.SyscallConn(); err == nil {
		_ = rc.Control(func(fd uintptr) { _ = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVBUF, 4<<10) })
	}
	go func() {
		c, err := l.AcceptTCP()
		if err != nil {
			got <- -1
			return
		}
		defer c.Close()
		time.Sleep(300 * time.Millisecond) // the reset arrives meanwhile
		n, _ := io.Copy(io.Discard, c)
		got <- int(n)
	}()
	s, err := e.connect(context.Background(), l.Addr().(*net.TCPAddr).AddrPort())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Write(make([]byte, size)); err != nil {
		t.Fatal(err)
	}
	time.Sleep(50 * time.Millisecond) // the DATA frames are in before the reset
	s.Close()
	select {
	case n := <-got:
		if n != size {
			t.Errorf("the application read %d bytes, want the %d the stream received before its reset", n, size)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the application's connection was never closed")
	}
}
