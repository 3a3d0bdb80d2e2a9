package source

import (
	"testing"
	"time"
)

func TestDebounceDue(t *testing.T) {
	ms := func(n int) time.Duration { return time.Duration(n) * time.Millisecond }
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	at := func(n int) time.Time { return t0.Add(ms(n)) }
	c := Debounce{Quiet: ms(10), MaxWait: ms(50), MinGap: ms(50)}
	for _, tc := range []struct {
		name              string
		c                 Debounce
		first, last, prev time.Time
		want              time.Time
	}{
		{"lone change waits the quiet period", c, at(100), at(100), time.Time{}, at(110)},
		{"a later change pushes it back", c, at(100), at(120), time.Time{}, at(130)},
		{"changes that never pause wait at most MaxWait", c, at(100), at(145), time.Time{}, at(150)},
		{"no sooner than MinGap after the previous snapshot", c, at(100), at(100), at(80), at(130)},
		{"a snapshot long ago does not delay", c, at(100), at(100), at(10), at(110)},
		{"MinGap beats MaxWait", c, at(100), at(145), at(120), at(170)},
		{"zero MaxWait: quiet only", Debounce{Quiet: ms(10)}, at(100), at(500), at(490), at(510)},
	} {
		if got := tc.c.due(tc.first, tc.last, tc.prev); !got.Equal(tc.want) {
			t.Errorf("%s: due at %v, want %v", tc.name, got.Sub(t0), tc.want.Sub(t0))
		}
	}
}

// drain returns how many snapshots the debouncer lets through within the given time.
func drain(d *Debouncer, within time.Duration) (n int) {
	deadline := time.After(within)
	for {
		select {
		case <-d.C():
			if d.Due() {
				n++
			}
		case <-deadline:
			return n
		}
	}
}

func TestDebouncerLoneChange(t *testing.T) {
	d := NewDebouncer(Debounce{Quiet: 5 * time.Millisecond, MaxWait: time.Second, MinGap: time.Second})
	defer d.Stop()
	start := time.Now()
	d.Changed()
	<-d.C()
	for !d.Due() {
		<-d.C()
	}
	if took := time.Since(start); took < 5*time.Millisecond || took > 500*time.Millisecond {
		t.Errorf("lone change delivered after %s, want about 5ms", took)
	}
	if n := drain(d, 30*time.Millisecond); n != 0 {
		t.Errorf("%d snapshots without a change", n)
	}
}

func TestDebouncerCoalescesBurst(t *testing.T) {
	d := NewDebouncer(Debounce{Quiet: 20 * time.Millisecond, MaxWait: time.Second})
	defer d.Stop()
	for range 50 {
		d.Changed()
	}
	if n := drain(d, 200*time.Millisecond); n != 1 {
		t.Errorf("a burst of 50 changes gave %d snapshots, want 1", n)
	}
}

func TestDebouncerMaxWaitAndMinGap(t *testing.T) {
	d := NewDebouncer(Debounce{Quiet: 30 * time.Millisecond, MaxWait: 60 * time.Millisecond, MinGap: 60 * time.Millisecond})
	defer d.Stop()
	// A change every 5 ms for 400 ms never leaves 30 ms of quiet: without
	// MaxWait nothing would be delivered; MinGap keeps it to one per 60 ms.
	var got []time.Time
	tick := time.NewTicker(5 * time.Millisecond)
	defer tick.Stop()
	end := time.After(400 * time.Millisecond)
	d.Changed()
loop:
	for {
		select {
		case <-tick.C:
			d.Changed()
		case <-d.C():
			if d.Due() {
				got = append(got, time.Now())
			}
		case <-end:
			break loop
		}
	}
	if len(got) < 2 || len(got) > 7 {
		t.Fatalf("%d snapshots in 400 ms of constant change, want about one per 60 ms", len(got))
	}
	for i := 1; i < len(got); i++ {
		if gap := got[i].Sub(got[i-1]); gap < 60*time.Millisecond {
			t.Errorf("snapshots %s apart, want at least 60ms", gap)
		}
	}
}
