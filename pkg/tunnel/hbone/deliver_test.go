package hbone

import (
	"bytes"
	"context"
	"crypto/sha256"
	"io"
	"net"
	"testing"
	"time"
)

// TestDirectDelivery: the server's reader writes arriving bytes into the app's socket itself,
// and queues what the socket does not take for WriteTo. The bytes arrive intact and in order,
// and the relay's count, which metrics report, includes what the reader wrote. Run against an
// app that reads at once and one that slows down after its first slowAfter bytes, so that its
// socket fills and delivery mixes direct writes, partial writes and queued bytes. (An app slow
// from the start may see no direct write at all: if the first frames arrive before the relay's
// WriteTo runs, they queue, and a full socket keeps the queue from ever emptying.)
func TestDirectDelivery(t *testing.T) {
	const size = 24 << 20
	want := sha256.New()
	_, _ = io.Copy(want, io.LimitReader(newPRNGReader(3), size))
	const slowAfter = 8 << 20
	for _, tc := range []struct {
		name  string
		pause time.Duration // between the app's reads, after slowAfter bytes
	}{{"fast app", 0}, {"slow app", 2 * time.Millisecond}} {
		t.Run(tc.name, func(t *testing.T) {
			got := make(chan []byte, 1)
			app := startUpstream(t, func(c *net.TCPConn) {
				h := sha256.New()
				buf := make([]byte, 32<<10)
				read := 0
				for {
					n, err := c.Read(buf)
					h.Write(buf[:n])
					if err != nil {
						break
					}
					if read += n; read > slowAfter {
						time.Sleep(tc.pause)
					}
				}
				got <- h.Sum(nil)
			})
			counted := make(chan int64, 1)
			e := newEnv(t, func(ctx context.Context, req *ServerRequest) Response {
				r := dialTarget(ctx, req)
				r.Done = func(fromClient, _ int64, _ error) { counted <- fromClient }
				return r
			}, ServerOptions{}, PoolOptions{})
			s, err := e.connect(context.Background(), app)
			if err != nil {
				t.Fatal(err)
			}
			defer s.Close()
			before := directBytes.Load()
			if _, err := s.ReadFrom(io.LimitReader(newPRNGReader(3), size)); err != nil {
				t.Fatal(err)
			}
			_ = s.CloseWrite()
			if !bytes.Equal(<-got, want.Sum(nil)) {
				t.Fatal("the app received other bytes than were sent")
			}
			if n := <-counted; n != size {
				t.Errorf("the relay counted %d bytes to the app, sent %d", n, size)
			}
			direct := directBytes.Load() - before
			if direct == 0 {
				t.Error("the reader wrote nothing to the app's socket itself")
			}
			if tc.pause > 0 && direct == size {
				t.Error("the reader wrote everything itself to an app that stopped keeping up: nothing was queued")
			}
			t.Logf("%d of %d bytes written by the reader", direct, size)
		})
	}
}

// TestDeliveryNeverBlocksReader: the reader's writes never wait for a socket. One stream's app
// stops reading; its socket fills while that stream's window allows; the other stream on the
// same connection keeps flowing.
func TestDeliveryNeverBlocksReader(t *testing.T) {
	stop := make(chan struct{})
	stuck := startUpstream(t, func(c *net.TCPConn) {
		_ = c.SetReadBuffer(4 << 10)
		<-stop
	})
	defer close(stop)
	echoApp := startUpstream(t, echo)
	e := newEnv(t, dialTarget, ServerOptions{}, PoolOptions{})

	a, err := e.connect(context.Background(), stuck)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	// Fill the stuck app's socket and the stream's window behind it.
	go func() { _, _ = a.ReadFrom(io.LimitReader(newPRNGReader(1), streamWindow+(8<<20))) }()
	time.Sleep(300 * time.Millisecond)

	b, err := e.connect(context.Background(), echoApp)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	if a.c != b.c {
		t.Fatal("the two streams are not on one connection: the test would prove nothing")
	}
	const size = 4 << 20
	done := make(chan error, 1)
	go func() {
		_, err := b.ReadFrom(io.LimitReader(newPRNGReader(2), size))
		if err == nil {
			err = b.CloseWrite()
		}
		done <- err
	}()
	_ = b.SetReadDeadline(time.Now().Add(20 * time.Second))
	n, err := io.Copy(io.Discard, b)
	if err != nil || n != size {
		t.Fatalf("the second stream got %d of %d bytes back: %v", n, size, err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

// TestWriteNowDoesNotWait: the reader's write into a full socket returns at once with what the
// socket took (nothing, once it is full), instead of waiting for the app to read.
func TestWriteNowDoesNotWait(t *testing.T) {
	stop := make(chan struct{})
	defer close(stop)
	app := startUpstream(t, func(*net.TCPConn) { <-stop }) // never reads
	c, err := net.DialTCP("tcp", nil, net.TCPAddrFromAddrPort(app))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	sink := rawSink(c)
	if sink == nil {
		t.Fatal("a TCP socket has no raw sink")
	}
	buf := make([]byte, 1<<20)
	for total := 0; ; {
		done := make(chan int, 1)
		go func() { done <- writeNow(sink, [][]byte{buf[:512<<10], buf[512<<10:]}) }()
		select {
		case n := <-done:
			total += n
			if n == 0 {
				t.Logf("the socket took %d bytes before it was full", total)
				return
			}
			if total > 256<<20 {
				t.Fatal("a socket nobody reads took 256 MiB")
			}
		case <-time.After(5 * time.Second):
			t.Fatal("writeNow waited for a full socket")
		}
	}
}

// TestLargeFramesHandedOff: a peer may send DATA frames up to our 1 MiB SETTINGS_MAX_FRAME_SIZE;
// the reader delivers one of our own bulk size itself, but hands a larger one to the stream's
// writer, so no frame makes the other streams wait for more than one 256 KiB write.
func TestLargeFramesHandedOff(t *testing.T) {
	checkGoroutines(t)
	got := make(chan int64, 1)
	app := startUpstream(t, func(c *net.TCPConn) {
		n, _ := io.Copy(io.Discard, c)
		got <- n
	})
	srv := newFuzzServer(t)
	srv.opts.Handler = dialTarget

	fr, answered := rawStream(t, srv, app.String(), 10*time.Second)
	<-answered

	var sent int64
	send := func(size int, end bool) (direct int64) {
		t.Helper()
		before := directBytes.Load()
		if err := fr.WriteData(1, end, make([]byte, size)); err != nil {
			t.Fatal(err)
		}
		sent += int64(size)
		// The reader handled the frame once the next frame gets through the synchronous pipe.
		if err := fr.WritePing(false, [8]byte{}); err != nil {
			t.Fatal(err)
		}
		return directBytes.Load() - before
	}
	// Frames of our own bulk size until the relay's writer waits and one is delivered.
	delivered := false
	for range 50 {
		if send(bulkFrameSize, false) > 0 {
			delivered = true
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if !delivered {
		t.Fatal("no frame of our own bulk size was delivered by the reader: the test would prove nothing")
	}
	time.Sleep(20 * time.Millisecond) // the writer is waiting again
	if d := send(bulkFrameSize+1, false); d != 0 {
		t.Fatalf("the reader wrote %d bytes of a frame over the bulk size itself", d)
	}
	if d := send(maxReadFrameSize, true); d != 0 {
		t.Fatalf("the reader wrote %d bytes of a 1 MiB frame itself", d)
	}
	select {
	case n := <-got:
		if want := sent; n != want {
			t.Fatalf("the app got %d bytes, want %d", n, want)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the app never saw the end of the stream")
	}
}

// TestSmallFramesDelivered: small DATA frames (a request, a 1-byte message) are written into
// the app's socket by the reader too, while the relay's writer waits, and arrive intact.
func TestSmallFramesDelivered(t *testing.T) {
	checkGoroutines(t)
	got := make(chan []byte, 1)
	app := startUpstream(t, func(c *net.TCPConn) {
		b, _ := io.ReadAll(c)
		got <- b
	})
	srv := newFuzzServer(t)
	srv.opts.Handler = dialTarget

	fr, answered := rawStream(t, srv, app.String(), 10*time.Second)
	<-answered

	var sent []byte
	send := func(p []byte, end bool) (direct int64) {
		t.Helper()
		before := directBytes.Load()
		if err := fr.WriteData(1, end, p); err != nil {
			t.Fatal(err)
		}
		sent = append(sent, p...)
		// The reader handled the frame once the next frame gets through the synchronous pipe.
		if err := fr.WritePing(false, [8]byte{}); err != nil {
			t.Fatal(err)
		}
		return directBytes.Load() - before
	}
	delivered := false
	for i := range 50 {
		if send([]byte{byte(i)}, false) > 0 {
			delivered = true
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if !delivered {
		t.Fatal("no 1-byte frame was written by the reader itself")
	}
	for i, size := range []int{1, 1024, 1, 16 << 10, 100} {
		p := bytes.Repeat([]byte{byte('a' + i)}, size)
		if d := send(p, false); d != int64(size) {
			t.Fatalf("frame %d: the reader wrote %d of its %d bytes itself, want all of them", i, d, size)
		}
	}
	send([]byte("end"), true)
	select {
	case b := <-got:
		if !bytes.Equal(b, sent) {
			t.Fatalf("the app got %d bytes that differ from the %d sent", len(b), len(sent))
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the app never saw the end of the stream")
	}
}
