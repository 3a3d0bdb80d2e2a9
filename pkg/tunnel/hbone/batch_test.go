package hbone

import (
	"bytes"
	"errors"
	"net"
	"sync"
	"testing"
	"time"
)

// writeRecorder is a net.Conn that records each Write it is given.
type writeRecorder struct {
	net.Conn
	writes [][]byte
}

func (w *writeRecorder) Write(p []byte) (int, error) {
	w.writes = append(w.writes, bytes.Clone(p))
	return len(p), nil
}

func TestBatchConn(t *testing.T) {
	rec := &writeRecorder{}
	b := &batchConn{Conn: rec}
	record := func(c byte, n int) []byte { return bytes.Repeat([]byte{c}, n) }

	// Outside a batch every write goes through as it is.
	_, _ = b.Write(record('a', 10))
	_, _ = b.Write(record('b', 10))
	if len(rec.writes) != 2 {
		t.Fatalf("outside a batch: %d writes, want 2", len(rec.writes))
	}

	// A batch's records leave in one write, in order, when it ends.
	rec.writes = nil
	b.begin()
	var want []byte
	for _, c := range []byte("wxyz") {
		r := record(c, 16384+22)
		want = append(want, r...)
		_, _ = b.Write(r)
	}
	if len(rec.writes) != 0 {
		t.Fatalf("%d writes before the batch ended", len(rec.writes))
	}
	if err := b.end(); err != nil {
		t.Fatal(err)
	}
	if len(rec.writes) != 1 || !bytes.Equal(rec.writes[0], want) {
		t.Fatalf("batch: %d writes, want one holding the four records in order", len(rec.writes))
	}

	// More than the buffer holds: what was gathered goes first, order kept.
	rec.writes = nil
	b.begin()
	small, big := record('s', 100), record('B', batchSize+1)
	_, _ = b.Write(small)
	_, _ = b.Write(big)
	_, _ = b.Write(small)
	_ = b.end()
	got := bytes.Join(rec.writes, nil)
	if !bytes.Equal(got, append(append(append([]byte{}, small...), big...), small...)) || len(rec.writes) != 3 {
		t.Fatalf("overflow: %d writes, order kept %v", len(rec.writes), bytes.Equal(got, append(append(append([]byte{}, small...), big...), small...)))
	}

	// An empty batch writes nothing; after it, writes go through again.
	rec.writes = nil
	b.begin()
	_ = b.end()
	_, _ = b.Write(small)
	if len(rec.writes) != 1 {
		t.Fatalf("after an empty batch: %d writes, want 1", len(rec.writes))
	}
}

// stuckConn's writes block until it is closed, as a socket's do when the peer stops reading.
type stuckConn struct {
	net.Conn
	closed chan struct{}
	once   sync.Once
}

func (s *stuckConn) Write(p []byte) (int, error) { <-s.closed; return 0, net.ErrClosed }
func (s *stuckConn) Close() error                { s.once.Do(func() { close(s.closed) }); return nil }

// TestBatchAbort: a batch's write blocked on a peer that stopped reading ends at once when the
// connection is aborted, and no batch is written after (crypto/tls's Close cannot see the
// blocked write, so without abort it would wait for its close_notify deadline).
func TestBatchAbort(t *testing.T) {
	raw := &stuckConn{closed: make(chan struct{})}
	b := &batchConn{Conn: raw}
	b.begin()
	_, _ = b.Write(bytes.Repeat([]byte{'x'}, 100))
	ended := make(chan error, 1)
	go func() { ended <- b.end() }()
	for !b.flushing.Load() {
		time.Sleep(time.Millisecond)
	}
	b.abort()
	select {
	case err := <-ended:
		if err == nil {
			t.Error("a write ended by abort reported no error")
		}
	case <-time.After(5 * time.Second):
		t.Fatal("abort did not end a blocked batch write")
	}
	b.begin()
	_, _ = b.Write([]byte("y"))
	if err := b.end(); !errors.Is(err, net.ErrClosed) {
		t.Errorf("a batch after abort: %v, want net.ErrClosed", err)
	}
	if got := Buffers().BatchesInUse; got != 0 {
		t.Errorf("%d batch buffers still out", got)
	}
}
