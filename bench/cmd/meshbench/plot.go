package main

import (
	"fmt"
	"os"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"
)

// plot draws four panels (throughput, round-trip latency, HTTP latency
// at fixed load, rates) with one group of bars per variant: the median of
// the rounds, whiskers from min to max.
func (r *results) plot(file string) error {
	type series struct {
		label, key string
		scale      float64
	}
	panels := []struct {
		title, unit string
		series      []series
	}{
		{"Throughput, iperf3", "Gbps", []series{{"1 flow", "tput1", 1}, {"8 flows", "tput8", 1}}},
		{"1-byte request/response, one connection", "µs", []series{{"p50", "rr_p50", 1}, {"p99", "rr_p99", 1}}},
		{fmt.Sprintf("HTTP, %d B at %d qps, %d connections (fortio)", r.cfg.HTTPPayload, r.cfg.HTTPQPS, r.cfg.HTTPConns), "ms",
			[]series{{"p50", "http_p50", 1}, {"p90", "http_p90", 1}, {"p99", "http_p99", 1}}},
		{"Rates", "thousands per second", []series{{"HTTP requests at max qps", "http_maxqps", 1e-3}, {"new connections", "cps", 1e-3}}},
	}
	const cols, rows = 2, 2
	width, height := 16*vg.Inch, 11*vg.Inch
	// Bars are placed in data units; their drawn width is in points, so
	// estimate how many points one variant gets in a panel.
	perVariant := (width/cols - 80) / vg.Length(float64(len(r.Variants))+0.5)

	var names []string
	for _, v := range r.Variants {
		names = append(names, v.Name)
	}
	grid := make([][]*plot.Plot, rows)
	for i, pn := range panels {
		p := plot.New()
		p.Title.Text = pn.title
		p.Y.Label.Text = pn.unit
		p.Y.Min = 0
		p.X.Tick.Label.Font.Size = vg.Points(10)
		k := len(pn.series)
		step := 0.8 / float64(k)
		top := 0.0
		for j, s := range pn.series {
			vals := make(plotter.Values, len(names))
			pts := make(plotter.XYs, len(names))
			errs := make(plotter.YErrors, len(names))
			off := (float64(j) - float64(k-1)/2) * step
			for n, name := range names {
				pts[n].X = float64(n) + off
				sm, ok := r.get(name, s.key)
				if !ok {
					continue
				}
				vals[n] = sm.Median * s.scale
				pts[n].Y = vals[n]
				errs[n].Low, errs[n].High = (sm.Median-sm.Min)*s.scale, (sm.Max-sm.Median)*s.scale
				top = max(top, sm.Max*s.scale)
			}
			bar, err := plotter.NewBarChart(vals, vg.Length(step)*perVariant*0.9)
			if err != nil {
				return err
			}
			bar.XMin = off
			bar.Color = plotutil.Color(j)
			bar.LineStyle.Width = 0
			whiskers, err := plotter.NewYErrorBars(struct {
				plotter.XYs
				plotter.YErrors
			}{pts, errs})
			if err != nil {
				return err
			}
			p.Add(bar, whiskers)
			p.Legend.Add(s.label, bar)
		}
		p.Y.Max = top * 1.3 // room for the legend
		p.Legend.Top = true
		p.NominalX(names...)
		grid[i/cols] = append(grid[i/cols], p)
	}
	img := vgimg.New(width, height)
	dc := draw.New(img)
	tiles := draw.Tiles{Rows: rows, Cols: cols, PadTop: vg.Points(10), PadBottom: vg.Points(10),
		PadLeft: vg.Points(10), PadRight: vg.Points(10), PadX: vg.Points(30), PadY: vg.Points(30)}
	canvases := plot.Align(grid, tiles, dc)
	for y := range rows {
		for x := range cols {
			grid[y][x].Draw(canvases[y][x])
		}
	}
	f, err := os.Create(file)
	if err != nil {
		return err
	}
	if _, err := (vgimg.PngCanvas{Canvas: img}).WriteTo(f); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}
