package hbone

import (
	"bytes"
	"net"
	"testing"
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
