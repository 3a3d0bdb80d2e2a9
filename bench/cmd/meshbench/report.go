package main

import (
	"encoding/json"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
)

// report prints the tables and writes <stamp>.json, <stamp>.md and
// <stamp>.png under cfg.Out.
func (r *results) report(cfg config) error {
	var b strings.Builder
	r.printTables(&b)
	fmt.Print(b.String())

	base := filepath.Join(cfg.Out, r.Stamp)
	js, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return fmt.Errorf("encode results: %w", err)
	}
	if err := os.WriteFile(base+".json", append(js, '\n'), 0o644); err != nil {
		return err
	}
	var md strings.Builder
	r.markdown(&md)
	if err := os.WriteFile(base+".md", []byte(md.String()), 0o644); err != nil {
		return err
	}
	if err := r.plot(base + ".png"); err != nil {
		return fmt.Errorf("plot: %w", err)
	}
	fmt.Printf("\nwrote %s.json, %s.md, %s.png\n", base, base, base)
	if len(r.Errors) > 0 {
		return fmt.Errorf("%d measurement(s) failed (listed above and in the JSON)", len(r.Errors))
	}
	return nil
}

func (r *results) printTables(w io.Writer) {
	m := r.Machine
	fmt.Fprintf(w, "\n== meshbench %s: %s, %d CPUs, kernel %s, %s, %s\n", r.Date, m.CPU, m.CPUs, m.Kernel, m.Go, r.Elapsed)
	fmt.Fprintf(w, "   %s\n", r.congestion())
	fmt.Fprintf(w, "   median of %d interleaved rounds [min-max]; ×: value / direct's in the same round, median [min-max]\n\n", r.cfg.Runs)
	for _, v := range r.Variants {
		fmt.Fprintf(w, "   %-16s %s\n", v.Name, v.Desc)
	}
	for _, md := range r.Metrics {
		better := "lower is better"
		if md.Higher {
			better = "higher is better"
		}
		fmt.Fprintf(w, "\n%s (%s, %s)\n", md.Title, md.Unit, better)
		for _, v := range r.Variants {
			s, ok := r.get(v.Name, md.Key)
			if !ok {
				continue
			}
			line := fmt.Sprintf("  %-16s %9s [%s-%s]", v.Name, num(s.Median), num(s.Min), num(s.Max))
			if s.Ratio != 0 && v.Name != "direct" {
				line += fmt.Sprintf("   %s× [%s-%s]", num(s.Ratio), num(s.RatioMin), num(s.RatioMax))
			}
			fmt.Fprintln(w, line)
		}
	}

	fmt.Fprintf(w, "\nCapture cost: eBPF capture-only / iptables TPROXY, same relay, paired by round, median [min-max]\n")
	for _, md := range r.Metrics {
		if s, ok := r.pairedRatio("capture-only", "iptables-tproxy", md.Key); ok {
			fmt.Fprintf(w, "  %-28s %s× [%s-%s]\n", md.Title, num(s.Median), num(s.Min), num(s.Max))
		}
	}

	r.peerSection(w)
	if rows := r.addedP99Rows(); len(rows) > 0 {
		fmt.Fprintf(w, "\nHTTP p99 added to direct's at the fixed load (ms), paired by round, median [rounds]\n")
		for _, row := range rows {
			fmt.Fprintf(w, "  %-16s %s   [%s]\n", row.variant, num(row.median), strings.Join(row.rounds, " "))
		}
	}
	if _, ok := r.Samples[altVariant]; ok {
		fmt.Fprintf(w, "\nOn/off: %s (%s) / meshed-cross, paired by round, median [min-max]\n", altVariant, r.cfg.altDesc())
		for _, md := range r.Metrics {
			if s, ok := r.pairedRatio(altVariant, "meshed-cross", md.Key); ok {
				fmt.Fprintf(w, "  %-28s %s× [%s-%s]\n", md.Title, num(s.Median), num(s.Min), num(s.Max))
			}
		}
	}
	r.anchors(w)

	fmt.Fprintf(w, "\nAgents (node1 runs the client side, node2 the server side; in meshed-same node1 does both)\n")
	for _, row := range []struct{ title, key, unit string }{
		{"CPU per GB, 1 flow", "cpu_per_gb", "s/GB"},
		{fmt.Sprintf("CPU at %d qps", r.cfg.HTTPQPS), "vcpu_at_qps", "vCPU"},
		{fmt.Sprintf("RSS at %d qps", r.cfg.HTTPQPS), "rss_at_qps", "MiB"},
	} {
		for _, v := range append([]string{"meshed-cross", "meshed-same", altVariant, plainPair.variant}, peerVariants...) {
			var cells []string
			for _, node := range []string{"node1", "node2", "node3", "node4", "client", "server"} {
				if s, ok := r.get(v, row.key+"@"+node); ok {
					cells = append(cells, fmt.Sprintf("%s %s [%s-%s]", node, num(s.Median), num(s.Min), num(s.Max)))
				}
			}
			if len(cells) > 0 {
				fmt.Fprintf(w, "  %-24s %-13s %s (%s)\n", row.title, v, strings.Join(cells, "   "), row.unit)
			}
		}
	}
	if base := r.Agent.BaselineRSS; base != nil {
		fmt.Fprintf(w, "  %-24s %-13s node1 %s   node2 %s (MiB, before any load)\n", "RSS, baseline", "", num(base["node1"]), num(base["node2"]))
	}
	if idle := r.Agent.IdleRSSPer1000; idle != nil {
		fmt.Fprintf(w, "  %-24s %-13s node1 %s   node2 %s (MiB per 1000 idle connections)\n", "RSS, idle connections",
			"meshed-cross", num(idle["node1"]), num(idle["node2"]))
	}
	r.hopsMarkdown(w)

	if s := r.Agent.EnrollSummary; s != nil {
		ans, _, _ := stats(r.Agent.EnrollToAnswerMs)
		res, _, _ := stats(r.Agent.EnrollResolutionMs)
		fmt.Fprintf(w, "  %-24s %s ms [%s-%s] from manifest write to the first captured SYN (±%s ms), %s ms to its meshed answer (median of %d)\n",
			"enrollment", num(s.Median), num(s.Min), num(s.Max), num(res), num(ans), s.N)
		if len(r.Agent.EnrollToLogMs) > 0 {
			lg, _, _ := stats(r.Agent.EnrollToLogMs)
			fmt.Fprintf(w, "  %-24s the agent logged \"pod enrolled\" after %s ms (median; the line comes once the host-probe links are attached too, after capture is on)\n", "", num(lg))
		}
	}

	if len(r.Profiles) > 0 {
		fmt.Fprintf(w, "\nProfiles of the agents under meshed-cross load (go tool pprof -top)\n")
		for _, p := range r.Profiles {
			fmt.Fprintf(w, "\n-- %s load, %s agent (%s)\n", p.Load, p.Node, p.File)
			text := p.Top
			if text == "" { // an execution trace's profile, by cumulative time
				text = p.Cum
			}
			lines := strings.Split(strings.TrimSpace(text), "\n")
			fmt.Fprintln(w, strings.Join(lines[:min(len(lines), 18)], "\n"))
		}
	}

	if len(r.Micro) > 0 {
		fmt.Fprintf(w, "\nGo microbenchmarks (-benchmem, -benchtime %s)\n", r.cfg.BenchTime)
		for _, mr := range r.Micro {
			fmt.Fprintf(w, "  %-40s %s\n", strings.TrimPrefix(mr.Pkg, "github.com/redirector-mesh/redirector/")+"."+
				strings.TrimPrefix(mr.Name, "Benchmark"), microCells(mr))
		}
	}
	if len(r.Retries) > 0 {
		fmt.Fprintf(w, "\nMeasurements repeated after a failure:\n")
		for _, e := range r.Retries {
			fmt.Fprintf(w, "  %s\n", e)
		}
	}
	if len(r.Errors) > 0 {
		fmt.Fprintf(w, "\nFailed measurements:\n")
		for _, e := range r.Errors {
			fmt.Fprintf(w, "  %s\n", e)
		}
	}
}

// congestion says which TCP congestion control the run's namespaces used.
func (r *results) congestion() string {
	if r.cfg.Congestion != "" {
		return "TCP congestion control " + r.cfg.Congestion + " in every namespace of the suite (--congestion; the machine's is " + r.Machine.Congestion + ")"
	}
	return "TCP congestion control " + r.Machine.Congestion + " (the machine's, inherited by every namespace)"
}

// markdown is the table for BENCHMARKS.md: rows are variants, cells are
// "median (× direct)".
func (r *results) markdown(w io.Writer) {
	fmt.Fprintf(w, "%s.\n\n", r.congestion())
	fmt.Fprintf(w, "| variant |")
	for _, md := range r.Metrics {
		fmt.Fprintf(w, " %s (%s) |", md.Title, md.Unit)
	}
	fmt.Fprintf(w, "\n| --- |%s\n", strings.Repeat(" ---: |", len(r.Metrics)))
	for _, v := range r.Variants {
		fmt.Fprintf(w, "| %s |", v.Name)
		for _, md := range r.Metrics {
			s, ok := r.get(v.Name, md.Key)
			switch {
			case !ok:
				fmt.Fprint(w, " – |")
			case s.Ratio != 0 && v.Name != "direct":
				fmt.Fprintf(w, " %s (%s×) |", num(s.Median), num(s.Ratio))
			default:
				fmt.Fprintf(w, " %s |", num(s.Median))
			}
		}
		fmt.Fprintln(w)
	}
	defer r.hopsMarkdown(w)
	defer r.addedP99Markdown(w)
	defer r.peerMarkdown(w)
	fmt.Fprintf(w, "\nmin-max over %d rounds:\n\n| variant |", r.cfg.Runs)
	for _, md := range r.Metrics {
		fmt.Fprintf(w, " %s |", md.Title)
	}
	fmt.Fprintf(w, "\n| --- |%s\n", strings.Repeat(" ---: |", len(r.Metrics)))
	for _, v := range r.Variants {
		fmt.Fprintf(w, "| %s |", v.Name)
		for _, md := range r.Metrics {
			if s, ok := r.get(v.Name, md.Key); ok {
				fmt.Fprintf(w, " %s–%s |", num(s.Min), num(s.Max))
			} else {
				fmt.Fprint(w, " – |")
			}
		}
		fmt.Fprintln(w)
	}
}

// pairedRatio is a/b per round for one metric.
func (r *results) pairedRatio(a, b, key string) (summary, bool) {
	return r.paired(a, b, key, func(x, y float64) (float64, bool) { return x / y, y != 0 })
}

// pairedDiff is a-b per round for one metric.
func (r *results) pairedDiff(a, b, key string) (summary, bool) {
	return r.paired(a, b, key, minus)
}

// minus is x-y as a per-round operation.
func minus(x, y float64) (float64, bool) { return x - y, true }

func (r *results) paired(a, b, key string, op func(x, y float64) (float64, bool)) (summary, bool) {
	vals := r.perRound(a, b, key, op)
	if len(vals) == 0 {
		return summary{}, false
	}
	s := summary{N: len(vals)}
	s.Median, s.Min, s.Max = stats(vals)
	return s, true
}

// anchors compares meshed-cross with the published figures of design.md
// §10 (ztunnel, Istio ambient), each computed the way the anchor is stated.
func (r *results) anchors(w io.Writer) {
	fmt.Fprintf(w, "\nAnchors (design.md §10) against meshed-cross, paired by round, median [min-max]\n")
	row := func(what, anchor string, s summary, ok bool, unit string) {
		if ok {
			fmt.Fprintf(w, "  %-44s %s%s [%s-%s]   anchor: %s\n", what, num(s.Median), unit, num(s.Min), num(s.Max), anchor)
		}
	}
	s, ok := r.pairedRatio("meshed-cross", "capture-only", "tput1")
	row("1 flow, meshed / raw relay (capture-only)", "ztunnel 0.42×", s, ok, "×")
	s, ok = r.get("meshed-cross", "rr_p50")
	row("1-byte RR p50, meshed", "ztunnel 27.9 µs", s, ok, " µs")
	s, ok = r.get("direct", "rr_p50")
	row("1-byte RR p50, direct", "6.9 µs", s, ok, " µs")
	s, ok = r.pairedRatio("meshed-cross", "direct", "rr_p50")
	row("1-byte RR p50, meshed / direct", "ztunnel 4.0×", s, ok, "×")
	s, ok = r.pairedDiff("meshed-cross", "direct", "http_p90")
	row(fmt.Sprintf("HTTP p90 added at %d qps", r.cfg.HTTPQPS), "ambient +0.17 ms at 1000 rps", s, ok, " ms")
	s, ok = r.pairedDiff("meshed-cross", "direct", "http_p99")
	row(fmt.Sprintf("HTTP p99 added at %d qps", r.cfg.HTTPQPS), "ambient +0.20 ms at 1000 rps", s, ok, " ms")
	for _, node := range []string{"node1", "node2"} {
		s, ok = r.get("meshed-cross", "vcpu_at_qps@"+node)
		row(fmt.Sprintf("CPU at %d qps, %s agent", r.cfg.HTTPQPS, node), "ztunnel 0.06 vCPU per 1000 rps", s, ok, " vCPU")
	}
	for _, node := range []string{"node1", "node2"} {
		s, ok = r.get("meshed-cross", "rss_at_qps@"+node)
		row(fmt.Sprintf("RSS at %d qps, %s agent", r.cfg.HTTPQPS, node), "ztunnel 12 MB per 1000 rps", s, ok, " MiB")
	}
}

func microCells(mr microResult) string {
	var units []string
	for u := range mr.Metrics {
		units = append(units, u)
	}
	order := map[string]int{"ns/op": 0, "MB/s": 1, "B/op": 8, "allocs/op": 9}
	slices.SortFunc(units, func(a, b string) int {
		oa, ok := order[a]
		if !ok {
			oa = 5
		}
		ob, ok := order[b]
		if !ok {
			ob = 5
		}
		if oa != ob {
			return oa - ob
		}
		return strings.Compare(a, b)
	})
	var cells []string
	for _, u := range units {
		cells = append(cells, fmt.Sprintf("%10s %s", num(mr.Metrics[u]), u))
	}
	return strings.Join(cells, "  ")
}

// num prints about three significant digits.
func num(v float64) string {
	a := math.Abs(v)
	switch {
	case a >= 1000:
		return fmt.Sprintf("%.0f", v)
	case a >= 100:
		return fmt.Sprintf("%.0f", v)
	case a >= 10:
		return fmt.Sprintf("%.1f", v)
	case a >= 1:
		return fmt.Sprintf("%.2f", v)
	default:
		return fmt.Sprintf("%.3f", v)
	}
}

// peerVariants are the mature relays the mesh is compared with (issue 21).
var peerVariants = []string{"peer-stunnel", "peer-haproxy"}

// perRound is a/b (or op) for one metric, one value per round where both
// measured, in round order.
func (r *results) perRound(a, b, key string, op func(x, y float64) (float64, bool)) []float64 {
	xa, xb := r.Samples[a][key], r.Samples[b][key]
	var vals []float64
	for i := range min(len(xa), len(xb)) {
		if xa[i] == nil || xb[i] == nil {
			continue
		}
		if v, ok := op(*xa[i], *xb[i]); ok {
			vals = append(vals, v)
		}
	}
	return vals
}

// addedP99Ratio is, per round, the HTTP p99 the mesh adds to direct's
// divided by what the peer adds (rounds where the peer adds nothing are
// left out: the ratio has no meaning there).
func (r *results) addedP99Ratio(mesh, peer string) []float64 {
	d, m, p := r.Samples["direct"]["http_p99"], r.Samples[mesh]["http_p99"], r.Samples[peer]["http_p99"]
	var vals []float64
	for i := range min(len(d), len(m), len(p)) {
		if d[i] == nil || m[i] == nil || p[i] == nil || *p[i]-*d[i] <= 0 {
			continue
		}
		vals = append(vals, (*m[i]-*d[i])/(*p[i]-*d[i]))
	}
	return vals
}

// peerTarget is one of issue 21's targets: the median of the per-round
// values must be at least (or at most) want.
type peerTarget struct {
	What    string  `json:"what"`
	Key     string  `json:"metric"`
	Want    float64 `json:"want"`
	AtLeast bool    `json:"at_least"`
}

var peerTargets = []peerTarget{
	{"1 flow throughput, mesh / peer", "tput1", 1.0, true},
	{"8 flows throughput, mesh / peer", "tput8", 1.0, true},
	{"1-byte RR p50, mesh / peer", "rr_p50", 1.0, false},
	{"HTTP p99 added to direct's at the fixed load, mesh / peer", "http_p99_added", 0.9, false},
	{"new connections/s, mesh / peer", "cps", 2.0, true},
	{"proxy CPU per GB (1 flow), mesh / peer", "cpu_per_gb", 1.0, false},
}

// peerRatios is, for a meshed variant, every metric's per-round ratio to
// the peer, plus http_p99_added (see addedP99Ratio).
func (r *results) peerRatios(mesh, peer string) map[string][]float64 {
	out := map[string][]float64{}
	for _, md := range r.Metrics {
		if v := r.perRound(mesh, peer, md.Key, func(x, y float64) (float64, bool) { return x / y, y != 0 }); len(v) > 0 {
			out[md.Key] = v
		}
	}
	if v := r.addedP99Ratio(mesh, peer); len(v) > 0 {
		out["http_p99_added"] = v
	}
	return out
}

// peerSection prints the mesh against the peer: every metric's ratio per
// round, and the targets.
func (r *results) peerSection(w io.Writer) {
	for _, peer := range peerVariants {
		if _, ok := r.Samples[peer]; ok {
			r.peerSectionFor(w, peer)
		}
	}
}

func (r *results) peerSectionFor(w io.Writer, peer string) {
	rounds := func(v []float64) string {
		var cells []string
		for _, x := range v {
			cells = append(cells, num(x))
		}
		return strings.Join(cells, " ")
	}
	for _, mesh := range []string{"meshed-cross", "meshed-same"} {
		ratios := r.peerRatios(mesh, peer)
		if len(ratios) == 0 {
			continue
		}
		fmt.Fprintf(w, "\nAgainst the peer: %s / %s, per round (in round order), median\n", mesh, peer)
		titles := map[string]string{"http_p99_added": "HTTP p99 added to direct's"}
		keys := []string{}
		for _, md := range r.Metrics {
			titles[md.Key] = md.Title
			keys = append(keys, md.Key)
		}
		for _, k := range append(keys, "http_p99_added") {
			if v, ok := ratios[k]; ok {
				med, _, _ := stats(v)
				fmt.Fprintf(w, "  %-28s %s×   [%s]\n", titles[k], num(med), rounds(v))
			}
		}
		if mesh != "meshed-cross" {
			continue
		}
		fmt.Fprintf(w, "\nTargets against %s (issue 21), meshed-cross, median of the per-round ratios\n", peer)
		for _, t := range peerTargets {
			v, ok := ratios[t.Key]
			if !ok {
				fmt.Fprintf(w, "  %-58s no round to compare (for the added p99: the peer added nothing to direct's in every round)\n", t.What)
				continue
			}
			med, lo, hi := stats(v)
			held, op := med <= t.Want, "≤"
			if t.AtLeast {
				held, op = med >= t.Want, "≥"
			}
			verdict := "missed"
			if held {
				verdict = "held"
			}
			fmt.Fprintf(w, "  %-58s %s× [%s-%s] (want %s %s×): %s\n", t.What, num(med), num(lo), num(hi), op, num(t.Want), verdict)
		}
	}
}

// addedP99Row is one variant's HTTP p99 minus direct's, per round.
type addedP99Row struct {
	variant string
	median  float64
	rounds  []string
}

// addedP99Rows lists, for every variant that ran the fixed HTTP load, the p99
// it adds to direct's in the same round. Side by side they show what a
// user-space hop costs the tail on this machine whatever it does: the
// one-process paths (capture-only, iptables-tproxy, meshed-same) against the
// pairs (meshed-cross, the peers, plain-pair).
func (r *results) addedP99Rows() []addedP99Row {
	var rows []addedP99Row
	for _, v := range r.Variants {
		if v.Name == "direct" {
			continue
		}
		vals := r.perRound(v.Name, "direct", "http_p99", minus)
		if len(vals) == 0 {
			continue
		}
		row := addedP99Row{variant: v.Name}
		row.median, _, _ = stats(vals)
		for _, x := range vals {
			row.rounds = append(row.rounds, num(x))
		}
		rows = append(rows, row)
	}
	return rows
}

// addedP99Markdown is addedP99Rows as a table.
func (r *results) addedP99Markdown(w io.Writer) {
	rows := r.addedP99Rows()
	if len(rows) == 0 {
		return
	}
	fmt.Fprintf(w, "\nHTTP p99 added to direct's at the fixed load, per round:\n\n| variant | median (ms) | rounds |\n| --- | ---: | --- |\n")
	for _, row := range rows {
		fmt.Fprintf(w, "| %s | %s | %s |\n", row.variant, num(row.median), strings.Join(row.rounds, ", "))
	}
}

// peerMarkdown is the mesh / peer table for BENCHMARKS.md: per metric, the
// median of the per-round ratios and the rounds themselves.
func (r *results) peerMarkdown(w io.Writer) {
	for _, pair := range r.peerPairs() {
		mesh, peer := pair[0], pair[1]
		ratios := r.peerRatios(mesh, peer)
		if len(ratios) == 0 {
			continue
		}
		fmt.Fprintf(w, "\n%s / %s, per round:\n\n| metric | median | rounds |\n| --- | ---: | --- |\n", mesh, peer)
		rows := append([]metricDef{}, r.Metrics...)
		rows = append(rows, metricDef{Key: "http_p99_added", Title: "HTTP p99 added to direct's"})
		for _, md := range rows {
			v, ok := ratios[md.Key]
			if !ok {
				continue
			}
			med, _, _ := stats(v)
			var cells []string
			for _, x := range v {
				cells = append(cells, num(x))
			}
			fmt.Fprintf(w, "| %s | %s× | %s |\n", md.Title, num(med), strings.Join(cells, ", "))
		}
	}
}

// peerPairs lists (meshed variant, peer) for every peer that ran.
func (r *results) peerPairs() [][2]string {
	var out [][2]string
	for _, peer := range peerVariants {
		if _, ok := r.Samples[peer]; !ok {
			continue
		}
		for _, mesh := range []string{"meshed-cross", "meshed-same"} {
			out = append(out, [2]string{mesh, peer})
		}
	}
	return out
}
