package hbone

import (
	"net"
	"syscall"
	"testing"
	"time"

	"golang.org/x/net/http2"
)

// processCPU is the CPU time the test process has used.
func processCPU() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// TestSettingsInitialWindowRepeatsCostOneWalk: a SETTINGS frame may hold
// SETTINGS_INITIAL_WINDOW_SIZE up to maxSettingsPerFrame (32) times, and
// each change adjusts every open stream's send window. The junk budget
// charges one frame, so a frame repeating the setting must cost about one
// walk of the streams, not one per entry. Before the fix, with 200 streams
// open, a frame of 32 changes cost the server some 15 times a frame of one
// (about 150 µs against 10 µs here), so a client's 1000-frame burst per
// connection bought 0.15 s of CPU per connection.
func TestSettingsInitialWindowRepeatsCostOneWalk(t *testing.T) {
	const streams, window = 200, 1000
	app := startUpstream(t, func(c *net.TCPConn) {
		_, _ = c.Write(make([]byte, 64<<10)) // more than the window: each writer waits for window
		buf := make([]byte, 1024)
		for {
			if _, err := c.Read(buf); err != nil {
				return
			}
		}
	})
	srv, rc := rawServer(t, ServerOptions{TLSConfig: mustServerTLS(), Handler: dialTarget})
	if err := rc.fr.WriteSettings(http2.Setting{ID: http2.SettingInitialWindowSize, Val: window}); err != nil {
		t.Fatal(err)
	}
	if err := rc.fr.WriteWindowUpdate(0, 1<<30); err != nil {
		t.Fatal(err)
	}
	for i := range streams {
		if err := rc.connect(uint32(1+2*i), app.String()); err != nil {
			t.Fatal(err)
		}
	}
	// Every stream spends its window: from now on a change of the initial
	// window between 0 and window keeps every stream's send window at 0 or
	// below, so it walks the streams and wakes no writer.
	got := 0
	rc.waitFor("every stream's window of DATA", func(f rawFrame) bool {
		if f.typ == http2.FrameData {
			got += int(f.length)
		}
		return got == streams*window
	})

	// cost sends frames SETTINGS frames, each changing the initial window
	// entries times (the last change alternating between 0 and window),
	// and returns the CPU time per frame, measured until a PING comes back.
	cost := func(frames, entries int) time.Duration {
		t.Helper()
		start := processCPU()
		for i := range frames {
			settings := make([]http2.Setting, entries)
			for j := range settings {
				v := uint32(0)
				if (i+entries-1-j)%2 == 0 {
					v = window
				}
				settings[j] = http2.Setting{ID: http2.SettingInitialWindowSize, Val: v}
			}
			if err := rc.fr.WriteSettings(settings...); err != nil {
				t.Fatal(err)
			}
		}
		end := [8]byte{'e', 'n', 'd', byte(entries)}
		_ = rc.fr.WritePing(false, end)
		rc.waitFor("PING ack", func(f rawFrame) bool { return f.typ == http2.FramePing && f.ack && f.ping == end })
		return (processCPU() - start) / time.Duration(frames)
	}
	const frames = 400 // twice, within the junk budget (1000)
	one := cost(frames, 1)
	many := cost(frames, maxSettingsPerFrame)
	t.Logf("CPU per SETTINGS frame with %d streams open: %v changing the initial window once, %v changing it %d times", streams, one, many, maxSettingsPerFrame)
	if st := srv.Stats(); st.ConnsFlood != 0 {
		t.Fatalf("the connection was closed as a flood (%+v)", st)
	}
	if many > 4*one {
		t.Errorf("a SETTINGS frame changing the initial window %d times cost %v, over 4 times one changing it once (%v)", maxSettingsPerFrame, many, one)
	}
}
