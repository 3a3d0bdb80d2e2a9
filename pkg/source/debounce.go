package source

import "time"

// Debounce says when a watch loop turns the changes it was told about into
// a snapshot. A snapshot is due once no change came for Quiet, or MaxWait
// after the first change it would carry, whichever is sooner; and never
// sooner than MinGap after the previous one. So a lone change is delivered
// after Quiet, a burst becomes one snapshot, changes that never pause are
// still delivered every MaxWait, and snapshots come at most one per MinGap.
// A zero MaxWait or MinGap is no limit.
type Debounce struct {
	Quiet, MaxWait, MinGap time.Duration
}

// due is when a snapshot is due for changes first seen at first and last
// seen at last, the previous snapshot having been taken at prev (zero: none).
func (c Debounce) due(first, last, prev time.Time) time.Time {
	at := last.Add(c.Quiet)
	if c.MaxWait > 0 {
		if limit := first.Add(c.MaxWait); limit.Before(at) {
			at = limit
		}
	}
	if c.MinGap > 0 && !prev.IsZero() {
		if gap := prev.Add(c.MinGap); gap.After(at) {
			at = gap
		}
	}
	return at
}

// Debouncer applies a Debounce in one watch loop: call Changed for every
// change, and Due when C fires; take a snapshot when Due says so. It is not
// safe for concurrent use.
type Debouncer struct {
	cfg   Debounce
	timer *time.Timer

	pending           bool
	first, last, prev time.Time
}

// NewDebouncer returns a Debouncer with nothing pending.
func NewDebouncer(c Debounce) *Debouncer {
	t := time.NewTimer(time.Hour)
	t.Stop()
	return &Debouncer{cfg: c, timer: t}
}

// Changed records a change.
func (d *Debouncer) Changed() {
	now := time.Now()
	if !d.pending {
		d.pending, d.first = true, now
	}
	d.last = now
	d.timer.Reset(max(d.cfg.due(d.first, d.last, d.prev).Sub(now), 0))
}

// C fires when a snapshot may be due.
func (d *Debouncer) C() <-chan time.Time { return d.timer.C }

// Due reports, after C fired, whether a snapshot is due now. If it is, the
// pending changes count as delivered; if not, C fires again later.
func (d *Debouncer) Due() bool {
	if !d.pending {
		return false
	}
	now := time.Now()
	if at := d.cfg.due(d.first, d.last, d.prev); now.Before(at) {
		d.timer.Reset(at.Sub(now))
		return false
	}
	d.pending, d.prev = false, now
	return true
}

// Stop releases the timer.
func (d *Debouncer) Stop() { d.timer.Stop() }
