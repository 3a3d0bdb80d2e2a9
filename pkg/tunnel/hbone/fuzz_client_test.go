package hbone

import (
	"bytes"
	"context"
	"io"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// FuzzClientResponse answers a Pool's CONNECT with arbitrary bytes, read as
// HTTP/2 frames after the server's SETTINGS, as a compromised node or
// waypoint could. The client must never panic, Connect must return by its
// deadline, and a stream it returns must end once the pool closes.
func FuzzClientResponse(f *testing.F) {
	var b bytes.Buffer
	fr := http2.NewFramer(&b, nil)
	var hb bytes.Buffer
	enc := hpack.NewEncoder(&hb)
	block := func(fields ...hpackField) []byte {
		hb.Reset()
		for _, hf := range fields {
			_ = enc.WriteField(hf)
		}
		return append([]byte(nil), hb.Bytes()...)
	}
	seed := func(write func()) {
		b.Reset()
		write()
		f.Add(append([]byte(nil), b.Bytes()...))
	}
	seed(func() {
		_ = fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: block(hpackField{Name: ":status", Value: "200"}), EndHeaders: true})
		_ = fr.WriteData(1, true, []byte("hello"))
	})
	seed(func() {
		_ = fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: block(hpackField{Name: ":status", Value: "100"}), EndHeaders: true})
		_ = fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: block(hpackField{Name: ":status", Value: "503"}, hpackField{Name: ReasonHeader, Value: "no"}), EndHeaders: true, EndStream: true})
	})
	seed(func() {
		bl := block(hpackField{Name: ":status", Value: "200"}, hpackField{Name: "x", Value: "y"})
		_ = fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: bl[:1]})
		_ = fr.WriteContinuation(1, true, bl[1:])
		_ = fr.WriteWindowUpdate(0, 1<<20)
		_ = fr.WriteWindowUpdate(1, 1<<20)
		_ = fr.WriteSettings(http2.Setting{ID: http2.SettingInitialWindowSize, Val: 0}, http2.Setting{ID: http2.SettingHeaderTableSize, Val: 0})
		_ = fr.WritePing(false, [8]byte{1})
		_ = fr.WriteRSTStream(1, http2.ErrCodeCancel)
	})
	seed(func() {
		_ = fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: block(hpackField{Name: ":status", Value: "200"}), EndHeaders: true, EndStream: true})
		_ = fr.WriteData(1, false, []byte("x"))
		_ = fr.WriteGoAway(1, http2.ErrCodeNo, []byte("bye"))
	})
	seed(func() {
		_ = fr.WritePushPromise(http2.PushPromiseParam{StreamID: 1, PromiseID: 2, BlockFragment: block(hpackField{Name: ":method", Value: "GET"}), EndHeaders: true})
	})
	f.Fuzz(func(t *testing.T, data []byte) {
		dial := dialHostile(t, func(hs *hostileServer) {
			if hs.awaitRequest(1) != nil {
				return
			}
			_, _ = hs.tc.Write(data)
			for range hs.frames {
			}
		})
		pool := NewPool(PoolOptions{})
		ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
		defer cancel()
		start := time.Now()
		s, err := connectHostile(ctx, pool, dial)
		if took := time.Since(start); took > 2*time.Second {
			t.Fatalf("Connect took %v (err %v)", took, err)
		}
		if err == nil {
			_ = s.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
			_, _ = io.Copy(io.Discard, s)
			_, _ = s.Write([]byte("x"))
		}
		_ = pool.Close()
		if s != nil {
			done := make(chan struct{})
			go func() {
				_ = s.SetReadDeadline(time.Time{})
				_, _ = io.Copy(io.Discard, s)
				close(done)
			}()
			select {
			case <-done:
			case <-time.After(2 * time.Second):
				t.Fatal("stream still readable after the pool closed")
			}
			s.Close()
		}
	})
}
