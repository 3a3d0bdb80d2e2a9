package hbone

import (
	"testing"
	"time"

	"github.com/redirector-mesh/redirector/internal/waitfor"
	"golang.org/x/net/http2"
)

// TestControlQueueNotKeptAfterBurst: a client that stops reading (a
// download it opened fills the socket buffers), sends
// PINGs within the junk budget (about a thousand), and then reads again
// gets all its answers, but the connection must not keep the queue those
// answers took while they waited. Before, the control writer kept the
// largest batch it had written as its spare for the life of the
// connection: about 32 KiB per connection after one burst (some 100 KiB
// after a burst stretched over the budget's refill), twice the memory of
// an idle connection for the 1024 connections one address may hold.
func TestControlQueueNotKeptAfterBurst(t *testing.T) {
	checkGoroutines(t)
	srv, addr, app := downloadServer(t, time.Minute)
	tc, fr := h2Client(t, addr)
	// A download fills the socket buffers, so that the answers queue.
	if err := connecter(fr)(1, app); err != nil {
		t.Fatal(err)
	}
	waitfor.Until(t, "the download established", func() bool { return srv.Stats().StreamsOK == 1 })
	time.Sleep(200 * time.Millisecond)
	const pings = 900
	for i := range pings {
		if err := fr.WritePing(false, [8]byte{byte(i >> 8), byte(i)}); err != nil {
			t.Fatal(err)
		}
	}
	c := serverConnOf(t, srv)
	// Let the answers queue behind the full socket, then read them all.
	time.Sleep(200 * time.Millisecond)
	_ = tc.SetReadDeadline(time.Now().Add(10 * time.Second))
	var last [8]byte
	last[0], last[1] = byte((pings-1)>>8), byte((pings-1)&0xff)
	for {
		f, err := fr.ReadFrame()
		if err != nil {
			t.Fatal(err)
		}
		if p, ok := f.(*http2.PingFrame); ok && p.IsAck() && p.Data == last {
			break
		}
	}
	if err := fr.WriteRSTStream(1, http2.ErrCodeCancel); err != nil {
		t.Fatal(err)
	}
	// One more round trip, so the writer has put its last batch away.
	end := [8]byte{'e', 'n', 'd'}
	if err := fr.WritePing(false, end); err != nil {
		t.Fatal(err)
	}
	for {
		f, err := fr.ReadFrame()
		if err != nil {
			t.Fatal(err)
		}
		if p, ok := f.(*http2.PingFrame); ok && p.IsAck() && p.Data == end {
			break
		}
	}
	waitfor.Until(t, "the control writer idle", func() bool {
		c.mu.Lock()
		defer c.mu.Unlock()
		return len(c.ctl) == 0 && c.ctlSpare != nil
	})
	c.mu.Lock()
	kept := cap(c.ctl) + cap(c.ctlSpare)
	c.mu.Unlock()
	t.Logf("control frames the connection keeps room for after the burst: %d", kept)
	if kept > 2*maxKeptControl {
		t.Errorf("the connection keeps room for %d control frames after a burst of %d, want at most %d", kept, pings, 2*maxKeptControl)
	}
}
