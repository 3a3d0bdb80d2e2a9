package main

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	netnstest "github.com/redirector-mesh/redirector/test/netns"
)

// The hop breakdown of the 1-byte round trip: where, between the client
// app's request and its reply, each relay pair spends its time. A tap
// (tap.go) in the client pod and one in the server pod stamp every data
// segment of the round trips as it passes an interface, and each round trip
// is cut into its legs:
//
//	client pod: app request (A) -> tunnel request out (B)
//	wire:       B -> tunnel request in at the server pod (E)
//	server pod: E -> request to the app (F); app's reply (G) -> tunnel reply out (H)
//	wire:       H -> tunnel reply in at the client pod (C)
//	client pod: C -> reply to the app (D)
//
// The relays' legs include their kernel paths on both sockets (the capture
// too, for the mesh's client side) and their wake-ups; the app's turn (F to G)
// is the echo server's. What the taps cannot see is the client app's own
// write before A and its wake-up after D.

// hopLegs are the legs, in the order a round trip runs them, with the
// events (pod, leg, direction) each runs from and to.
var hopLegs = []struct {
	key, title string
	from, to   int // indexes into hopEvents
}{
	{"hop_client_out", "client relay, app to tunnel", 0, 1},
	{"hop_wire_out", "wire, client to server", 1, 2},
	{"hop_server_in", "server relay, tunnel to app", 2, 3},
	{"hop_app", "echo server", 3, 4},
	{"hop_server_out", "server relay, app to tunnel", 4, 5},
	{"hop_wire_back", "wire, server to client", 5, 6},
	{"hop_client_in", "client relay, tunnel to app", 6, 7},
	{"hop_total", "first tap to last", 0, 7},
}

// hopEvents are a round trip's eight sightings, in order.
var hopEvents = []hopEvent{
	{client: true, leg: "app", dir: "req"},
	{client: true, leg: "tun", dir: "req"},
	{client: false, leg: "tun", dir: "req"},
	{client: false, leg: "app", dir: "req"},
	{client: false, leg: "app", dir: "rep"},
	{client: false, leg: "tun", dir: "rep"},
	{client: true, leg: "tun", dir: "rep"},
	{client: true, leg: "app", dir: "rep"},
}

type hopEvent struct {
	client   bool
	leg, dir string
}

type stamped struct {
	ns int64
	hopEvent
}

// roundTrips cuts the two pods' sightings into round trips: for each, the
// time of each of its eight events. A sighting that is not the next event
// expected (a WINDOW_UPDATE or a ticket on the tunnel, a retransmission) is
// skipped; a client request while a round trip is still open starts over.
func roundTrips(client, server []tapEvent) [][8]int64 {
	all := merged(client, server, func(tapEvent) bool { return true })
	var out [][8]int64
	var cur [8]int64
	next := 0
	for _, s := range all {
		switch {
		case s.hopEvent == hopEvents[next]:
			cur[next] = s.ns
			next++
			if next == len(hopEvents) {
				out = append(out, cur)
				next = 0
			}
		case s.hopEvent == hopEvents[0]:
			cur[0] = s.ns
			next = 1
		}
	}
	return out
}

// merged is both pods' sightings that keep accepts, each marked with its
// pod, in time order.
func merged(client, server []tapEvent, keep func(tapEvent) bool) []stamped {
	var all []stamped
	for i, evs := range [][]tapEvent{client, server} {
		for _, e := range evs {
			if keep(e) {
				all = append(all, stamped{e.ns, hopEvent{i == 0, e.leg, e.dir}})
			}
		}
	}
	slices.SortStableFunc(all, func(a, b stamped) int { return int(a.ns - b.ns) })
	return all
}

// hopMeans gives each leg's mean over the round trips, in µs, leaving out
// the slowest 1 % by total (a stall of the machine's would outweigh the
// rest). Means, not medians: a leg's time is bimodal (the woken process
// found its CPU awake, or had to wake it), so the legs' medians do not add
// up to anything, while their means add up to the total's.
func hopMeans(rts [][8]int64) map[string]float64 {
	out := map[string]float64{}
	if len(rts) == 0 {
		return out
	}
	kept := slices.Clone(rts)
	slices.SortFunc(kept, func(a, b [8]int64) int { return int((a[7] - a[0]) - (b[7] - b[0])) })
	kept = kept[:max(1, len(kept)*99/100)]
	for _, l := range hopLegs {
		var sum float64
		for _, rt := range kept {
			sum += float64(rt[l.to] - rt[l.from])
		}
		out[l.key] = sum / float64(len(kept)) / 1e3
	}
	return out
}

// runHops makes the round trips of one rr sample with both pods tapped and
// returns the legs' means and the rr tool's own p50. Variants with no relay pair have nothing to break down.
func runHops(ctx context.Context, cfg config, v *variant) (map[string]float64, error) {
	if v.tunnelPort == nil || v.serverPod == nil {
		return nil, nil
	}
	n := cfg.RRCount / cfg.RRSlices
	var rr rrResult
	client, server, err := withTaps(ctx, v, echoPort, func() (err error) {
		rr, err = runRR(ctx, v, n, false)
		return err
	})
	if err != nil {
		return nil, err
	}
	rts := roundTrips(client, server)
	// The warm-up's round trips are tapped too; fewer than n resolved means
	// the taps missed segments, and the means would not be of this sample.
	if len(rts) < n {
		return nil, fmt.Errorf("hops: the taps resolved %d round trips of %d (client pod %d segments, server pod %d)",
			len(rts), n, len(client), len(server))
	}
	out := hopMeans(rts[len(rts)-n:])
	out["hop_rr_p50"] = rr.P50us
	return out, nil
}

// withTaps runs load with a tap in the variant's client and server pods
// and returns what each saw on appPort and the tunnel port.
func withTaps(ctx context.Context, v *variant, appPort int, load func() error) (client, server []tapEvent, err error) {
	dir, err := os.MkdirTemp("", "meshbench-hops-")
	if err != nil {
		return nil, nil, err
	}
	defer os.RemoveAll(dir)
	var taps []*child
	defer func() {
		for _, t := range taps {
			t.kill()
		}
	}()
	pods := []*netnstest.Pod{v.client, v.serverPod}
	file := func(i int) string { return filepath.Join(dir, pods[i].Name+".tap") }
	for i, p := range pods {
		t, err := startChild(nil, p.Path(), "tap in "+p.Name, selfPath(), "tap", "-out", file(i),
			"-app-port", strconv.Itoa(appPort), "-tunnel-port", strconv.Itoa(v.tunnelPort(appPort)))
		if err != nil {
			return nil, nil, err
		}
		taps = append(taps, t)
		if _, err := t.waitLine(ctx, "tap ready", 10*time.Second); err != nil {
			return nil, nil, err
		}
	}
	if err := load(); err != nil {
		return nil, nil, err
	}
	var seen [2][]tapEvent
	for i, t := range taps {
		if seen[i], err = finishTap(t, file(i)); err != nil {
			return nil, nil, err
		}
	}
	return seen[0], seen[1], nil
}

// finishTap ends a tap's recording (its standard input closes) and reads
// what it wrote.
func finishTap(t *child, file string) ([]tapEvent, error) {
	_ = t.stdin.Close()
	select {
	case <-t.done:
		if t.err != nil {
			return nil, fmt.Errorf("%s: %w: %s", t.name, t.err, t.stderr.String())
		}
	case <-time.After(10 * time.Second):
		return nil, fmt.Errorf("%s did not finish within 10s", t.name)
	}
	return readTapFile(file)
}

// The fixed HTTP load by stage (test httphops, run only when asked for):
// fortio's 16 connections send their requests in bursts, and a burst's
// slowest request is what the p99 is made of. Each burst (the sightings
// between two quiet gaps) is cut at the same eight events as a round trip,
// taken at the burst's first client request and then at the last sighting
// of each kind: when the client relay has sent the whole burst, when it has
// all arrived, when the server relay has delivered all of it, and so on, to
// the last reply delivered to fortio.

// burstGapNs separates bursts: fortio's 16 ms between bursts at 1000 qps
// over 16 connections, against a burst that drains in a millisecond or two.
const burstGapNs = 3_000_000

// minDataSegment leaves out the tunnel's control records (window updates,
// pings, session tickets): requests and replies carry a payload of 1 KiB.
const minDataSegment = 200

// bursts cuts the two pods' sightings into bursts and gives each its eight
// stage times (the order of hopEvents). A burst missing a kind is dropped.
func bursts(client, server []tapEvent) [][8]int64 {
	all := merged(client, server, func(e tapEvent) bool { return e.leg != "tun" || e.payload >= minDataSegment })
	var out [][8]int64
	flush := func(b []stamped) {
		var st [8]int64
		var seen [8]bool
		for _, s := range b {
			i := slices.Index(hopEvents, s.hopEvent)
			if i == 0 && seen[0] {
				continue // the stage starts at the first request
			}
			st[i], seen[i] = s.ns, true
		}
		for _, ok := range seen {
			if !ok {
				return
			}
		}
		out = append(out, st)
	}
	start := 0
	for i := 1; i <= len(all); i++ {
		if i == len(all) || all[i].ns-all[i-1].ns > burstGapNs {
			flush(all[start:i])
			start = i
		}
	}
	return out
}

// runHTTPHops runs the fixed HTTP load for --http-time with both pods
// tapped and returns the stages' means over the bursts, the p90 and p99 of
// the bursts' first-to-last times, fortio's p99 and the number of bursts.
func runHTTPHops(ctx context.Context, cfg config, v *variant) (map[string]float64, error) {
	if v.tunnelPort == nil || v.serverPod == nil {
		return nil, nil
	}
	var res fortioResult
	client, server, err := withTaps(ctx, v, fortioPort, func() (err error) {
		res, err = runFortio(ctx, cfg, v, cfg.HTTPQPS, cfg.HTTPTime)
		return err
	})
	if err != nil {
		return nil, err
	}
	bs := bursts(client, server)
	if len(bs) == 0 {
		return nil, fmt.Errorf("httphops: no complete burst in %d + %d segments", len(client), len(server))
	}
	out := map[string]float64{}
	for k, x := range hopMeans(bs) {
		out[burstKey(k)] = x
	}
	totals := make([]float64, len(bs))
	for i, b := range bs {
		totals[i] = float64(b[7]-b[0]) / 1e3
	}
	st := rrStats(totals)
	out["burst_total_p90"], out["burst_total_p99"] = st.P90us, st.P99us
	out["burst_http_p99"] = res.percentileMs(99) * 1e3
	out["burst_count"] = float64(len(bs))
	return out, nil
}

// burstKey is the name a leg's figure has in the HTTP breakdown.
func burstKey(hopKey string) string { return "burst_" + strings.TrimPrefix(hopKey, "hop_") }

func readTapFile(path string) ([]tapEvent, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var out []tapEvent
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) != 4 {
			return nil, fmt.Errorf("%s: line %q: want 4 fields", path, sc.Text())
		}
		ns, err1 := strconv.ParseInt(fields[0], 10, 64)
		n, err2 := strconv.Atoi(fields[3])
		if err1 != nil || err2 != nil {
			return nil, fmt.Errorf("%s: line %q: bad number", path, sc.Text())
		}
		out = append(out, tapEvent{ns: ns, leg: fields[1], dir: fields[2], payload: n})
	}
	return out, sc.Err()
}

// hopsMarkdown prints both breakdowns that ran.
func (r *results) hopsMarkdown(w io.Writer) {
	r.stagesMarkdown(w, func(k string) string { return k }, []string{"hop_rr_p50"}, []string{"rr p50 of the tapped sample"},
		"1-byte round trip by hop (µs; mean over the round trips of one tapped sample but its slowest 1 %, median of the rounds)")
	r.stagesMarkdown(w, burstKey, []string{"burst_total_p90", "burst_total_p99", "burst_http_p99"},
		[]string{"bursts' p90, first tap to last", "bursts' p99", "fortio's p99 (µs)"},
		"HTTP at the fixed load by stage, per burst (µs from the burst's first request to the last sighting of each stage; mean over the bursts but the slowest 1 %, median of the rounds)")
}

// stagesMarkdown is one breakdown as a table: per variant, each leg's
// median over the rounds of the per-round means.
func (r *results) stagesMarkdown(w io.Writer, key func(string) string, extraKeys, extraTitles []string, title string) {
	var rows []string
	for _, v := range r.Variants {
		cells := []string{v.Name}
		for _, l := range hopLegs {
			s, ok := r.get(v.Name, key(l.key))
			if !ok {
				break
			}
			cells = append(cells, num(s.Median))
		}
		if len(cells) != len(hopLegs)+1 {
			continue
		}
		for _, k := range extraKeys {
			extra, _ := r.get(v.Name, k)
			cells = append(cells, num(extra.Median))
		}
		rows = append(rows, "| "+strings.Join(cells, " | ")+" |")
	}
	if len(rows) == 0 {
		return
	}
	fmt.Fprintf(w, "\n%s:\n\n| variant |", title)
	for _, l := range hopLegs {
		fmt.Fprintf(w, " %s |", l.title)
	}
	fmt.Fprintf(w, " %s |\n| --- |%s\n", strings.Join(extraTitles, " | "), strings.Repeat(" ---: |", len(hopLegs)+len(extraTitles)))
	fmt.Fprintln(w, strings.Join(rows, "\n"))
}
