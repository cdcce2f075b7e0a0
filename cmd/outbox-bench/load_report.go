package main

import (
	"fmt"
	"io"
	"math"
	"os"
	"strings"
	"text/tabwriter"
)

// judgeLoad evaluates issue 28's targets on the load phase.
func judgeLoad(r *results) []target {
	p := r.Load
	if p == nil {
		return nil
	}
	var ts []target
	for _, pt := range p.Runs {
		if pt.Offered != 2000 {
			continue
		}
		f := p.floorAt(pt.Offered)
		suffix := fmt.Sprintf(" at 2,000/s, consumer batch %d", pt.BatchSize)
		if p.Drain != nil {
			ts = append(ts, judged("relay CPU/event"+suffix+" ÷ its drain's", ratio(pt.Relay.CPUPer1k, p.Drain.Relay.CPUPer1k), 4, true))
			ts = append(ts, target{Name: "  consumer CPU/event" + suffix + " ÷ its drain's", Value: ratio(pt.Consumer.CPUPer1k, p.Drain.Consumer.CPUPer1k), Info: true})
		}
		if f != nil {
			ts = append(ts, judged("insert→applied p99"+suffix+" ÷ floor p99", ratio(pt.InsertToApplied.P99, f.InsertToApplied.P99), 2, true))
		}
		ts = append(ts, judged("insert→applied p99"+suffix+" (ms)", pt.InsertToApplied.P99, 5, true))
	}
	return ts
}

func (p *loadPhase) floorAt(rate int) *e2eFloor {
	for i := range p.Floor {
		if p.Floor[i].Offered == rate {
			return &p.Floor[i]
		}
	}
	return nil
}

// loadRows is the load phase as table rows: a header and one row per run,
// the drain first.
func loadRows(p *loadPhase) [][]string {
	head := []string{"offered/s", "consumer batch", "messages/tx", "achieved/s", "insert→applied p50 ms", "p99 ms", "floor p50 ms", "floor p99 ms",
		"relay", "consumer", "NATS server", "PostgreSQL", "walsender", "consumer backends",
		"relay wake-ups/event", "consumer", "NATS", "PostgreSQL", "machine cores"}
	rows := [][]string{head}
	add := func(label string, pt loadPoint, f *e2eFloor) {
		fp50, fp99 := "", ""
		if f != nil {
			fp50, fp99 = f3(f.InsertToApplied.P50), f3(f.InsertToApplied.P99)
		}
		p50, p99 := f3(pt.InsertToApplied.P50), f3(pt.InsertToApplied.P99)
		if pt.Offered == 0 {
			p50, p99 = "", ""
		}
		perTx := ""
		if n := pt.messagesPerTx(); n > 0 {
			perTx = f2(n)
		}
		rows = append(rows, []string{label, fmt.Sprint(pt.BatchSize), perTx, num(pt.Achieved), p50, p99, fp50, fp99,
			f4(pt.Relay.CPUPer1k), f4(pt.Consumer.CPUPer1k), f4(pt.NATS.CPUPer1k), f4(pt.Postgres.CPUPer1k), f4(pt.Walsender.CPUPer1k), f4(pt.ConsumerBackends.CPUPer1k),
			f2(pt.Relay.WakeupsPerEvent), f2(pt.Consumer.WakeupsPerEvent), f2(pt.NATS.WakeupsPerEvent), f2(pt.Postgres.WakeupsPerEvent), f2(pt.MachineCores)})
	}
	if p.Drain != nil {
		add(fmt.Sprintf("drain (%d rows/tx)", p.DrainRowsPerTx), *p.Drain, nil)
	}
	for _, pt := range p.Runs {
		add(fmt.Sprint(pt.Offered), pt, p.floorAt(pt.Offered))
	}
	return rows
}

const loadCaption = "messages/tx is how many messages the consumer's transactions carried on average; CPU in seconds per 1,000 events; wake-ups are voluntary context switches per event (all threads); PostgreSQL is the whole cluster, of which the walsender and the consumer's backends; the floor is the same load's two durable commits back to back (writer, then the consumer's transaction) with a bare reader decoding meanwhile"

func printLoad(w io.Writer, r *results) {
	p := r.Load
	if p == nil {
		return
	}
	fmt.Fprintf(w, "\nCost at load: 1-row transactions at each offered load (%.0f s + %.0f s warm-up), relay, consumer (%d workers) and NATS server each in its own process; PostgreSQL fsync=%s synchronous_commit=%s\n%s\n",
		p.Seconds, p.WarmupSeconds, p.Workers, p.PGSettings["fsync"], p.PGSettings["synchronous_commit"], loadCaption)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	for _, row := range loadRows(p) {
		fmt.Fprintln(tw, strings.Join(row, "\t")+"\t")
	}
	tw.Flush()
}

// writeLoadFiles writes base-load.md (the table) and base-load-cost.svg and
// base-load-p99.svg (the plots).
func writeLoadFiles(base string, r *results) error {
	p := r.Load
	var b strings.Builder
	fmt.Fprintf(&b, "# Cost at load, %s (commit %s)\n\n%d × %s; PostgreSQL %s (fsync=%s, synchronous_commit=%s); nats-server %s; background load before the run %.2f cores.\n\n%s.\n\n",
		r.Date, r.Commit, r.Machine.CPUs, r.Machine.CPUModel, r.PostgreSQL, p.PGSettings["fsync"], p.PGSettings["synchronous_commit"], r.NATS, r.BackgroundCores, loadCaption)
	rows := loadRows(p)
	for i, row := range rows {
		fmt.Fprintf(&b, "| %s |\n", strings.Join(row, " | "))
		if i == 0 {
			fmt.Fprintf(&b, "|%s\n", strings.Repeat("---:|", len(row)))
		}
	}
	b.WriteString("\n![CPU per event against the offered load](" + fileBase(base) + "-load-cost.svg)\n\n![insert→applied p99 against the offered load](" + fileBase(base) + "-load-p99.svg)\n")
	if err := os.WriteFile(base+"-load.md", []byte(b.String()), 0o644); err != nil {
		return err
	}
	if err := os.WriteFile(base+"-load-cost.svg", []byte(costPlot(p)), 0o644); err != nil {
		return err
	}
	return os.WriteFile(base+"-load-p99.svg", []byte(latencyPlot(p)), 0o644)
}

func fileBase(path string) string {
	if i := strings.LastIndexByte(path, '/'); i >= 0 {
		return path[i+1:]
	}
	return path
}

var plotColors = []string{"#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"}

// costPlot is CPU µs per event of each process against the offered load,
// one line per consumer batch size (dashed: batched), the drain's cost as
// a dotted level.
func costPlot(p *loadPhase) string {
	procs := []struct {
		name string
		get  func(loadPoint) float64
	}{
		{"relay", func(pt loadPoint) float64 { return pt.Relay.CPUPer1k }},
		{"consumer", func(pt loadPoint) float64 { return pt.Consumer.CPUPer1k }},
		{"NATS server", func(pt loadPoint) float64 { return pt.NATS.CPUPer1k }},
		{"PostgreSQL", func(pt loadPoint) float64 { return pt.Postgres.CPUPer1k }},
	}
	var ss []series
	for i, pr := range procs {
		for j, batch := range batchSizes(p) {
			s := series{name: fmt.Sprintf("%s, batch %d", pr.name, batch), color: plotColors[i], dash: j > 0}
			for _, pt := range p.Runs {
				if pt.BatchSize == batch {
					s.pts = append(s.pts, [2]float64{float64(pt.Offered), pr.get(pt) * 1000})
				}
			}
			ss = append(ss, s)
		}
		if p.Drain != nil {
			ss = append(ss, series{name: pr.name + ", drain", color: plotColors[i], level: pr.get(*p.Drain) * 1000})
		}
	}
	return svgPlot("CPU per event against the offered load (1-row transactions)", "offered events/s", "CPU µs per event", ss)
}

// latencyPlot is insert→applied p50 and p99 against the offered load per
// consumer batch size, with the floor's p99.
func latencyPlot(p *loadPhase) string {
	var ss []series
	for j, batch := range batchSizes(p) {
		p99 := series{name: fmt.Sprintf("p99, batch %d", batch), color: plotColors[j]}
		p50 := series{name: fmt.Sprintf("p50, batch %d", batch), color: plotColors[j], dash: true}
		for _, pt := range p.Runs {
			if pt.BatchSize == batch {
				p99.pts = append(p99.pts, [2]float64{float64(pt.Offered), pt.InsertToApplied.P99})
				p50.pts = append(p50.pts, [2]float64{float64(pt.Offered), pt.InsertToApplied.P50})
			}
		}
		ss = append(ss, p99, p50)
	}
	floor := series{name: "floor p99 (two durable commits)", color: "#555555", dash: true}
	for _, f := range p.Floor {
		floor.pts = append(floor.pts, [2]float64{float64(f.Offered), f.InsertToApplied.P99})
	}
	return svgPlot("insert→applied latency against the offered load", "offered events/s", "ms", append(ss, floor))
}

func batchSizes(p *loadPhase) []int {
	var out []int
	seen := map[int]bool{}
	for _, pt := range p.Runs {
		if !seen[pt.BatchSize] {
			seen[pt.BatchSize] = true
			out = append(out, pt.BatchSize)
		}
	}
	return out
}

// series is one line of a plot: points, or a horizontal level when level
// is set.
type series struct {
	name  string
	color string
	dash  bool
	pts   [][2]float64
	level float64
}

// svgPlot draws series on log-log axes as a standalone SVG.
func svgPlot(title, xlabel, ylabel string, ss []series) string {
	const w, h, left, right, top, bottom = 760.0, 440.0, 70.0, 230.0, 40.0, 50.0
	xmin, xmax, ymin, ymax := math.Inf(1), math.Inf(-1), math.Inf(1), math.Inf(-1)
	for _, s := range ss {
		for _, pt := range s.pts {
			if pt[0] > 0 && pt[1] > 0 {
				xmin, xmax, ymin, ymax = math.Min(xmin, pt[0]), math.Max(xmax, pt[0]), math.Min(ymin, pt[1]), math.Max(ymax, pt[1])
			}
		}
		if s.level > 0 {
			ymin, ymax = math.Min(ymin, s.level), math.Max(ymax, s.level)
		}
	}
	if math.IsInf(xmin, 0) || math.IsInf(ymin, 0) {
		return `<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"/>`
	}
	lx0, lx1 := math.Floor(math.Log10(xmin)*4)/4, math.Ceil(math.Log10(xmax)*4)/4
	ly0, ly1 := math.Floor(math.Log10(ymin)), math.Ceil(math.Log10(ymax))
	if lx1 == lx0 {
		lx1 = lx0 + 1
	}
	if ly1 == ly0 {
		ly1 = ly0 + 1
	}
	pw, ph := w-left-right, h-top-bottom
	X := func(v float64) float64 { return left + (math.Log10(v)-lx0)/(lx1-lx0)*pw }
	Y := func(v float64) float64 { return top + ph - (math.Log10(v)-ly0)/(ly1-ly0)*ph }
	var b strings.Builder
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%.0f" height="%.0f" font-family="sans-serif" font-size="11">`+"\n", w, h)
	fmt.Fprintf(&b, `<rect width="100%%" height="100%%" fill="white"/><text x="%.0f" y="20" font-size="14">%s</text>`+"\n", left, esc(title))
	for e := ly0; e <= ly1; e++ {
		for _, m := range []float64{1, 2, 5} {
			v := m * math.Pow(10, e)
			if math.Log10(v) > ly1+1e-9 {
				break
			}
			y := Y(v)
			fmt.Fprintf(&b, `<line x1="%.1f" x2="%.1f" y1="%.1f" y2="%.1f" stroke="#ddd"/><text x="%.1f" y="%.1f" text-anchor="end">%s</text>`+"\n", left, left+pw, y, y, left-5, y+4, tick(v))
		}
	}
	for e := math.Floor(lx0); e <= lx1; e++ {
		for _, m := range []float64{1, 2, 5} {
			v := m * math.Pow(10, e)
			if l := math.Log10(v); l < lx0-1e-9 || l > lx1+1e-9 {
				continue
			}
			x := X(v)
			fmt.Fprintf(&b, `<line x1="%.1f" x2="%.1f" y1="%.1f" y2="%.1f" stroke="#ddd"/><text x="%.1f" y="%.1f" text-anchor="middle">%s</text>`+"\n", x, x, top, top+ph, x, top+ph+15, tick(v))
		}
	}
	fmt.Fprintf(&b, `<rect x="%.0f" y="%.0f" width="%.0f" height="%.0f" fill="none" stroke="#333"/>`+"\n", left, top, pw, ph)
	fmt.Fprintf(&b, `<text x="%.0f" y="%.0f" text-anchor="middle">%s</text>`+"\n", left+pw/2, h-12, esc(xlabel))
	fmt.Fprintf(&b, `<text transform="translate(16 %.0f) rotate(-90)" text-anchor="middle">%s</text>`+"\n", top+ph/2, esc(ylabel))
	for i, s := range ss {
		style := fmt.Sprintf(`stroke="%s" stroke-width="2" fill="none"`, s.color)
		switch {
		case s.level > 0:
			style += ` stroke-dasharray="2 3" stroke-width="1"`
		case s.dash:
			style += ` stroke-dasharray="6 4"`
		}
		if s.level > 0 {
			fmt.Fprintf(&b, `<line x1="%.1f" x2="%.1f" y1="%.1f" y2="%.1f" %s/>`+"\n", left, left+pw, Y(s.level), Y(s.level), style)
		} else {
			var pts []string
			for _, pt := range s.pts {
				if pt[0] > 0 && pt[1] > 0 {
					pts = append(pts, fmt.Sprintf("%.1f,%.1f", X(pt[0]), Y(pt[1])))
					fmt.Fprintf(&b, `<circle cx="%.1f" cy="%.1f" r="2.5" fill="%s"/>`+"\n", X(pt[0]), Y(pt[1]), s.color)
				}
			}
			fmt.Fprintf(&b, `<polyline points="%s" %s/>`+"\n", strings.Join(pts, " "), style)
		}
		ly := top + 10 + float64(i)*16
		fmt.Fprintf(&b, `<line x1="%.0f" x2="%.0f" y1="%.1f" y2="%.1f" %s/><text x="%.0f" y="%.1f">%s</text>`+"\n", w-right+10, w-right+34, ly, ly, style, w-right+40, ly+4, esc(s.name))
	}
	b.WriteString("</svg>\n")
	return b.String()
}

func tick(v float64) string {
	switch {
	case v >= 1000:
		return num(v)
	case v >= 1:
		return fmt.Sprintf("%g", math.Round(v))
	default:
		return fmt.Sprintf("%g", float64(float32(v)))
	}
}

func esc(s string) string {
	return strings.NewReplacer("&", "&amp;", "<", "&lt;", ">", "&gt;").Replace(s)
}

func f4(v float64) string { return fmt.Sprintf("%.4f", v) }
