package hbone

import (
	"context"
	"errors"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/internal/waitfor"
	"golang.org/x/net/http2"
)

// serverConnOf waits for srv's one connection.
func serverConnOf(t *testing.T, srv *Server) *conn {
	t.Helper()
	var c *conn
	waitfor.Until(t, "the server's connection", func() bool {
		srv.mu.Lock()
		defer srv.mu.Unlock()
		for sc := range srv.conns {
			c = sc
		}
		return c != nil
	})
	return c
}

// endlessUpstream is an application that writes to every connection as
// fast as it is read, until the peer closes.
func endlessUpstream(t *testing.T) netip.AddrPort {
	return startUpstream(t, func(c *net.TCPConn) {
		buf := make([]byte, 64<<10)
		for {
			if _, err := c.Write(buf); err != nil {
				return
			}
		}
	})
}

// TestSendWindowChurnLosesNoWriter: server writers of many streams wait for
// send window while the client churns it: SETTINGS_INITIAL_WINDOW_SIZE up
// and down (stream windows negative and back, with acks pending), grants of
// a few bytes to the connection and to streams, resets of some streams. Once
// the client then gives every stream and the connection plenty of window,
// every stream still open must send: a writer that missed its wake-up (left
// the connection's queue, or was never woken for a window that opened)
// would sleep for good.
func TestSendWindowChurnLosesNoWriter(t *testing.T) {
	const streams = 40
	target := endlessUpstream(t)
	for seed := range uint64(4) {
		t.Run("seed "+string(rune('0'+seed)), func(t *testing.T) {
			rng := rand.New(rand.NewPCG(seed, 7))
			srv, rc := rawServer(t, ServerOptions{TLSConfig: mustServerTLS(), Handler: dialTarget})
			live := map[uint32]bool{}
			for i := range streams {
				id := uint32(2*i + 1)
				if err := rc.connect(id, target.String()); err != nil {
					t.Fatal(err)
				}
				live[id] = true
			}
			c := serverConnOf(t, srv)
			waitfor.Until(t, "every stream's writer waiting for window", func() bool {
				c.mu.Lock()
				defer c.mu.Unlock()
				return c.sendWaiting == streams
			})
			// The connection's grants are bounded, so that what is left of
			// them at the end is less than each stream must send after.
			const connGrants = 20000
			granted := 0
			for range 300 {
				var err error
				switch op := rng.IntN(10); {
				case op < 3:
					err = rc.fr.WriteSettings(http2.Setting{ID: http2.SettingInitialWindowSize, Val: uint32(rng.IntN(70000))})
				case op < 5 && granted < connGrants:
					inc := 1 + rng.IntN(2000)
					granted += inc
					err = rc.fr.WriteWindowUpdate(0, uint32(inc))
				case op < 8:
					id := uint32(2*rng.IntN(streams) + 1)
					if live[id] {
						err = rc.fr.WriteWindowUpdate(id, uint32(1+rng.IntN(3000)))
					}
				case op < 9 && len(live) > streams/2:
					id := uint32(2*rng.IntN(streams) + 1)
					if live[id] {
						delete(live, id)
						err = rc.fr.WriteRSTStream(id, http2.ErrCodeCancel)
					}
				default:
					time.Sleep(time.Duration(rng.IntN(200)) * time.Microsecond)
				}
				if err != nil {
					t.Fatal(err)
				}
			}
			// Plenty for everyone: every stream window ends up far above
			// zero, and the connection's holds a frame for each stream.
			if err := rc.fr.WriteSettings(http2.Setting{ID: http2.SettingInitialWindowSize, Val: 1 << 20}); err != nil {
				t.Fatal(err)
			}
			if err := rc.fr.WriteWindowUpdate(0, streams*16384); err != nil {
				t.Fatal(err)
			}
			// Before the grants above, a stream can have sent at most the
			// connection's initial window and the churn's grants.
			const enough = defaultWindow + connGrants + 1
			got := map[uint32]int{}
			deadline := time.After(10 * time.Second)
			for done := 0; done < len(live); {
				select {
				case f, ok := <-rc.frames:
					if !ok {
						t.Fatal("connection ended")
					}
					if f.typ == http2.FrameGoAway {
						t.Fatalf("GOAWAY %v", f.code)
					}
					if f.typ != http2.FrameData || !live[f.stream] {
						continue
					}
					// A reader: what arrived is granted again.
					if f.length == 0 {
						continue
					}
					if err := rc.fr.WriteWindowUpdate(0, f.length); err != nil {
						t.Fatal(err)
					}
					before := got[f.stream]
					got[f.stream] += int(f.length)
					if before < enough && got[f.stream] >= enough {
						done++
					}
				case <-deadline:
					c.mu.Lock()
					st := struct{ win, waiting, queued, acks int }{int(c.sendWindow), c.sendWaiting, len(c.connWaiters), c.acksPending}
					var stuck []uint32
					for id := range live {
						if got[id] < enough {
							stuck = append(stuck, id)
						}
					}
					c.mu.Unlock()
					t.Fatalf("streams %v sent less than %d bytes with window for all: conn window %d, writers waiting %d, queued %d, acks pending %d", stuck, enough, st.win, st.waiting, st.queued, st.acks)
				}
			}
		})
	}
}

// TestPoppedWriterWithoutStreamWindowPassesOn: the writer at the head of
// the connection's queue finds, when a connection grant wakes it, that its
// own stream's window went (SETTINGS_INITIAL_WINDOW_SIZE lowered it while
// it waited). It must hand the grant to the next writer in line: the peer
// sends nothing more, so a writer not woken now sleeps for good.
func TestPoppedWriterWithoutStreamWindowPassesOn(t *testing.T) {
	target := endlessUpstream(t)
	srv, rc := rawServer(t, ServerOptions{TLSConfig: mustServerTLS(), Handler: dialTarget})
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(rc.fr.WriteSettings(http2.Setting{ID: http2.SettingInitialWindowSize, Val: 1000}))
	must(rc.connect(1, target.String()))
	must(rc.connect(3, target.String()))
	c := serverConnOf(t, srv)
	state := func() (waiting, queued int, win int64) {
		c.mu.Lock()
		defer c.mu.Unlock()
		return c.sendWaiting, len(c.connWaiters), c.sendWindow
	}
	waitfor.Until(t, "both streams' windows spent", func() bool {
		w, _, win := state()
		return w == 2 && win == defaultWindow-2000
	})
	// Stream 1 spends the connection's window, then queues for more.
	must(rc.fr.WriteWindowUpdate(1, defaultWindow-2000))
	waitfor.Until(t, "the connection's window spent", func() bool {
		w, _, win := state()
		return w == 2 && win == 0
	})
	must(rc.fr.WriteWindowUpdate(1, 10))
	waitfor.Until(t, "stream 1 queued", func() bool { _, q, _ := state(); return q == 1 })
	must(rc.fr.WriteWindowUpdate(3, 2000))
	waitfor.Until(t, "stream 3 queued behind it", func() bool { _, q, _ := state(); return q == 2 })
	// Stream 1's window goes to 0, stream 3's stays 1990.
	must(rc.fr.WriteSettings(http2.Setting{ID: http2.SettingInitialWindowSize, Val: 990}))
	mark := [8]byte{'a', 'c', 'k'}
	must(rc.fr.WritePing(false, mark))
	rc.waitFor("PING ack", func(f rawFrame) bool { return f.typ == http2.FramePing && f.ack && f.ping == mark })
	must(rc.fr.WriteWindowUpdate(0, 500))
	got := 0
	for got < 500 {
		f := rc.waitFor("stream 3's DATA", func(f rawFrame) bool { return f.typ == http2.FrameData })
		if f.stream != 3 {
			t.Fatalf("DATA on stream %d, which has no window", f.stream)
		}
		got += int(f.length)
	}
	// Stream 1 sends again once its window reopens (the connection's
	// grant covers what stream 3 may still send too).
	must(rc.fr.WriteWindowUpdate(1, 100))
	must(rc.fr.WriteWindowUpdate(0, 2000))
	rc.waitFor("stream 1's DATA", func(f rawFrame) bool { return f.typ == http2.FrameData && f.stream == 1 })
}

// TestClientWritersLeaveWindowQueue: client writers queued for the
// connection's send window leave the queue when their write deadline
// passes or their stream is closed, with an error, and the writer queued
// behind them sends once the server grants window. A writer that left
// without handing on, or stayed in the queue, would make the last one
// sleep for good.
func TestClientWritersLeaveWindowQueue(t *testing.T) {
	grants := make(chan uint32)
	dial := dialHostile(t, func(hs *hostileServer) {
		// Stream windows larger than the connection's: writers run out
		// of the connection's first.
		if hs.fr.WriteSettings(http2.Setting{ID: http2.SettingInitialWindowSize, Val: 1 << 20}) != nil {
			return
		}
		answered := 0
		for f := range hs.frames {
			if f.Header().Type == http2.FrameHeaders {
				if hs.headers(f.Header().StreamID, false, hpackField{Name: ":status", Value: "200"}) != nil {
					return
				}
				if answered++; answered == 3 {
					break
				}
			}
		}
		go func() {
			for range hs.frames { // the pool's DATA
			}
		}()
		for inc := range grants {
			if hs.fr.WriteWindowUpdate(0, inc) != nil {
				return
			}
		}
	})
	pool := NewPool(PoolOptions{})
	t.Cleanup(func() { _ = pool.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var ss []*Stream
	for range 3 {
		s, err := connectHostile(ctx, pool, dial)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { s.Close() })
		ss = append(ss, s)
	}
	c := ss[0].c
	for _, s := range ss[1:] {
		if s.c != c {
			t.Fatal("streams on different connections")
		}
	}
	queued := func(n int) func() bool {
		return func() bool {
			c.mu.Lock()
			defer c.mu.Unlock()
			return len(c.connWaiters) == n
		}
	}
	// The first stream spends the connection's window and queues for more;
	// then the others queue behind it.
	type result struct {
		n   int
		err error
	}
	results := make([]chan result, len(ss))
	for i, s := range ss {
		results[i] = make(chan result, 1)
		if i == 0 {
			_ = s.SetWriteDeadline(time.Now().Add(time.Second))
		}
		go func() {
			n, err := s.Write(make([]byte, 2*defaultWindow))
			results[i] <- result{n, err}
		}()
		waitfor.Until(t, "the writer queued", queued(i+1))
	}
	// The first gives up at its deadline, the second is closed: both
	// leave the queue with an error.
	ss[1].Close()
	for i, want := range []error{os.ErrDeadlineExceeded, net.ErrClosed} {
		select {
		case r := <-results[i]:
			if !errors.Is(r.err, want) {
				t.Errorf("writer %d: %d bytes, %v; want %v", i, r.n, r.err, want)
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("writer %d still waits for window, want %v", i, want)
		}
	}
	waitfor.Until(t, "the queue holding the last writer only", queued(1))
	grants <- 2 * defaultWindow
	close(grants)
	select {
	case r := <-results[2]:
		if r.err != nil {
			t.Errorf("the last writer: %v", r.err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the last writer sleeps with the connection's window granted")
	}
}
