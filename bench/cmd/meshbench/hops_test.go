package main

import "testing"

// TestRoundTripsSkipsStraySegments: a round trip is its eight sightings in
// order; a segment that belongs to none (a WINDOW_UPDATE on the tunnel) is
// skipped, and a round trip the taps lost part of is dropped, not merged
// into the next.
func TestRoundTripsSkipsStraySegments(t *testing.T) {
	ev := func(ns int64, leg, dir string) tapEvent { return tapEvent{ns: ns, leg: leg, dir: dir, payload: 1} }
	client := []tapEvent{
		// round trip 1, with a stray tunnel segment from the client after its reply
		ev(100, "app", "req"), ev(110, "tun", "req"), ev(170, "tun", "rep"), ev(185, "app", "rep"),
		ev(186, "tun", "req"),
		// round trip 2 loses its server side: dropped when round trip 3 starts
		ev(300, "app", "req"), ev(305, "tun", "req"),
		// round trip 3
		ev(500, "app", "req"), ev(512, "tun", "req"), ev(580, "tun", "rep"), ev(590, "app", "rep"),
	}
	server := []tapEvent{
		ev(120, "tun", "req"), ev(130, "app", "req"), ev(140, "app", "rep"), ev(160, "tun", "rep"),
		ev(190, "tun", "req"), // the stray one arriving
		ev(520, "tun", "req"), ev(531, "app", "req"), ev(545, "app", "rep"), ev(566, "tun", "rep"),
	}
	rts := roundTrips(client, server)
	want := [][8]int64{
		{100, 110, 120, 130, 140, 160, 170, 185},
		{500, 512, 520, 531, 545, 566, 580, 590},
	}
	if len(rts) != len(want) {
		t.Fatalf("got %d round trips %v, want %v", len(rts), rts, want)
	}
	for i := range want {
		if rts[i] != want[i] {
			t.Errorf("round trip %d: %v, want %v", i, rts[i], want[i])
		}
	}
	m := hopMedians(rts)
	// client out: 10 and 12 ns; the median of two is their mean.
	if got := m["hop_client_out"]; got != 0.011 {
		t.Errorf("client out median %v µs, want 0.011", got)
	}
	if got := m["hop_total"]; got != (0.085+0.090)/2 {
		t.Errorf("total median %v µs, want 0.0875", got)
	}
}
