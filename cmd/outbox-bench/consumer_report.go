package main

import (
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
)

// judgeConsumer evaluates issue 11's consumer targets.
func judgeConsumer(r *results) []target {
	p := r.Consumer
	if p == nil {
		return nil
	}
	var ts []target
	add := func(name string, v, limit float64, le bool) { ts = append(ts, judged(name, v, limit, le)) }
	var ceiling float64 // the best apply ceiling of the batched runs
	for _, run := range p.Runs {
		if run.BatchSize == 1 {
			continue
		}
		add(fmt.Sprintf("consumer ÷ apply ceiling, %s handler", run.Handler), run.Ratio, 0.7, false)
		switch run.Handler {
		case "batch":
			add("batch handler, events/s", run.Rate, 30000, false)
		default:
			add("per-message handler (batched), events/s", run.Rate, 15000, false)
		}
		if run.Handler != "batch" {
			ceiling = max(ceiling, run.Ceiling)
		}
	}
	one := map[string]float64{}
	plain := map[string]consumerFigure{} // the plain-durable process controls
	for _, run := range p.GroupRuns {
		if run.Plain {
			plain[run.Handler] = run
		}
	}
	for _, run := range p.GroupRuns {
		switch base, ok := one[run.Handler]; {
		case run.Plain:
		case run.Processes == 0:
			for _, r := range p.Runs {
				if r.Handler == run.Handler && r.BatchSize == run.BatchSize && r.Rate > 0 {
					ts = append(ts, target{Name: fmt.Sprintf("  one consumer, %d workers ÷ %d workers, %s handler", run.Workers, p.Workers, run.Handler), Value: run.Rate / r.Rate, Info: true})
				}
			}
		case run.Processes == 1:
			one[run.Handler] = run.Rate
		case ok && run.Workers < p.Workers:
			ts = append(ts, target{Name: fmt.Sprintf("  %d processes with %d workers each ÷ 1 process, %s handler", run.Processes, run.Workers, run.Handler), Value: run.Rate / base, Info: true})
		case ok:
			// Issue 28 replaced "n processes ≥ 1 process", which a 2-core
			// box cannot show, by the group's overhead against one
			// consumer with the same workers in all.
			if c, ok := plain[run.Handler]; ok && c.Rate > 0 {
				add(fmt.Sprintf("group overhead: %d members × %d workers ÷ one consumer process with %d, %s handler", run.Processes, run.Workers, c.Workers, run.Handler), run.Rate/c.Rate, 0.9, false)
				if c.BenchMicrosPerEvent > 0 {
					ts = append(ts, target{Name: fmt.Sprintf("  NATS server CPU per event, %d-member group ÷ one durable, %s handler", run.Processes, run.Handler), Value: run.BenchMicrosPerEvent / c.BenchMicrosPerEvent, Info: true})
				}
			}
			ts = append(ts, target{Name: fmt.Sprintf("  %d processes ÷ 1 process, %s handler (group)", run.Processes, run.Handler), Value: run.Rate / base, Info: true})
		}
	}
	if e := p.E2E; e != nil {
		bound := ceiling
		for _, b := range r.Backlogs {
			if b.RowsPerTx == 100 && (bound == 0 || b.Relay.Rate < bound) {
				bound = b.Relay.Rate
			}
		}
		if bound > 0 {
			add("end-to-end sustained ÷ min(relay drain, apply ceiling)", e.SustainedRate/bound, 0.8, false)
		} else {
			ts = append(ts, target{Name: "end-to-end sustained, events/s (no ceiling this run)", Value: e.SustainedRate, Info: true})
		}
		if shared := sharedCoresBound(r); shared > 0 {
			ts = append(ts, target{Name: "  ÷ the stages' rates sharing the cores", Value: e.SustainedRate / shared, Info: true})
		}
		// Of repeated runs, the least disturbed counts: the one whose
		// machine had the fewest cores busy beyond the pipeline's own.
		best := map[[2]int]e2eLatency{}
		for _, l := range e.Latency {
			k := [2]int{l.Offered, min(l.BatchSize, 2)}
			if b, ok := best[k]; !ok || l.otherCores() < b.otherCores() {
				best[k] = l
			}
		}
		if l, ok := best[[2]int{2000, 2}]; ok {
			add("insert→applied p99 at 2,000/s, batched (ms)", l.InsertToApplied.P99, 5, true)
		}
		for _, f := range e.Floor {
			if f.Offered == 2000 {
				ts = append(ts, target{Name: "  floor: the two commits alone at 2,000/s, p99 (ms)", Value: f.InsertToApplied.P99, Info: true},
					target{Name: "  floor: the walsender's commit→receive meanwhile, p99 (ms)", Value: f.CommitToReceive.P99, Info: true})
			}
		}
		// Light load: batching must not make a message wait.
		one, ok1 := best[[2]int{100, 1}]
		batched, ok2 := best[[2]int{100, 2}]
		if ok1 && ok2 {
			ts = append(ts, target{Name: "  insert→applied p50 at 100/s, 1 message/tx (ms)", Value: one.InsertToApplied.P50, Info: true})
			add("insert→applied p50 at 100/s, batched (ms) ≤ 1 msg/tx +10%", batched.InsertToApplied.P50, one.InsertToApplied.P50*1.1, true)
		}
	}
	return ts
}

// sharedCoresBound is what the pipeline reaches when its stages do not run
// beside each other but share the same busy cores: each event costs the
// loader's, the relay drain's and the batched consumer's time per event
// (each measured alone with the machine to itself) one after the other,
// 1/Σ(1/rate). 0 when a stage was not measured.
func sharedCoresBound(r *results) float64 {
	p := r.Consumer
	if p == nil || p.E2E == nil || p.E2E.LoadRate == 0 {
		return 0
	}
	var relay, cons float64
	for _, b := range r.Backlogs {
		if b.RowsPerTx == 100 {
			relay = b.Relay.Rate
		}
	}
	for _, run := range p.Runs {
		if run.Handler == "per-message" && run.BatchSize > 1 {
			cons = run.Rate
		}
	}
	if relay == 0 || cons == 0 {
		return 0
	}
	return 1 / (1/p.E2E.LoadRate + 1/relay + 1/cons)
}

func printConsumer(w io.Writer, r *results) {
	p := r.Consumer
	if p == nil {
		return
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	row := func(cells ...string) { fmt.Fprintln(tw, strings.Join(cells, "\t")+"\t") }
	set := func(k string) string { return p.PGSettings[k] }
	if len(p.Runs) > 0 {
		fmt.Fprintf(w, "\nConsumer: %s events over %d aggregates already in the stream, %d workers, handler inserts one row; PostgreSQL fsync=%s synchronous_commit=%s full_page_writes=%s\n",
			num(float64(p.Events)), p.Aggregates, p.Workers, set("fsync"), set("synchronous_commit"), set("full_page_writes"))
		row("", "per tx", "mean batch", "events/s", "apply ceiling", "÷ ceiling", "PostgreSQL cores", "bench cores", "machine cores")
		for i, run := range p.Runs {
			c := p.Ceilings[i]
			row(run.Name, fmt.Sprint(run.BatchSize), f1(run.MeanBatch), num(run.Rate), num(c.Rate), f2(run.Ratio), f2(run.PostgresCores), f2(run.BenchCores), f2(run.MachineCores))
		}
		for _, c := range p.Ceilings {
			row("  "+c.Name, fmt.Sprint(c.BatchSize), "", num(c.Rate), "", "", f2(c.PostgresCores), f2(c.BenchCores), f2(c.MachineCores))
		}
		tw.Flush()
	}
	if len(p.GroupRuns) > 0 {
		fmt.Fprintf(w, "\nConsumer groups: the same backlog in a stream with %d partitions, member processes of one group (%d workers each unless said), from the first commit to the last\n", p.GroupPartitions, p.Workers)
		row("", "per tx", "processes", "mean batch", "events/s", "apply ceiling", "÷ ceiling", "PostgreSQL cores", "NATS server (bench) cores", "its µs/event", "members cores", "machine cores")
		for _, run := range p.GroupRuns {
			row(run.Name, fmt.Sprint(run.BatchSize), fmt.Sprint(run.Processes), f1(run.MeanBatch), num(run.Rate), num(run.Ceiling), f2(run.Ratio), f2(run.PostgresCores), f2(run.BenchCores), f1(run.BenchMicrosPerEvent), f2(run.MemberCores), f2(run.MachineCores))
		}
		tw.Flush()
	}
	if e := p.E2E; e != nil {
		fmt.Fprintf(w, "\nEnd to end: outbox INSERT → relay → JetStream → consumer commit (default consumer, per-message handler; sustained with batch size %d)\n", p.BatchSize)
		row("", "events/s", "seconds", "p50 ms", "p99 ms", "p999 ms", "max ms", "machine cores", "PG / relay / bench cores")
		row(fmt.Sprintf("sustained, %s events, 100 rows/tx", num(float64(e.Events))), num(e.SustainedRate), f1(e.Seconds), "", "", "", "", f2(e.MachineCores), "")
		row("  loader alone (outbox INSERTs, no slot)", num(e.LoadRate), "", "", "", "", "", "", "")
		if b := sharedCoresBound(r); b > 0 {
			row("  stages one after another on the same cores: 1/Σ(1/rate)", num(b), "", "", "", "", "", "", "")
		}
		for _, l := range e.Latency {
			q, c := l.InsertToApplied, l.CommitToApplied
			row(fmt.Sprintf("insert→applied at %s/s, %d/tx (achieved %s)", num(float64(l.Offered)), l.BatchSize, num(l.Achieved)), "", "",
				f2(q.P50), f2(q.P99), f2(q.P999), f2(q.Max), f2(l.MachineCores), fmt.Sprintf("%.2f / %.2f / %.2f", l.PostgresCores, l.RelayCores, l.BenchCores))
			batched := fmt.Sprintf("%.0f%% of messages in %d batches (mean %.1f)", 100*l.BatchedMessages/float64(max(1, l.Events)), l.Batches, l.BatchedMessages/float64(max(1, l.Batches)))
			row("  of which outbox commit→applied", "", "", f2(c.P50), f2(c.P99), f2(c.P999), f2(c.Max), "", batched)
			hq := l.CommitToHandler
			row("  of which outbox commit→handler called", "", "", f2(hq.P50), f2(hq.P99), f2(hq.P999), f2(hq.Max), "", "")
			cs, sh := l.CommitToStored, l.StoredToHandler
			row("    outbox commit→stored in JetStream (relay)", "", "", f2(cs.P50), f2(cs.P99), f2(cs.P999), f2(cs.Max), "", "")
			row("    stored→handler called (delivery, worker queue)", "", "", f2(sh.P50), f2(sh.P99), f2(sh.P999), f2(sh.Max), "", "")
		}
		for _, f := range e.Floor {
			q := f.InsertToApplied
			row(fmt.Sprintf("floor at %s/s: INSERT commit, then the consumer's commit (no relay, no NATS)", num(float64(f.Offered))), "", "",
				f2(q.P50), f2(q.P99), f2(q.P999), f2(q.Max), f2(f.MachineCores), fmt.Sprintf("%.2f / – / %.2f", f.PostgresCores, f.BenchCores))
			w := f.CommitToReceive
			row("  meanwhile, a bare reader's outbox commit→receive (the walsender, no relay)", "", "", f2(w.P50), f2(w.P99), f2(w.P999), f2(w.Max), "", "")
		}
		tw.Flush()
	}
}

// otherCores is the CPU the machine spent beyond the pipeline's own during
// a latency run: other work that disturbed it.
func (l e2eLatency) otherCores() float64 {
	return l.MachineCores - l.PostgresCores - l.RelayCores - l.BenchCores
}
