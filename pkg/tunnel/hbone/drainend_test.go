package hbone

import (
	"io"
	"net"
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/internal/waitfor"
	"golang.org/x/net/http2"
)

// TestDrainWaitsForCommittedEnd: a stream the peer ended stops counting
// toward its concurrent streams once our END_STREAM is committed
// (Stream.commitEnd), before the write went out. A draining connection whose
// other streams finish meanwhile must still wait for that write: closing it
// then lost the stream's END_STREAM, and the peer saw its tunnel cut instead
// of ended.
func TestDrainWaitsForCommittedEnd(t *testing.T) {
	app := startUpstream(t, func(c *net.TCPConn) { _, _ = io.Copy(io.Discard, c) }) // closes at EOF
	srv, rc := rawServer(t, ServerOptions{TLSConfig: mustServerTLS(), Handler: dialTarget})
	for _, id := range []uint32{1, 3} {
		if err := rc.connect(id, app.String()); err != nil {
			t.Fatal(err)
		}
		rc.waitFor("200", func(f rawFrame) bool { return f.typ == http2.FrameHeaders && f.stream == id && f.status == 200 })
	}
	srv.mu.Lock()
	var c *conn
	for cc := range srv.conns {
		c = cc
	}
	srv.mu.Unlock()

	// The writer is busy (as behind a slow reader): stream 1's END_STREAM
	// waits for it, committed and uncounted.
	c.lockWrite()
	locked := true
	defer func() {
		if locked {
			c.unlockWrite()
		}
	}()
	if err := rc.fr.WriteData(1, true, nil); err != nil {
		t.Fatal(err)
	}
	waitfor.Until(t, "stream 1 uncounted, its END_STREAM committed", func() bool {
		c.mu.Lock()
		defer c.mu.Unlock()
		s := c.streams[1]
		return s != nil && s.uncounted
	})
	c.drain()
	if err := rc.fr.WriteRSTStream(3, http2.ErrCodeCancel); err != nil {
		t.Fatal(err)
	}
	waitfor.Until(t, "stream 3 forgotten", func() bool {
		c.mu.Lock()
		defer c.mu.Unlock()
		return c.streams[3] == nil
	})
	// An absence: give a close that forget began the time to show.
	time.Sleep(200 * time.Millisecond)
	c.mu.Lock()
	closed := c.err
	c.mu.Unlock()
	if closed != nil {
		t.Errorf("draining connection closed while stream 1 still wrote its END_STREAM: %v", closed)
	}
	c.unlockWrite()
	locked = false
	rc.waitFor("END_STREAM on stream 1", func(f rawFrame) bool {
		return f.stream == 1 && f.end && (f.typ == http2.FrameData || f.typ == http2.FrameHeaders)
	})
	rc.waitFor("GOAWAY once drained", func(f rawFrame) bool { return f.typ == http2.FrameGoAway })
}
