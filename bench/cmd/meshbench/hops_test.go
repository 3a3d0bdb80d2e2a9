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
}

// TestHopMeansAddUp: the legs' means add up to the total's, and the slowest
// 1 % of round trips by total is left out.
func TestHopMeansAddUp(t *testing.T) {
	var rts [][8]int64
	for i := range 200 {
		rt := [8]int64{0, 10, 15, 25, 40, 50, 55, 65}
		if i%2 == 1 { // a bimodal leg: the app's turn 15 or 35 ns
			for j := 4; j < 8; j++ {
				rt[j] += 20
			}
		}
		if i < 2 { // two stalls, 1 % of 200: left out
			rt[7] += 1e6
		}
		rts = append(rts, rt)
	}
	m := hopMeans(rts)
	var sum float64
	for _, l := range hopLegs[:len(hopLegs)-1] {
		sum += m[l.key]
	}
	if d := sum - m["hop_total"]; d > 1e-9 || d < -1e-9 {
		t.Errorf("legs add up to %v µs, total %v", sum, m["hop_total"])
	}
	// 198 kept: 99 at 65 ns and 99 at 85 ns (the stalls were one of each)
	if got, want := m["hop_total"], 0.075; got < want-1e-9 || got > want+1e-9 {
		t.Errorf("total %v µs, want %v", got, want)
	}
	if got, want := m["hop_app"], 0.025; got < want-1e-9 || got > want+1e-9 {
		t.Errorf("echo server %v µs, want %v", got, want)
	}
}

// TestBurstsCutAtGaps: sightings between quiet gaps make one burst, timed
// from its first request to the last sighting of each kind; the tunnel's
// small control records do not count, and a burst missing a kind is dropped.
func TestBurstsCutAtGaps(t *testing.T) {
	ev := func(ns int64, leg, dir string, n int) tapEvent {
		return tapEvent{ns: ns, leg: leg, dir: dir, payload: n}
	}
	const ms = 1_000_000
	client := []tapEvent{
		// burst 1: two requests
		ev(0, "app", "req", 1100), ev(10, "app", "req", 1100), ev(20, "tun", "req", 2300),
		ev(200, "tun", "rep", 2300), ev(210, "app", "rep", 1100), ev(230, "app", "rep", 1100),
		ev(400, "tun", "req", 35), // a window update after the burst: not a stage
		// burst 2, 16 ms later: the server side never answers (dropped)
		ev(16*ms, "app", "req", 1100), ev(16*ms+10, "tun", "req", 1150),
		// burst 3
		ev(32*ms, "app", "req", 1100), ev(32*ms+12, "tun", "req", 1150),
		ev(32*ms+150, "tun", "rep", 1150), ev(32*ms+160, "app", "rep", 1100),
	}
	server := []tapEvent{
		ev(30, "tun", "req", 2300), ev(40, "app", "req", 1100), ev(60, "app", "req", 1100),
		ev(100, "app", "rep", 1100), ev(120, "app", "rep", 1100), ev(150, "tun", "rep", 2300),
		ev(410, "tun", "req", 35),
		ev(16*ms+20, "tun", "req", 1150),
		ev(32*ms+20, "tun", "req", 1150), ev(32*ms+30, "app", "req", 1100), ev(32*ms+90, "app", "rep", 1100),
		ev(32*ms+110, "tun", "rep", 1150),
	}
	got := bursts(client, server)
	want := [][8]int64{
		{0, 20, 30, 60, 120, 150, 200, 230},
		{32 * ms, 32*ms + 12, 32*ms + 20, 32*ms + 30, 32*ms + 90, 32*ms + 110, 32*ms + 150, 32*ms + 160},
	}
	if len(got) != len(want) {
		t.Fatalf("got %d bursts %v, want %v", len(got), got, want)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("burst %d: %v, want %v", i, got[i], want[i])
		}
	}
}
