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
