package hbone

import (
	"bytes"
	"context"
	"crypto/sha256"
	"io"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/internal/waitfor"
)

// TestDirectDelivery: the server's reader writes arriving bytes into the app's socket itself,
// and queues what the socket does not take for WriteTo. The bytes arrive intact and in order,
// and the relay's count, which metrics report, includes what the reader wrote. Run against an
// app that reads at once and one that stops reading after its first slowAfter bytes until its
// socket filled (the server's stream holds bytes queued for WriteTo) and the sender spent the
// stream's window, then reads on: delivery mixes direct writes, partial writes and queued bytes.
// Both are waited for as the state they are: a pause of fixed length proved nothing in race
// builds, whose sender is slower than such an app, and "the sender made no progress for 100 ms"
// also held while the server's reader, not the app, lagged (a loaded machine), or once the sender
// had sent everything into an autotuned socket large enough to hold it: the app read on, nothing
// was queued and the test failed on a correct server. (An app
// slow from the start may see no direct write at all: if the first frames arrive before the
// relay's WriteTo runs, they queue, and a full socket keeps the queue from ever emptying.)
func TestDirectDelivery(t *testing.T) {
	const size = 24 << 20
	want := sha256.New()
	_, _ = io.Copy(want, io.LimitReader(newPRNGReader(3), size))
	const slowAfter = 8 << 20
	for _, tc := range []struct {
		name  string
		stall bool // stop reading after slowAfter bytes until the sender stalls
	}{{"fast app", false}, {"slow app", true}} {
		t.Run(tc.name, func(t *testing.T) {
			var sent atomic.Int64 // what the sender read from its source so far
			got := make(chan []byte, 1)
			// full reports whether the app's socket filled and the sender stalled; the test
			// sends it once the stream exists.
			fullc := make(chan func() bool, 1)
			app := startUpstream(t, func(c *net.TCPConn) {
				if tc.stall {
					// A fixed receive buffer: autotuned, it grew on loopback (up to
					// tcp_rmem's 32 MiB here) until it held all the rest, so nothing
					// was queued and the test failed on a correct server.
					_ = c.SetReadBuffer(256 << 10)
				}
				h := sha256.New()
				buf := make([]byte, 32<<10)
				read, stalled := 0, !tc.stall
				for {
					n, err := c.Read(buf)
					h.Write(buf[:n])
					if err != nil {
						break
					}
					if read += n; read > slowAfter && !stalled {
						stalled = true
						// Bounded: a reader that never queues (one that waits for the
						// socket, or writes everything itself) fails the test below.
						deadline := time.Now().Add(waitfor.Timeout)
						select {
						case full := <-fullc:
							for !full() && time.Now().Before(deadline) {
								time.Sleep(5 * time.Millisecond)
							}
						case <-time.After(waitfor.Timeout):
						}
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
			fullc <- func() bool { return serverQueued(e.srv) > 0 && (s.sendRoom() == 0 || sent.Load() == size) }
			before := directBytes.Load()
			src := &countingReader{r: io.LimitReader(newPRNGReader(3), size), n: &sent}
			if _, err := s.ReadFrom(src); err != nil {
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
			if tc.stall && direct == size {
				t.Error("the reader wrote everything itself to an app that stopped keeping up: nothing was queued")
			}
			t.Logf("%d of %d bytes written by the reader", direct, size)
		})
	}
}

// serverQueued is what srv's streams hold queued for their relays' writers:
// bytes the reader did not, or could not, write into the apps' sockets itself.
func serverQueued(srv *Server) int {
	srv.mu.Lock()
	var conns []*conn
	for sc := range srv.conns {
		conns = append(conns, sc)
	}
	srv.mu.Unlock()
	var streams []*Stream
	for _, sc := range conns {
		sc.mu.Lock()
		for _, s := range sc.streams {
			streams = append(streams, s)
		}
		sc.mu.Unlock()
	}
	n := 0
	for _, s := range streams {
		s.mu.Lock()
		n += s.buf.n
		s.mu.Unlock()
	}
	return n
}

// countingReader counts what is read through it.
type countingReader struct {
	r io.Reader
	n *atomic.Int64
}

func (c *countingReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.n.Add(int64(n))
	return n, err
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
		go func() { done <- sink.writeNow([][]byte{buf[:512<<10], buf[512<<10:]}) }()
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

// TestSmallFramesDelivered: small DATA frames, alone or in a burst (one TLS record holding
// frames of several streams, as a sender coalesces concurrent requests), are written into the
// apps' sockets by the reader itself, not handed to the relays' writers. Every byte arrives, in
// order.
func TestSmallFramesDelivered(t *testing.T) {
	e := newEnv(t, dialTarget, ServerOptions{}, PoolOptions{})
	const n = 3
	var (
		streams [n]*Stream
		got     [n]chan []byte
		sent    [n][]byte
		arrived [n]atomic.Int64 // what each app has read so far
	)
	for i := range n {
		got[i] = make(chan []byte, 1)
		app := startUpstream(t, func(c *net.TCPConn) {
			b, _ := io.ReadAll(&countingReader{r: c, n: &arrived[i]})
			got[i] <- b
		})
		s, err := e.connect(context.Background(), app)
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		streams[i] = s
	}
	c := streams[0].c
	if streams[1].c != c || streams[2].c != c {
		t.Fatal("the streams are not on one connection: the test would prove nothing")
	}
	type frame struct {
		stream int
		p      []byte
	}
	// send writes frames into one TLS record, bypassing the streams' flow control (they are
	// far inside the windows).
	send := func(frames ...frame) {
		t.Helper()
		c.wmu.Lock()
		defer c.wmu.Unlock()
		for _, f := range frames {
			if err := c.fr.WriteData(streams[f.stream].id, false, f.p); err != nil {
				t.Fatal(err)
			}
			sent[f.stream] = append(sent[f.stream], f.p...)
		}
		if err := c.bw.Flush(); err != nil {
			t.Fatal(err)
		}
	}
	// waitDirect waits until the readers wrote want more bytes themselves, and a little longer
	// to catch any beyond.
	waitDirect := func(before, want int64) int64 {
		t.Helper()
		deadline := time.Now().Add(5 * time.Second)
		for directBytes.Load()-before < want && time.Now().Before(deadline) {
			time.Sleep(time.Millisecond)
		}
		time.Sleep(50 * time.Millisecond)
		return directBytes.Load() - before
	}

	// Warm the connection up as traffic would: past crypto/tls's small first records
	// (dynamic record sizing, the first 128 KiB), and with full records read, so the
	// server's TLS reads a whole record of frames at once.
	for range 10 {
		send(frame{0, bytes.Repeat([]byte("w"), 16<<10)})
	}
	send(frame{1, []byte("hello")}, frame{2, []byte("hello")})
	// The reader delivers a frame itself only while the stream's WriteTo
	// waits with nothing buffered (Stream.deliverLocked's caller), and
	// what was sent before must have reached the apps, or it would count
	// with what follows: both are waited for. Sleeps of 100 and 50 ms
	// stood for them, and a relay started late (a loaded VM, -race) had
	// its frames queued and the test fail on a correct server.
	settled := func() bool {
		for i := range n {
			if arrived[i].Load() != int64(len(sent[i])) {
				return false
			}
		}
		e.srv.mu.Lock()
		var conns []*conn
		for sc := range e.srv.conns {
			conns = append(conns, sc)
		}
		e.srv.mu.Unlock()
		var streams []*Stream
		for _, sc := range conns {
			sc.mu.Lock()
			for _, s := range sc.streams {
				streams = append(streams, s)
			}
			sc.mu.Unlock()
		}
		waiting := 0
		for _, s := range streams {
			s.mu.Lock()
			if s.sink != nil && !s.draining && s.buf.n == 0 && !s.closed {
				waiting++
			}
			s.mu.Unlock()
		}
		return waiting == n
	}
	waitfor.Until(t, "the server's relays waiting with nothing buffered", settled)

	before := directBytes.Load()
	send(frame{1, []byte("lone")})
	if d := waitDirect(before, 4); d != 4 {
		t.Fatalf("the reader wrote %d bytes of a lone 4-byte frame itself, want 4", d)
	}
	waitfor.Until(t, "the server's relays waiting again", settled)
	burst := []frame{
		{0, []byte("first")},
		{1, bytes.Repeat([]byte("b"), 1024)},
		{2, []byte("c")},
		{1, []byte("b again")},
		{2, bytes.Repeat([]byte("c"), 4096)},
	}
	var want int64
	for _, f := range burst {
		want += int64(len(f.p))
	}
	// But stream 1's second frame of the read, a tiny one: it is queued for
	// the stream's writer (TestTinyDataFramesCoalesced).
	want -= int64(len("b again"))
	before = directBytes.Load()
	send(burst...)
	if d := waitDirect(before, want); d != want {
		t.Fatalf("the reader wrote %d bytes of a burst itself, want %d (the frames of streams with nothing queued)", d, want)
	}
	for i, s := range streams {
		if err := s.CloseWrite(); err != nil {
			t.Fatal(err)
		}
		select {
		case b := <-got[i]:
			if !bytes.Equal(b, sent[i]) {
				t.Fatalf("app %d got %d bytes that differ from the %d sent", i, len(b), len(sent[i]))
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("app %d never saw the end of its stream", i)
		}
	}
}
