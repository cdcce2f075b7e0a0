package main

import (
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
)

// judge evaluates issue 5's targets on this run's figures.
func judge(r *results) []target {
	var ts []target
	add := func(name string, v, limit float64, le bool) { ts = append(ts, judged(name, v, limit, le)) }
	for _, b := range r.Backlogs {
		switch b.RowsPerTx {
		case 1:
			add("drain 1 row/tx ÷ decode ceiling", b.RatioDecode, 0.85, false)
		case 100:
			add("drain 100 rows/tx ÷ min(decode, broker)", b.RatioCeiling, 0.70, false)
		}
		add(fmt.Sprintf("relay CPU/event ÷ reader CPU/event (%d rows/tx)", b.RowsPerTx), b.RatioCPU, 1.5, true)
	}
	for _, l := range r.Latency {
		if l.Offered == 2000 {
			add("commit→ack p50 at 2,000/s (ms)", l.CommitToAck.P50, 1, true)
			add("commit→ack p99 at 2,000/s (ms)", l.CommitToAck.P99, 3, true)
		}
	}
	// Not targets: what each server alone takes at that load, to read
	// the two above by.
	for _, f := range r.LatencyFloor {
		if f.Offered == 2000 {
			ts = append(ts, target{Name: "  PostgreSQL alone: commit→receive p99 (ms)", Value: f.CommitToReceive.P99, Info: true})
		}
	}
	for _, b := range r.BrokerPaced {
		if b.Offered == 2000 {
			ts = append(ts, target{Name: "  JetStream alone: publish→ack p99 (ms)", Value: b.PublishToAck.P99, Info: true})
			ts = append(ts, target{Name: "  JetStream alone: publish→ack max (ms)", Value: b.PublishToAck.Max, Info: true})
		}
	}
	for _, l := range r.Large {
		add("peak RSS, "+l.Name+" (MB)", l.Relay.PeakRSSMB, 64, true)
	}
	if t := r.Tracing; t != nil {
		add(fmt.Sprintf("drain, relay spans on ÷ off (%d rows/tx)", t.RowsPerTx), t.Ratio, 0.95, false)
	}
	ts = append(ts, judgeConsumer(r)...)
	return append(ts, judgeLoad(r)...)
}

// judged is a target met when v ≥ limit (v ≤ limit with le).
func judged(name string, v, limit float64, le bool) target {
	ok := v >= limit
	if le {
		ok = v <= limit
	}
	return target{Name: name, Value: v, Limit: limit, Le: le, OK: ok}
}

func printTable(w io.Writer, r *results) {
	fmt.Fprintf(w, "\noutbox-bench %s  commit %s\n", r.Date, r.Commit)
	fmt.Fprintf(w, "machine: %s, %d × %s, %d MB; PostgreSQL %s (synchronous_commit=%s, fsync=%s); nats-server %s; %s\n",
		r.Machine.Hostname, r.Machine.CPUs, r.Machine.CPUModel, r.Machine.MemoryMB, r.PostgreSQL,
		r.PGSettings["synchronous_commit"], r.PGSettings["fsync"], r.NATS, r.Machine.GoVer)
	fmt.Fprintf(w, "background load before the run: %.2f cores busy\n", r.BackgroundCores)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	row := func(cells ...string) { fmt.Fprintln(tw, strings.Join(cells, "\t")+"\t") }

	if b := r.Broker; b != nil {
		fmt.Fprintf(w, "\nBroker ceiling (file storage, %.0f B messages incl. headers, unique Nats-Msg-Id)\n", b.AvgBytes)
		row("", "msgs/s", "seconds", "client+server cores", "machine cores", "errors")
		row(fmt.Sprintf("async, window %d", b.Window), num(b.Rate), f2(b.Seconds), f2(b.BenchCores), f2(b.MachineCore), fmt.Sprint(b.Errors))
		row("sync round trip", num(b.SyncRate), fmt.Sprintf("p50 %.3f ms", b.SyncP50ms), fmt.Sprintf("p99 %.3f ms", b.SyncP99ms), "", "")
		tw.Flush()
	}
	for _, b := range r.Backlogs {
		fmt.Fprintf(w, "\nDrain: %s events, %d rows/tx, %d aggregates, %.0f B payloads (loaded in %.1f s)\n", num(float64(b.Events)), b.RowsPerTx, r.Aggregates, b.AvgPayload, b.LoadSeconds)
		row("", "events/s", "seconds", "CPU s/100k", "peak RSS MB", "walsender cores", "machine cores")
		if d := b.Recvlogical; d != nil {
			row("pg_recvlogical (wall)", num(d.Rate), f2(d.Seconds), f3(d.CPUPer100k), f1(d.PeakRSSMB), f2(d.WalsenderCPU), f2(d.MachineCores))
		}
		d := b.Decode
		row("decode ceiling (pglogrepl)", num(d.Rate), f2(d.Seconds), f3(d.CPUPer100k), f1(d.PeakRSSMB), f2(d.WalsenderCPU), f2(d.MachineCores))
		if r.Broker != nil {
			row("broker ceiling", num(r.Broker.Rate), "", "", "", "", "")
		}
		d = b.Relay
		row("relay", num(d.Rate), f2(d.Seconds), f3(d.CPUPer100k), f1(d.PeakRSSMB), f2(d.WalsenderCPU), f2(d.MachineCores))
		row("relay ÷ decode", f2(b.RatioDecode), "", f2(b.RatioCPU), "", "", "")
		row("relay ÷ min(decode, broker)", f2(b.RatioCeiling), "", "", "", "", "")
		tw.Flush()
		if line := budgetLine(b); line != "" {
			fmt.Fprintln(w, line)
		}
	}
	if t := r.Tracing; t != nil {
		fmt.Fprintf(w, "\nTracing: %s events, %d rows/tx, each row with a sampled traceparent; relay spans exported over OTLP/HTTP to a sink in this process\n", num(float64(t.Events)), t.RowsPerTx)
		row("", "events/s", "seconds", "CPU s/100k", "peak RSS MB", "machine cores")
		for _, x := range []struct {
			name string
			d    drainResult
		}{{"relay, spans off", t.Off}, {"relay, spans on", t.On}} {
			row(x.name, num(x.d.Rate), f2(x.d.Seconds), f3(x.d.CPUPer100k), f1(x.d.PeakRSSMB), f2(x.d.MachineCores))
		}
		row("on ÷ off", f3(t.Ratio), "", f3(ratio(t.On.CPUPer100k, t.Off.CPUPer100k)), "", "")
		tw.Flush()
		fmt.Fprintf(w, "spans exported in the best spans-on run: %s with %s links (%s transactions; %s bytes of OTLP)\n",
			num(float64(t.SpansExported)), num(float64(t.LinksExported)), num(float64((t.Events+int64(t.RowsPerTx)-1)/int64(t.RowsPerTx))), num(float64(t.ExportBytes)))
	}
	if len(r.Latency) > 0 {
		fmt.Fprintf(w, "\nLatency, 1-row transactions from a writer pool (ms). commit→ack: pgoutput commit timestamp to JetStream store time;\ninsert→delivery: writer clock before INSERT to consumer receipt")
		if r.Broker != nil {
			fmt.Fprintf(w, " (sync publish round trip: p50 %.3f, p99 %.3f)", r.Broker.SyncP50ms, r.Broker.SyncP99ms)
		}
		fmt.Fprintln(w)
		row("offered/s", "achieved/s", "c→a p50", "p99", "p999", "i→d p50", "p99", "p999", "relay cores", "CPU s/100k", "RSS MB", "postgres cores", "nats+bench cores", "machine cores", "c→a stalls at seq")
		for _, l := range r.Latency {
			row(fmt.Sprint(l.Offered), num(l.Achieved),
				f3(l.CommitToAck.P50), f3(l.CommitToAck.P99), f3(l.CommitToAck.P999),
				f3(l.InsertToDelivery.P50), f3(l.InsertToDelivery.P99), f3(l.InsertToDelivery.P999),
				f2(l.RelayCores), f3(l.CPUPer100k), f1(l.PeakRSSMB), f2(l.PostgresCores), f2(l.BenchCores), f2(l.MachineCores),
				seqList(l.Stalls))
		}
		tw.Flush()
	}
	if len(r.LatencyFloor) > 0 || len(r.BrokerPaced) > 0 {
		fmt.Fprintln(w, "\nLatency floors at the same loads, each server alone (ms). PostgreSQL: the bare reader, commit timestamp to its receipt\nof the Commit message. JetStream: the relay's messages published on schedule, publish to ack; stalls are the stream\nsequences where acks jumped over 10 ms")
		row("offered/s", "server", "p50", "p99", "p999", "max", "stalls at seq")
		for _, f := range r.LatencyFloor {
			q := f.CommitToReceive
			row(fmt.Sprint(f.Offered), "PostgreSQL", f3(q.P50), f3(q.P99), f3(q.P999), f3(q.Max), "")
		}
		for _, b := range r.BrokerPaced {
			q := b.PublishToAck
			row(fmt.Sprint(b.Offered), "JetStream", f3(q.P50), f3(q.P99), f3(q.P999), f3(q.Max), seqList(b.Stalls))
		}
		tw.Flush()
	}
	if len(r.Large) > 0 {
		fmt.Fprintln(w, "\nMemory")
		row("", "events/s", "CPU s/100k", "peak RSS MB")
		for _, l := range r.Large {
			row(l.Name, num(l.Relay.Rate), f3(l.Relay.CPUPer100k), f1(l.Relay.PeakRSSMB))
		}
		tw.Flush()
	}
	printConsumer(w, r)
	printLoad(w, r)
	fmt.Fprintln(w, "\nTargets")
	for _, t := range r.Targets {
		if t.Info {
			fmt.Fprintf(w, "  %-52s %8.3f\n", t.Name, t.Value)
			continue
		}
		op, mark := "≥", "ok"
		if t.Le {
			op = "≤"
		}
		if !t.OK {
			mark = "MISSED"
		}
		fmt.Fprintf(w, "  %-52s %8.3f  %s %-6g %s\n", t.Name, t.Value, op, t.Limit, mark)
	}
	fmt.Fprintf(w, "\nwall time %.0f s\n", r.WallSeconds)
}

// budgetLine splits the relay drain's busy CPU per event between the
// walsender, the NATS server and the relay, and bounds what a relay costing
// nothing could reach on the same busy cores: the relay's share of a miss.
func budgetLine(b backlogResult) string {
	d := b.Relay
	if d.Rate <= 0 || d.MachineCores <= 0 || d.NATSCores <= 0 {
		return ""
	}
	us := func(cores float64) float64 { return cores / d.Rate * 1e6 }
	relay := d.CPUSeconds / d.Seconds
	zero := d.Rate * d.MachineCores / (d.MachineCores - relay)
	line := fmt.Sprintf("  CPU per event (µs): walsender %.1f, NATS server+bench %.1f, relay %.1f, other %.1f; a relay costing nothing would reach ≤ %s/s on the same %.2f busy cores",
		us(d.WalsenderCPU), us(d.NATSCores), us(relay), us(d.MachineCores-d.WalsenderCPU-d.NATSCores-relay), num(zero), d.MachineCores)
	if b.RatioCeiling > 0 { // the ceiling: min(decode, broker)
		line += fmt.Sprintf(" (%.2f of the ceiling)", zero/(d.Rate/b.RatioCeiling))
	}
	return line
}

// seqList prints stream sequences, at most eight.
func seqList(seqs []int) string {
	if len(seqs) > 8 {
		return strings.Trim(fmt.Sprint(seqs[:8]), "[]") + fmt.Sprintf(" (+%d)", len(seqs)-8)
	}
	return strings.Trim(fmt.Sprint(seqs), "[]")
}

func num(v float64) string {
	s := fmt.Sprintf("%.0f", v)
	var b strings.Builder
	for i, c := range s {
		if i > 0 && (len(s)-i)%3 == 0 && s[0] != '-' {
			b.WriteByte(',')
		}
		b.WriteRune(c)
	}
	return b.String()
}

func f1(v float64) string { return fmt.Sprintf("%.1f", v) }
func f2(v float64) string { return fmt.Sprintf("%.2f", v) }
func f3(v float64) string { return fmt.Sprintf("%.3f", v) }
