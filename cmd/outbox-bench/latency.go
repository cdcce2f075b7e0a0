package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"path/filepath"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/contract"
)

// quantiles are latency percentiles in milliseconds.
type quantiles struct {
	P50  float64 `json:"p50_ms"`
	P99  float64 `json:"p99_ms"`
	P999 float64 `json:"p999_ms"`
	Max  float64 `json:"max_ms"`
	N    int     `json:"samples"`
}

func quantilesOf(d []time.Duration) quantiles {
	slices.Sort(d)
	q := quantiles{N: len(d), P50: ms(percentile(d, 0.50)), P99: ms(percentile(d, 0.99)), P999: ms(percentile(d, 0.999))}
	if len(d) > 0 {
		q.Max = ms(d[len(d)-1])
	}
	return q
}

// latencyResult is one steady offered load.
type latencyResult struct {
	Offered  int     `json:"offered_per_sec"`
	Achieved float64 `json:"achieved_per_sec"`
	Events   int     `json:"events"`
	Writers  int     `json:"writers"`
	// CommitToAck runs from the transaction's commit timestamp (pgoutput's
	// Begin/Commit, carried in the Outbox-Commit-Time header) to the time
	// JetStream stored the message (its stream timestamp; the ack leaves
	// right after). Both clocks are this machine's.
	CommitToAck quantiles `json:"commit_to_ack"`
	// InsertToDelivery runs from the writer's clock just before it sent
	// the INSERT (in the payload) to the consumer's receipt.
	InsertToDelivery quantiles `json:"insert_to_delivery"`
	// WriterLate is how far behind schedule the writers sent (load
	// generator health: large values mean the offered load was not met).
	WriterLate quantiles `json:"writer_late"`
	// Stalls are the stream sequences at which commit→ack jumped over
	// 10 ms after values under 3 ms: compare with the JetStream-alone
	// run's.
	Stalls     []int   `json:"stall_seqs,omitempty"`
	RelayCores float64 `json:"relay_cores"`
	// PostgresCores is the cluster's CPU (backends, walsender, WAL
	// writer); BenchCores this process's: the embedded NATS server, the
	// writers and the consumer. MachineCores minus the three is what other
	// processes took.
	PostgresCores float64 `json:"postgres_cores"`
	BenchCores    float64 `json:"bench_cores"`
	CPUPer100k    float64 `json:"relay_cpu_s_per_100k"`
	PeakRSSMB     float64 `json:"relay_peak_rss_mb"`
	MachineCores  float64 `json:"machine_cores"`
}

// latencyRun offers rate events/s in 1-row transactions from a writer pool
// for warmup+dur, with the relay streaming and a JetStream consumer reading.
// Samples from the warm-up are dropped.
func latencyRun(ctx context.Context, o *options, env *benchEnv, rate int, warmup, dur time.Duration) (latencyResult, error) {
	res := latencyResult{Offered: rate}
	slot := "relay"
	db, err := env.newDB(ctx, slot)
	if err != nil {
		return res, err
	}
	defer db.drop()
	r, err := startRelay(o, env, db, slot, o.profileDir != "")
	if err != nil {
		return res, err
	}
	stopped := false
	defer func() {
		if !stopped {
			_, _ = r.stop(env)
		}
	}()
	stream, err := waitStreaming(ctx, env, db, r, slot)
	if err != nil {
		return res, err
	}

	total := int(float64(rate) * (warmup + dur).Seconds())
	t0 := time.Now().Add(50 * time.Millisecond)
	measureFrom := t0.Add(warmup)

	var (
		mu         sync.Mutex
		commitAck  = make([]time.Duration, 0, total)
		bySeq      = make(map[int]time.Duration, total)
		insDeliver = make([]time.Duration, 0, total)
		received   atomic.Int64
		consumeErr atomic.Value
	)
	cons, err := stream.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{})
	if err != nil {
		return res, err
	}
	cc, err := cons.Consume(func(m jetstream.Msg) {
		now := time.Now()
		var p struct {
			Ins int64 `json:"ins"`
		}
		md, err := m.Metadata()
		if err == nil {
			err = json.Unmarshal(m.Data(), &p)
		}
		var commit time.Time
		if err == nil {
			commit, err = time.Parse(time.RFC3339Nano, m.Headers().Get(contract.CommitTime))
		}
		if err != nil {
			consumeErr.Store(err)
			return
		}
		ins := time.Unix(0, p.Ins)
		if !ins.Before(measureFrom) {
			mu.Lock()
			commitAck = append(commitAck, md.Timestamp.Sub(commit))
			bySeq[int(md.Sequence.Stream)] = md.Timestamp.Sub(commit)
			insDeliver = append(insDeliver, now.Sub(ins))
			mu.Unlock()
		}
		received.Add(1)
	})
	if err != nil {
		return res, err
	}
	defer cc.Stop()

	writers := writerCount(rate)
	res.Writers = writers
	pm := db.postmasterPID(ctx)
	cpu0, _ := procCPU(r.pid())
	m0, pg0, b0 := readMachineCPU(), treeCPU(pm), selfCPU()
	load := offerLoad(ctx, db, rate, total, t0)
	profErr := make(chan error, 1)
	if o.profileDir != "" {
		go func() {
			// Profile the sampled part of the run.
			select {
			case <-time.After(time.Until(measureFrom)):
			case <-ctx.Done():
			}
			profErr <- r.profile(ctx, max(1, int(dur.Seconds())), filepath.Join(o.profileDir, fmt.Sprintf("relay-latency-%d.pprof", rate)))
		}()
	} else {
		profErr <- nil
	}
	late, err := load.wait()
	if err != nil {
		return res, err
	}
	res.Achieved = float64(total) / time.Since(t0).Seconds()
	deadline := time.Now().Add(60 * time.Second)
	for received.Load() < int64(total) {
		if e := consumeErr.Load(); e != nil {
			return res, fmt.Errorf("consumer: %v", e)
		}
		if err := r.exited(); err != nil {
			return res, err
		}
		if time.Now().After(deadline) {
			return res, fmt.Errorf("consumer got %d of %d events within 60s", received.Load(), total)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err := <-profErr; err != nil {
		return res, fmt.Errorf("profile: %w", err)
	}
	el := time.Since(t0)
	cpu1, _ := procCPU(r.pid())
	res.MachineCores = busyCores(m0, readMachineCPU())
	res.PostgresCores = (treeCPU(pm) - pg0).Seconds() / el.Seconds()
	res.BenchCores = (selfCPU() - b0).Seconds() / el.Seconds()
	res.Events = total
	res.RelayCores = (cpu1 - cpu0).Seconds() / el.Seconds()
	res.CPUPer100k = (cpu1 - cpu0).Seconds() / float64(total) * 100000
	cc.Stop()
	stopped = true
	rss, err := r.stop(env)
	if err != nil {
		return res, err
	}
	res.PeakRSSMB = float64(rss) / (1 << 20)
	mu.Lock()
	res.CommitToAck = quantilesOf(commitAck)
	res.Stalls = stalls(bySeq)
	res.InsertToDelivery = quantilesOf(insDeliver)
	mu.Unlock()
	res.WriterLate = quantilesOf(late)
	return res, nil
}

// stalls returns the sequences, in order, at which a latency jumped over
// 10 ms after latencies under 3 ms.
func stalls(bySeq map[int]time.Duration) []int {
	seqs := slices.Sorted(maps.Keys(bySeq))
	var out []int
	stalled := false
	for _, s := range seqs {
		switch l := bySeq[s]; {
		case l > 10*time.Millisecond && !stalled:
			out = append(out, s)
			stalled = true
		case l < 3*time.Millisecond:
			stalled = false
		}
	}
	return out
}

// writerCount is the size of the writer pool for an offered load.
func writerCount(rate int) int { return max(4, min(16, rate/400)) }

// loadRun is a writer pool offering a steady load.
type loadRun struct {
	errs chan error
	late [][]time.Duration
}

// offerLoad starts writers that insert total events at rate per second from
// t0, one row per transaction: event i is due at t0 + i/rate; each writer
// takes the next ticket, waits for its time and inserts its row.
func offerLoad(ctx context.Context, db *benchDB, rate, total int, t0 time.Time) *loadRun {
	writers := writerCount(rate)
	l := &loadRun{errs: make(chan error, writers), late: make([][]time.Duration, writers)}
	sched := newSchedule(rate, total, t0)
	for w := range writers {
		go func() {
			conn, err := db.pool.Acquire(ctx)
			if err != nil {
				l.errs <- err
				return
			}
			defer conn.Release()
			for {
				i, due, ok := sched.next()
				if !ok {
					l.errs <- nil
					return
				}
				now := time.Now()
				l.late[w] = append(l.late[w], now.Sub(due))
				if err := insertEvent(ctx, conn, latencyEvent(i, now)); err != nil {
					l.errs <- err
					return
				}
			}
		}()
	}
	return l
}

// schedule hands out the events of an offered load: event i is due at
// t0 + i/rate.
type schedule struct {
	ticket atomic.Int64
	total  int64
	t0     time.Time
	period time.Duration
}

func newSchedule(rate, total int, t0 time.Time) *schedule {
	return &schedule{total: int64(total), t0: t0, period: time.Second / time.Duration(rate)}
}

// next takes the next event, waits until it is due and returns it with
// when it was due; ok is false when every event is taken.
func (s *schedule) next() (i int64, due time.Time, ok bool) {
	i = s.ticket.Add(1) - 1
	if i >= s.total {
		return 0, time.Time{}, false
	}
	due = s.t0.Add(time.Duration(i) * s.period)
	if d := time.Until(due); d > 0 {
		time.Sleep(d)
	}
	return i, due, true
}

// insertedAt is the insert time (Unix ns) a latencyEvent's payload carries.
// Its fast path reads the payload's leading "ins" member, as the writer
// wrote it and as jsonb gives it back (shortest keys first): the measuring
// hook runs in the measured consumer's process, and decoding the whole
// payload with encoding/json there was ~3% of that process's CPU at
// 2,000 events/s, charged to the library. Any other payload is decoded.
func insertedAt(payload []byte) (int64, bool) {
	const prefix = `{"ins": `
	if rest, ok := bytes.CutPrefix(payload, []byte(prefix)); ok {
		n := 0
		for n < len(rest) && rest[n] >= '0' && rest[n] <= '9' {
			n++
		}
		if n > 0 && n < len(rest) && (rest[n] == ',' || rest[n] == '}') {
			if v, err := strconv.ParseInt(string(rest[:n]), 10, 64); err == nil {
				return v, v != 0
			}
		}
	}
	var p struct {
		Ins int64 `json:"ins"`
	}
	if json.Unmarshal(payload, &p) != nil {
		return 0, false
	}
	return p.Ins, p.Ins != 0
}

// latencyEvent is event i of an offered load, written at now: its payload
// carries now, from which the consumer side measures insert→applied.
func latencyEvent(i int64, now time.Time) contract.Event {
	return contract.Event{ID: uuid.NewString(), Type: "OrderPlaced", AggregateType: "order",
		AggregateID: fmt.Sprintf("agg-%d", i%1000), AggregateVersion: i/1000 + 1,
		Payload: fmt.Appendf(nil, `{"ins": %d, "seq": %d, "note": "%s", "customer": "customer-%d"}`, now.UnixNano(), i, padding(180), i%1000)}
}

// insertEvent writes ev to the outbox in a transaction of its own.
func insertEvent(ctx context.Context, conn *pgxpool.Conn, ev contract.Event) error {
	_, err := conn.Exec(ctx, `INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_version, event_type, payload) VALUES ($1, $2, $3, $4, $5, $6)`,
		ev.ID, ev.AggregateType, ev.AggregateID, ev.AggregateVersion, ev.Type, ev.Payload)
	return err
}

// wait waits for every writer and returns how late each insert was sent.
func (l *loadRun) wait() ([]time.Duration, error) {
	var first error
	for range l.late {
		if err := <-l.errs; err != nil && first == nil {
			first = fmt.Errorf("writer: %w", err)
		}
	}
	var all []time.Duration
	for _, d := range l.late {
		all = append(all, d...)
	}
	return all, first
}

// floorResult is PostgreSQL's share of the latency: the bare reader's
// commit→receive at the same offered load, with no relay and no NATS.
type floorResult struct {
	Offered int `json:"offered_per_sec"`
	// CommitToReceive runs from the commit timestamp in pgoutput's Commit
	// message to the bare reader's receipt of that message.
	CommitToReceive quantiles `json:"commit_to_receive"`
	PostgresCores   float64   `json:"postgres_cores"`
	MachineCores    float64   `json:"machine_cores"`
}

// startLatencyReader starts the bare reader in a child process timing
// commit→receive of total events on slot (the first skip not timed), and
// returns once the server streams to it.
func startLatencyReader(ctx context.Context, db *benchDB, slot string, total, skip int) (*readerProc, error) {
	p, err := startReader(ctx, db, slot, int64(total), "-latency", "-latency-skip", fmt.Sprint(skip))
	if err != nil {
		return nil, err
	}
	deadline := time.Now().Add(30 * time.Second)
	for db.walsenderPID(ctx, slot) == 0 {
		select {
		case err := <-p.done:
			return nil, fmt.Errorf("decode reader exited before streaming: %v", err)
		default:
		}
		if time.Now().After(deadline) {
			p.kill()
			return nil, errors.New("decode reader not streaming after 30s")
		}
		time.Sleep(20 * time.Millisecond)
	}
	return p, nil
}

// latencyReport waits for a latency reader's report once every event was
// committed: it has them within seconds, or is killed after a minute.
func (p *readerProc) latencyReport() (readerReport, error) {
	var late atomic.Bool
	timer := time.AfterFunc(60*time.Second, func() { late.Store(true); _ = p.cmd.Process.Kill() })
	rep, err := p.report()
	timer.Stop()
	if late.Load() {
		return rep, errors.New("decode reader did not see every event within 60s of the load")
	}
	return rep, err
}

// floorRun offers the same load as latencyRun to the bare reader in a child
// process: what a consumer that does nothing with the changes sees.
func floorRun(ctx context.Context, env *benchEnv, rate int, warmup, dur time.Duration) (floorResult, error) {
	res := floorResult{Offered: rate}
	slot := "floor"
	db, err := env.newDB(ctx, slot)
	if err != nil {
		return res, err
	}
	defer db.drop()
	total := int(float64(rate) * (warmup + dur).Seconds())
	// The warm-up's transactions are counted off, not timed off: the
	// schedule starts only once the reader streams.
	p, err := startLatencyReader(ctx, db, slot, total, int(float64(rate)*warmup.Seconds()))
	if err != nil {
		return res, err
	}
	t0 := time.Now().Add(50 * time.Millisecond)
	pm := db.postmasterPID(ctx)
	m0, pg0 := readMachineCPU(), treeCPU(pm)
	if _, err := offerLoad(ctx, db, rate, total, t0).wait(); err != nil {
		p.kill()
		return res, err
	}
	rep, err := p.latencyReport()
	if err != nil {
		return res, err
	}
	el := time.Since(t0)
	res.MachineCores = busyCores(m0, readMachineCPU())
	res.PostgresCores = (treeCPU(pm) - pg0).Seconds() / el.Seconds()
	res.CommitToReceive = rep.CommitToReceive
	return res, nil
}
