package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime/pprof"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/outbox-relay/outbox-relay/consumer"
	"github.com/outbox-relay/outbox-relay/contract"
)

// The consumer phases measure the consumer library against what the same
// SQL costs without it, on PostgreSQL at durable settings: a consumer's
// figures are bounded by its database's commits, which fsync decides.

// durableSettings are switched on (ALTER SYSTEM, reload) for the consumer
// and end-to-end phases and reset afterwards.
var durableSettings = []string{"fsync", "synchronous_commit", "full_page_writes"}

// consumerPhase is the JSON of the consumer and end-to-end phases.
type consumerPhase struct {
	PGSettings map[string]string `json:"postgresql_settings"`
	Events     int               `json:"events"`
	Aggregates int               `json:"aggregates"`
	Workers    int               `json:"workers"`
	BatchSize  int               `json:"batch_size"`
	// Ceilings are bare pgx loops running the consumer's SQL (dedup insert
	// + the handler's insert) at the same batch size and concurrency.
	Ceilings []consumerFigure `json:"apply_ceilings,omitempty"`
	// Runs are the library draining a backlog already in a stream.
	Runs []consumerFigure `json:"consumer_runs,omitempty"`
	// GroupRuns drain a partitioned copy of the backlog with 1 and with
	// several member processes of one consumer group.
	GroupRuns       []consumerFigure `json:"group_runs,omitempty"`
	GroupPartitions int              `json:"group_partitions,omitempty"`
	E2E             *e2eResult       `json:"end_to_end,omitempty"`
}

// consumerFigure is one apply ceiling or one consumer run.
type consumerFigure struct {
	Name      string `json:"name"`
	Handler   string `json:"handler"` // per-message or batch
	BatchSize int    `json:"batch_size"`
	Processes int    `json:"processes,omitempty"`
	Workers   int    `json:"workers_per_process,omitempty"` // group runs
	// Plain: a member process consuming a plain durable, not a group (the
	// group runs' control).
	Plain   bool    `json:"plain_durable,omitempty"`
	Events  int     `json:"events"`
	Seconds float64 `json:"seconds"`
	Rate    float64 `json:"events_per_sec"`
	// Ceiling is the rate of the apply ceiling with the same SQL and batch
	// size; Ratio the run's rate over it.
	Ceiling       float64 `json:"ceiling_per_sec,omitempty"`
	Ratio         float64 `json:"to_ceiling,omitempty"`
	PostgresCores float64 `json:"postgres_cores"`
	BenchCores    float64 `json:"bench_cores"`
	// MemberCores is the member processes' CPU in a group run (BenchCores
	// is then the bench process alone: mostly the NATS server it hosts).
	MemberCores float64 `json:"member_cores,omitempty"`
	// BenchMicrosPerEvent is the bench process's CPU per event in a group
	// run, from the members' start to the last commit: the NATS server's
	// cost of delivering the events and taking their acks.
	BenchMicrosPerEvent float64 `json:"bench_us_per_event,omitempty"`
	MachineCores        float64 `json:"machine_cores"`
	// MeanBatch is the messages per batch transaction the consumer made
	// (its batch size histogram; single-consumer runs only).
	MeanBatch float64 `json:"mean_batch,omitempty"`
}

// e2eResult is outbox INSERT → relay → JetStream → consumer commit.
type e2eResult struct {
	// Sustained: Events rows written as fast as the loader can (100 rows
	// per transaction) while the relay and the consumer run; the rate is
	// from the first INSERT to the last consumer commit.
	Events        int     `json:"events"`
	Seconds       float64 `json:"seconds"`
	SustainedRate float64 `json:"sustained_per_sec"`
	MachineCores  float64 `json:"machine_cores"`
	// LoadRate is how fast the loader writes the same rows with the machine
	// to itself (no slot, relay or consumer): the pipeline's first stage.
	LoadRate float64 `json:"load_alone_per_sec"`
	// Latency at steady offered loads, one message per transaction and
	// batched.
	Latency []e2eLatency `json:"latency"`
	// Floor is what PostgreSQL alone gives at the same offered loads.
	Floor []e2eFloor `json:"floor"`
}

// e2eFloor is the latency floor of the end-to-end path on this machine:
// each event's two durable commits, the writer's INSERT and then the
// consumer's transaction (its dedup insert and the handler's insert) on
// another connection, back to back at the offered load, with no relay and
// no NATS between them; and a bare reader decoding the outbox meanwhile.
type e2eFloor struct {
	Offered         int       `json:"offered_per_sec"`
	InsertToApplied quantiles `json:"insert_to_applied"`
	// CommitToReceive is a bare logical-replication reader's (no relay)
	// commit→receive of the same outbox rows meanwhile: the walsender's
	// part under this load.
	CommitToReceive quantiles `json:"walsender_commit_to_receive"`
	MachineCores    float64   `json:"machine_cores"`
	PostgresCores   float64   `json:"postgres_cores"`
	BenchCores      float64   `json:"bench_cores"`
}

// e2eLatency is one steady offered load (1-row transactions) through the
// pipeline.
type e2eLatency struct {
	Offered   int     `json:"offered_per_sec"`
	BatchSize int     `json:"batch_size"`
	Events    int     `json:"events"` // warm-up included
	Achieved  float64 `json:"achieved_per_sec"`
	// InsertToApplied runs from the writer's clock before the INSERT (in
	// the payload) to the consumer's commit; CommitToApplied from the
	// outbox transaction's commit (Outbox-Commit-Time) to it, the part
	// after PostgreSQL.
	InsertToApplied quantiles `json:"insert_to_applied"`
	CommitToApplied quantiles `json:"commit_to_applied"`
	// CommitToHandler runs from the outbox commit to the handler's call in
	// the consumer's transaction (first attempt; redone batches count
	// again): relay, JetStream, delivery and the worker's queue, without
	// the consumer's own transaction.
	CommitToHandler quantiles `json:"commit_to_handler"`
	// CommitToStored and StoredToHandler split CommitToHandler at the
	// JetStream timestamp of the message: the relay's part (decode,
	// publish, store) and the consumer's (delivery and the worker's queue).
	CommitToStored  quantiles `json:"commit_to_stored"`
	StoredToHandler quantiles `json:"stored_to_handler"`
	MachineCores    float64   `json:"machine_cores"`
	// Batches and BatchedMessages count the consumer's batch transactions
	// and the messages in them (outbox_consumer_batch_size); the other
	// messages went alone.
	Batches         uint64  `json:"batches"`
	BatchedMessages float64 `json:"batched_messages"`
	// The pipeline's own share of MachineCores: the cluster's processes,
	// the relay, and this process (NATS server, writers, consumer).
	PostgresCores float64 `json:"postgres_cores"`
	RelayCores    float64 `json:"relay_cores"`
	BenchCores    float64 `json:"bench_cores"`
}

// consumerSpec is one consumer configuration to measure.
type consumerSpec struct {
	name      string
	batch     bool // a BatchHandler: one statement per batch
	batchSize int
	processes int // group member processes; 0: one consumer in the bench process
	workers   int // a group member's workers; 0: --consumer-workers
	// plain: the member processes consume one plain durable, not a group's
	// partitions (the control that group overhead is measured against).
	plain bool
}

func (s consumerSpec) handler() string {
	if s.batch {
		return "batch"
	}
	return "per-message"
}

// effectTable is what the handlers write: one row per event.
const effectTable = `CREATE TABLE bench_effect (
	id bigserial PRIMARY KEY, event_id text NOT NULL, aggregate_id text NOT NULL,
	version bigint NOT NULL, payload_bytes int NOT NULL)`

const (
	insertEffect      = `INSERT INTO bench_effect (event_id, aggregate_id, version, payload_bytes) VALUES ($1, $2, $3, $4)`
	insertEffectBatch = `INSERT INTO bench_effect (event_id, aggregate_id, version, payload_bytes)
		SELECT * FROM unnest($1::text[], $2::text[], $3::bigint[], $4::int[])`
)

// benchHandler is the consumer's handler: one row per event, or one
// statement per batch.
type benchHandler struct{}

func (benchHandler) Handle(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
	_, err := tx.Exec(ctx, insertEffect, m.ID, m.AggregateID, m.AggregateVersion, len(m.Payload))
	return err
}

// timedHandler is benchHandler calling started first: when the consumer's
// transaction for a message reaches its handler.
type timedHandler struct {
	benchHandler
	started func(*consumer.Message)
}

func (h timedHandler) Handle(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
	h.started(m)
	return h.benchHandler.Handle(ctx, tx, m)
}

type benchBatchHandler struct{ benchHandler }

func (benchBatchHandler) HandleBatch(ctx context.Context, tx pgx.Tx, ms []*consumer.Message) error {
	return execEffects(ctx, tx, ms, func(m *consumer.Message) *contract.Event { return &m.Event })
}

// execEffects inserts the effect rows of evs in one statement.
func execEffects[T any](ctx context.Context, tx pgx.Tx, evs []T, ev func(T) *contract.Event) error {
	ids, aggs, versions, sizes := make([]string, len(evs)), make([]string, len(evs)), make([]int64, len(evs)), make([]int32, len(evs))
	for i, x := range evs {
		e := ev(x)
		ids[i], aggs[i], versions[i], sizes[i] = e.ID, e.AggregateID, e.AggregateVersion, int32(len(e.Payload))
	}
	_, err := tx.Exec(ctx, insertEffectBatch, ids, aggs, versions, sizes)
	return err
}

// durableOn switches the server to durable commits and returns what resets
// it. fsync and full_page_writes take effect on reload.
func durableOn(ctx context.Context, env *benchEnv) (map[string]string, func(), error) {
	conn, err := pgx.Connect(ctx, env.adminURL)
	if err != nil {
		return nil, nil, err
	}
	defer conn.Close(ctx)
	for _, s := range durableSettings {
		if _, err := conn.Exec(ctx, "ALTER SYSTEM SET "+s+" = on"); err != nil {
			return nil, nil, fmt.Errorf("ALTER SYSTEM SET %s = on (the consumer phases need a superuser): %w", s, err)
		}
	}
	if _, err := conn.Exec(ctx, "SELECT pg_reload_conf()"); err != nil {
		return nil, nil, err
	}
	reset := func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		conn, err := pgx.Connect(ctx, env.adminURL)
		if err != nil {
			return
		}
		defer conn.Close(ctx)
		for _, s := range durableSettings {
			_, _ = conn.Exec(ctx, "ALTER SYSTEM RESET "+s)
		}
		_, _ = conn.Exec(ctx, "SELECT pg_reload_conf()")
	}
	// The reload reaches new backends at once; check from one.
	settings := map[string]string{}
	for range 50 {
		c2, err := pgx.Connect(ctx, env.adminURL)
		if err != nil {
			reset()
			return nil, nil, err
		}
		on := true
		for _, s := range durableSettings {
			var v string
			_ = c2.QueryRow(ctx, "SELECT current_setting($1)", s).Scan(&v)
			settings[s] = v
			on = on && v == "on"
		}
		c2.Close(ctx)
		if on {
			return settings, reset, nil
		}
		time.Sleep(100 * time.Millisecond)
	}
	reset()
	return nil, nil, fmt.Errorf("durable settings not in effect after reload: %v", settings)
}

// consumerDB is a fresh database with the consumer's tables and the
// handler's.
func consumerDB(ctx context.Context, env *benchEnv, slots ...string) (*benchDB, error) {
	db, err := env.newDB(ctx, slots...)
	if err != nil {
		return nil, err
	}
	schema, err := os.ReadFile(filepath.Join(env.repo, "sql", "consumer.sql"))
	if err == nil {
		_, err = db.pool.Exec(ctx, string(schema))
	}
	if err == nil {
		_, err = db.pool.Exec(ctx, effectTable)
	}
	if err != nil {
		db.drop()
		return nil, fmt.Errorf("consumer schema: %w", err)
	}
	return db, nil
}

// backlogStream publishes events routed exactly as the relay routes bench
// rows to a fresh stream and returns the stream, its events parsed as a
// consumer parses them, and what deletes the stream.
func backlogStream(ctx context.Context, env *benchEnv, events, aggs, pad int) (string, []contract.Event, func(), error) {
	prefix, drop, err := freshStream(ctx, env, "consumer")
	if err != nil {
		return "", nil, nil, err
	}
	evs := make([]contract.Event, 0, events)
	err = publishRouted(ctx, env, prefix, events, aggs, pad, func(m *nats.Msg) error {
		ev, err := contract.Parse(m.Header, m.Data)
		evs = append(evs, ev)
		return err
	})
	if err != nil {
		drop()
		return "", nil, nil, err
	}
	return strings.ToUpper(prefix), evs, drop, nil
}

// publishRouted publishes events bench rows routed under prefix, in
// chunks, each acknowledged before the next; each (when not nil) sees
// every message before it is published.
func publishRouted(ctx context.Context, env *benchEnv, prefix string, events, aggs, pad int, each func(*nats.Msg) error) error {
	const chunk = 10000
	for first := 0; first < events; first += chunk {
		msgs, _, err := routedMessages(prefix, int64(first), min(chunk, events-first), aggs, pad)
		if err != nil {
			return err
		}
		for _, m := range msgs {
			if each != nil {
				if err := each(m); err != nil {
					return err
				}
			}
			if err := publishStalling(ctx, env, m); err != nil {
				return err
			}
		}
		select {
		case <-env.js.PublishAsyncComplete():
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(time.Minute):
			return errors.New("backlog publish not acknowledged within a minute")
		}
	}
	return nil
}

// publishStalling publishes m asynchronously; when too many publishes are
// outstanding (a loaded machine's broker falls behind), it waits for them
// and tries again instead of failing the run.
func publishStalling(ctx context.Context, env *benchEnv, m *nats.Msg) error {
	for {
		_, err := env.js.PublishMsgAsync(m)
		if !errors.Is(err, jetstream.ErrTooManyStalledMsgs) {
			return err
		}
		select {
		case <-env.js.PublishAsyncComplete():
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// startProfile starts a CPU profile of this process into path; stop ends
// it and closes the file.
func startProfile(path string) (stop func(), err error) {
	f, err := os.Create(path)
	if err != nil {
		return nil, err
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		f.Close()
		return nil, err
	}
	return func() { pprof.StopCPUProfile(); f.Close() }, nil
}

// consumerPhases runs the apply ceilings and the consumer runs (phase
// "consumer") and the end-to-end runs (phase "e2e").
func consumerPhases(ctx context.Context, o *options, env *benchEnv, res *results) error {
	settings, reset, err := durableOn(ctx, env)
	if err != nil {
		return err
	}
	defer reset()
	p := &consumerPhase{PGSettings: settings, Events: int(o.events), Aggregates: o.aggs, Workers: o.consumerWorkers, BatchSize: o.consumerBatch}
	res.Consumer = p
	if o.phases["consumer"] {
		logf("consumer: %d events over %d aggregates into a stream", o.events, o.aggs)
		stream, evs, drop, err := backlogStream(ctx, env, int(o.events), o.aggs, o.pad)
		if err != nil {
			return fmt.Errorf("backlog stream: %w", err)
		}
		defer drop()
		specs := map[string]consumerSpec{
			"single":  {name: "per-message handler, 1 message/tx", batchSize: 1},
			"batched": {name: "per-message handler, batched", batchSize: o.consumerBatch},
			"batch":   {name: "batch handler", batch: true, batchSize: o.consumerBatch},
		}
		var runSpecs []consumerSpec
		for _, key := range o.consumerRuns {
			s, ok := specs[key]
			if !ok {
				return fmt.Errorf("--consumer-runs: %q is not one of single, batched, batch", key)
			}
			logf("apply ceiling: bare pgx loop, %s handler, %d per transaction, %d connections", s.handler(), s.batchSize, o.consumerWorkers)
			c, err := applyCeiling(ctx, env, evs, s, o.consumerWorkers)
			if err != nil {
				return fmt.Errorf("apply ceiling: %w", err)
			}
			p.Ceilings = append(p.Ceilings, c)
			logf("consumer: %s (batch size %d, %d workers)", s.name, s.batchSize, o.consumerWorkers)
			prof := ""
			if o.profileDir != "" {
				prof = filepath.Join(o.profileDir, fmt.Sprintf("bench-consumer-%s-%d.pprof", s.handler(), s.batchSize))
			}
			r, err := consumerRun(ctx, env, stream, len(evs), s, o.consumerWorkers, o.consumerPending, prof)
			if err != nil {
				return fmt.Errorf("consumer %s: %w", s.name, err)
			}
			r.Ceiling, r.Ratio = c.Rate, ratio(r.Rate, c.Rate)
			p.Runs = append(p.Runs, r)
			runSpecs = append(runSpecs, s)
		}
		if o.groupProcesses > 1 {
			if err := groupPhase(ctx, o, env, p, runSpecs); err != nil {
				return err
			}
		}
	}
	if o.phases["e2e"] {
		e, err := e2eRun(ctx, o, env)
		if err != nil {
			return fmt.Errorf("end to end: %w", err)
		}
		p.E2E = e
	}
	return nil
}

// applyCeiling runs the consumer's SQL for evs without the library and
// without NATS: workers connections, each committing transactions of
// s.batchSize events (the dedup insert for all of them, then the handler's
// insert per event or once).
func applyCeiling(ctx context.Context, env *benchEnv, evs []contract.Event, s consumerSpec, workers int) (consumerFigure, error) {
	f := consumerFigure{Name: "apply ceiling, " + s.name, Handler: s.handler(), BatchSize: s.batchSize, Events: len(evs)}
	db, err := consumerDB(ctx, env)
	if err != nil {
		return f, err
	}
	defer db.drop()
	hashes := make([][]byte, len(evs))
	for i := range evs {
		hashes[i] = consumer.ContentHash(&evs[i])
	}
	// Workers take the events in interleaved batches, as a consumer's
	// workers take aggregates.
	var next atomic.Int64
	errs := make(chan error, workers)
	pm := db.postmasterPID(ctx)
	m0, pg0, b0 := readMachineCPU(), treeCPU(pm), selfCPU()
	start := time.Now()
	for range workers {
		go func() {
			conn, err := db.pool.Acquire(ctx)
			if err != nil {
				errs <- err
				return
			}
			defer conn.Release()
			for {
				lo := int(next.Add(int64(s.batchSize))) - s.batchSize
				if lo >= len(evs) {
					errs <- nil
					return
				}
				hi := min(lo+s.batchSize, len(evs))
				if err := ceilingTx(ctx, conn.Conn(), evs[lo:hi], hashes[lo:hi], s); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	for range workers {
		err = errors.Join(err, <-errs)
	}
	el := time.Since(start)
	f.Seconds, f.Rate = el.Seconds(), float64(len(evs))/el.Seconds()
	f.MachineCores = busyCores(m0, readMachineCPU())
	f.PostgresCores = (treeCPU(pm) - pg0).Seconds() / el.Seconds()
	f.BenchCores = (selfCPU() - b0).Seconds() / el.Seconds()
	return f, err
}

// The consumer's dedup statements, as package consumer runs them.
const (
	ceilingDedup = `INSERT INTO consumed_message (consumer, event_id, content_hash, event_type, aggregate_type,
		aggregate_id, aggregate_version, outcome, reason)
	VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)
	ON CONFLICT (consumer, event_id) DO NOTHING`
	ceilingDedupBatch = `INSERT INTO consumed_message (consumer, event_id, content_hash, event_type, aggregate_type,
		aggregate_id, aggregate_version, outcome, reason)
	SELECT $1, u.*, 'applied', NULL FROM unnest($2::text[], $3::bytea[], $4::text[], $5::text[], $6::text[], $7::bigint[]) AS u
	ON CONFLICT (consumer, event_id) DO NOTHING
	RETURNING event_id`
)

// ceilingTx applies evs in one transaction with the library's statements
// and round trips: BEGIN and the dedup statement together (a batch begun
// with pgx.Batch.BeginTx, as package consumer sends them), the effects,
// COMMIT.
func ceilingTx(ctx context.Context, conn *pgx.Conn, evs []contract.Event, hashes [][]byte, s consumerSpec) error {
	b := &pgx.Batch{}
	b.BeginTx(pgx.TxOptions{})
	if len(evs) == 1 {
		e := &evs[0]
		b.Queue(ceilingDedup, "ceiling", e.ID, hashes[0], e.Type, e.AggregateType, e.AggregateID, e.AggregateVersion, "applied", nil)
	} else {
		n := len(evs)
		ids, types, aggTypes, aggIDs := make([]string, n), make([]string, n), make([]string, n), make([]string, n)
		versions := make([]int64, n)
		for i := range evs {
			e := &evs[i]
			ids[i], types[i], aggTypes[i], aggIDs[i], versions[i] = e.ID, e.Type, e.AggregateType, e.AggregateID, e.AggregateVersion
		}
		b.Queue(ceilingDedupBatch, "ceiling", ids, hashes, types, aggTypes, aggIDs, versions)
	}
	br := conn.SendBatch(ctx, b)
	tx := br.Tx()
	defer func() { _ = tx.Rollback(ctx) }()
	_, err := br.Exec() // BEGIN
	if err == nil {
		var rows pgx.Rows
		if rows, err = br.Query(); err == nil {
			for rows.Next() {
			}
			err = rows.Err()
		}
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return err
	}
	if s.batch {
		err = execEffects(ctx, tx, evs, func(e contract.Event) *contract.Event { return &e })
	} else {
		for i := range evs {
			e := &evs[i]
			if _, err = tx.Exec(ctx, insertEffect, e.ID, e.AggregateID, e.AggregateVersion, len(e.Payload)); err != nil {
				break
			}
		}
	}
	if err != nil {
		return err
	}
	return tx.Commit(ctx)
}

// consumerRun drains the stream with the library into a fresh database
// and times it from the first commit to the last.
// With profile set, the bench process (the library and the embedded NATS
// server) is profiled meanwhile.
func consumerRun(ctx context.Context, env *benchEnv, stream string, events int, s consumerSpec, workers, pending int, profile string) (consumerFigure, error) {
	f := consumerFigure{Name: s.name, Handler: s.handler(), BatchSize: s.batchSize, Processes: s.processes, Events: events}
	db, err := consumerDB(ctx, env)
	if err != nil {
		return f, err
	}
	defer db.drop()
	var h consumer.Handler = benchHandler{}
	if s.batch {
		h = benchBatchHandler{}
	}
	name := "bench-" + fmt.Sprint(time.Now().UnixNano())
	clock := newApplyClock(events)
	reg := prometheus.NewRegistry()
	c, err := consumer.New(db.pool, env.js, consumer.Config{Name: name, Stream: stream, Workers: workers, BatchSize: s.batchSize, MaxAckPending: pending}, h,
		consumer.WithAfterCommit(func(*consumer.Message) { clock.applied() }), consumer.WithRegisterer(reg))
	if err != nil {
		return f, err
	}
	if profile != "" {
		stop, err := startProfile(profile)
		if err != nil {
			return f, err
		}
		defer stop()
	}
	pm := db.postmasterPID(ctx)
	m0, pg0, b0 := readMachineCPU(), treeCPU(pm), selfCPU()
	el, err := runUntil(ctx, c, clock, 5*time.Minute)
	if err != nil {
		return f, err
	}
	f.Seconds, f.Rate = el.Seconds(), float64(events)/el.Seconds()
	f.MachineCores = busyCores(m0, readMachineCPU())
	f.PostgresCores = (treeCPU(pm) - pg0).Seconds() / el.Seconds()
	f.BenchCores = (selfCPU() - b0).Seconds() / el.Seconds()
	if batches, msgs := batchStats(reg); batches > 0 {
		f.MeanBatch = msgs / float64(batches)
	}
	_ = env.js.DeleteConsumer(ctx, stream, name)
	return f, nil
}

// applyClock counts consumer commits and times the first and the last.
type applyClock struct {
	want        int64
	n           atomic.Int64
	first, last atomic.Int64 // unix ns
	done        chan struct{}
	once        sync.Once
}

func newApplyClock(want int) *applyClock {
	return &applyClock{want: int64(want), done: make(chan struct{})}
}

func (a *applyClock) applied() {
	n := a.n.Add(1)
	now := time.Now().UnixNano()
	if n == 1 {
		a.first.Store(now)
	}
	if n >= a.want {
		a.last.Store(now)
		a.once.Do(func() { close(a.done) })
	}
}

// runUntil runs c until the clock has counted every event, and returns the
// time from the first commit to the last.
func runUntil(ctx context.Context, c *consumer.Consumer, clock *applyClock, limit time.Duration) (time.Duration, error) {
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- c.Run(rctx) }()
	var err error
	select {
	case <-clock.done:
	case err = <-done:
		cancel()
		return 0, fmt.Errorf("consumer stopped: %w", err)
	case <-time.After(limit):
		err = fmt.Errorf("%d of %d events applied within %s", clock.n.Load(), clock.want, limit)
	case <-ctx.Done():
		err = ctx.Err()
	}
	cancel()
	if rerr := <-done; err == nil && rerr != nil {
		err = rerr
	}
	return time.Duration(clock.last.Load() - clock.first.Load()), err
}

// e2eRun measures the sustained rate of the whole pipeline and its
// insert→applied latency at each of o.e2eRates, with one message per
// transaction and batched, alternating o.e2eRepeat times (other work on a
// shared machine disturbs single runs).
func e2eRun(ctx context.Context, o *options, env *benchEnv) (*e2eResult, error) {
	res := &e2eResult{Events: int(o.events)}
	logf("end to end: loading %d events (100 rows/tx) alone", o.events)
	alone, err := consumerDB(ctx, env)
	if err != nil {
		return nil, err
	}
	loaded, err := alone.load(ctx, 0, o.events, 100, 2, o.aggs, o.pad)
	alone.drop()
	if err != nil {
		return nil, fmt.Errorf("load: %w", err)
	}
	res.LoadRate = float64(o.events) / loaded.Seconds()
	logf("end to end: %d events (100 rows/tx) through the relay into the consumer", o.events)
	err = withPipeline(ctx, o, env, int(o.events), o.consumerBatch, prometheus.NewRegistry(), nil, nil, func(db *benchDB, clock *applyClock, _ *relayProc) error {
		m0 := readMachineCPU()
		start := time.Now()
		if _, err := db.load(ctx, 0, o.events, 100, 2, o.aggs, o.pad); err != nil {
			return fmt.Errorf("load: %w", err)
		}
		if err := clock.wait(ctx, 5*time.Minute); err != nil {
			return err
		}
		el := time.Unix(0, clock.last.Load()).Sub(start)
		res.Seconds, res.SustainedRate = el.Seconds(), float64(o.events)/el.Seconds()
		res.MachineCores = busyCores(m0, readMachineCPU())
		return nil
	})
	if err != nil {
		return nil, err
	}
	for _, rate := range o.e2eRates {
		for i := range max(1, o.e2eRepeat) * 2 {
			batch := []int{1, o.consumerBatch}[i%2]
			logf("end to end: insert→applied at %d events/s, batch size %d, for %s (+%s warm-up)", rate, batch, o.dur, o.warmup)
			l, err := e2eLatencyRun(ctx, o, env, rate, batch)
			if err != nil {
				return nil, fmt.Errorf("latency at %d/s, batch size %d: %w", rate, batch, err)
			}
			res.Latency = append(res.Latency, l)
		}
		logf("end to end: latency floor at %d events/s, PostgreSQL alone, for %s (+%s warm-up)", rate, o.dur, o.warmup)
		f, err := e2eFloorRun(ctx, o, env, rate)
		if err != nil {
			return nil, fmt.Errorf("latency floor at %d/s: %w", rate, err)
		}
		res.Floor = append(res.Floor, f)
	}
	return res, nil
}

// e2eFloorRun measures e2eFloor: offerLoad's writers, each running the
// consumer's transaction for its event right after the INSERT commits.
func e2eFloorRun(ctx context.Context, o *options, env *benchEnv, rate int) (e2eFloor, error) {
	res := e2eFloor{Offered: rate}
	const slot = "e2efloor"
	db, err := consumerDB(ctx, env, slot)
	if err != nil {
		return res, err
	}
	defer db.drop()
	total := int(float64(rate) * (o.warmup + o.dur).Seconds())
	// The bare reader streams the outbox meanwhile: the walsender's
	// commit→receive under this load, without the relay.
	rd, err := startLatencyReader(ctx, db, slot, total, int(float64(rate)*o.warmup.Seconds()))
	if err != nil {
		return res, err
	}
	writers := writerCount(rate)
	var (
		mu   sync.Mutex
		lat  = make([]time.Duration, 0, total)
		errs = make(chan error, writers)
	)
	pm := db.postmasterPID(ctx)
	m0, pg0, b0 := readMachineCPU(), treeCPU(pm), selfCPU()
	start := time.Now()
	t0 := start.Add(50 * time.Millisecond)
	from := t0.Add(o.warmup)
	sched := newSchedule(rate, total, t0)
	spec := consumerSpec{batchSize: 1}
	for range writers {
		go func() {
			errs <- func() error {
				w, err := db.pool.Acquire(ctx)
				if err != nil {
					return err
				}
				defer w.Release()
				c, err := db.pool.Acquire(ctx)
				if err != nil {
					return err
				}
				defer c.Release()
				for {
					i, _, ok := sched.next()
					if !ok {
						return nil
					}
					now := time.Now()
					ev := latencyEvent(i, now)
					if err := insertEvent(ctx, w, ev); err != nil {
						return err
					}
					if err := ceilingTx(ctx, c.Conn(), []contract.Event{ev}, [][]byte{consumer.ContentHash(&ev)}, spec); err != nil {
						return err
					}
					if !now.Before(from) {
						d := time.Since(now)
						mu.Lock()
						lat = append(lat, d)
						mu.Unlock()
					}
				}
			}()
		}()
	}
	for range writers {
		err = errors.Join(err, <-errs)
	}
	if err != nil {
		rd.kill()
		return res, err
	}
	rep, err := rd.latencyReport()
	el := time.Since(start).Seconds()
	res.MachineCores = busyCores(m0, readMachineCPU())
	res.PostgresCores, res.BenchCores = (treeCPU(pm)-pg0).Seconds()/el, (selfCPU()-b0).Seconds()/el
	res.InsertToApplied = quantilesOf(lat)
	if err == nil {
		res.CommitToReceive = rep.CommitToReceive
	}
	return res, err
}

func e2eLatencyRun(ctx context.Context, o *options, env *benchEnv, rate, batch int) (e2eLatency, error) {
	total := int(float64(rate) * (o.warmup + o.dur).Seconds())
	res := e2eLatency{Offered: rate, BatchSize: batch, Events: total}
	var (
		mu           sync.Mutex
		ins2ap, c2ap = make([]time.Duration, 0, total), make([]time.Duration, 0, total)
		c2h          = make([]time.Duration, 0, total)
		c2s, s2h     = make([]time.Duration, 0, total), make([]time.Duration, 0, total)
		measureFrom  atomic.Int64 // unix ns; set when the load starts
	)
	onHandle := func(m *consumer.Message) {
		if from := measureFrom.Load(); from != 0 && !m.CommitTime.Before(time.Unix(0, from)) {
			now := time.Now()
			mu.Lock()
			c2h = append(c2h, now.Sub(m.CommitTime))
			c2s, s2h = append(c2s, m.Stored.Sub(m.CommitTime)), append(s2h, now.Sub(m.Stored))
			mu.Unlock()
		}
	}
	onApplied := func(m *consumer.Message) {
		now := time.Now()
		ins, ok := insertedAt(m.Payload)
		if !ok {
			return
		}
		if from := measureFrom.Load(); from != 0 && ins >= from {
			mu.Lock()
			ins2ap = append(ins2ap, now.Sub(time.Unix(0, ins)))
			c2ap = append(c2ap, now.Sub(m.CommitTime))
			mu.Unlock()
		}
	}
	reg := prometheus.NewRegistry()
	err := withPipeline(ctx, o, env, total, batch, reg, onHandle, onApplied, func(db *benchDB, clock *applyClock, r *relayProc) error {
		pm := db.postmasterPID(ctx)
		m0, pg0, b0 := readMachineCPU(), treeCPU(pm), selfCPU()
		r0, _ := procCPU(r.pid())
		start := time.Now()
		t0 := start.Add(50 * time.Millisecond)
		measureFrom.Store(t0.Add(o.warmup).UnixNano())
		load := offerLoad(ctx, db, rate, total, t0)
		if _, err := load.wait(); err != nil {
			return err
		}
		res.Achieved = float64(total) / time.Since(t0).Seconds()
		if err := clock.wait(ctx, time.Minute); err != nil {
			return err
		}
		el := time.Since(start).Seconds()
		r1, _ := procCPU(r.pid())
		res.MachineCores = busyCores(m0, readMachineCPU())
		res.PostgresCores, res.BenchCores = (treeCPU(pm)-pg0).Seconds()/el, (selfCPU()-b0).Seconds()/el
		res.RelayCores = (r1 - r0).Seconds() / el
		return nil
	})
	res.Batches, res.BatchedMessages = batchStats(reg)
	mu.Lock()
	res.InsertToApplied, res.CommitToApplied, res.CommitToHandler = quantilesOf(ins2ap), quantilesOf(c2ap), quantilesOf(c2h)
	res.CommitToStored, res.StoredToHandler = quantilesOf(c2s), quantilesOf(s2h)
	mu.Unlock()
	return res, err
}

func (a *applyClock) wait(ctx context.Context, limit time.Duration) error {
	select {
	case <-a.done:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(limit):
		return fmt.Errorf("%d of %d events applied within %s", a.n.Load(), a.want, limit)
	}
}

// withPipeline runs body with a fresh database, the relay streaming its
// outbox and the consumer (default configuration but batch, per-message
// handler)
// applying the relay's stream into the same database, until the consumer
// has applied events.
func withPipeline(ctx context.Context, o *options, env *benchEnv, events, batch int, reg prometheus.Registerer, onHandle, onApplied func(*consumer.Message), body func(*benchDB, *applyClock, *relayProc) error) error {
	const slot = "relay"
	db, err := consumerDB(ctx, env, slot)
	if err != nil {
		return err
	}
	defer db.drop()
	r, err := startRelay(o, env, db, slot, false)
	if err != nil {
		return err
	}
	defer func() { _, _ = r.stop(env) }()
	if _, err := waitStreaming(ctx, env, db, r, slot); err != nil {
		return err
	}
	pcfg, err := pgxpool.ParseConfig(db.url)
	if err != nil {
		return err
	}
	pcfg.MaxConns = int32(o.consumerWorkers + 4)
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return err
	}
	defer pool.Close()
	clock := newApplyClock(events)
	var h consumer.Handler = benchHandler{}
	if onHandle != nil {
		h = timedHandler{started: onHandle}
	}
	c, err := consumer.New(pool, env.js, consumer.Config{Name: "e2e", Stream: r.stream, Workers: o.consumerWorkers, BatchSize: batch, MaxAckPending: o.consumerPending}, h,
		consumer.WithAfterCommit(func(m *consumer.Message) {
			if onApplied != nil {
				onApplied(m)
			}
			clock.applied()
		}), consumer.WithRegisterer(reg))
	if err != nil {
		return err
	}
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- c.Run(rctx) }()
	err = body(db, clock, r)
	cancel()
	if rerr := <-done; err == nil && rerr != nil {
		err = fmt.Errorf("consumer: %w", rerr)
	}
	if err == nil {
		err = r.exited()
	}
	return err
}

// batchStats reads the consumer's batch size histogram from reg.
func batchStats(reg *prometheus.Registry) (batches uint64, messages float64) {
	mfs, err := reg.Gather()
	if err != nil {
		return 0, 0
	}
	for _, mf := range mfs {
		if mf.GetName() != "outbox_consumer_batch_size" {
			continue
		}
		for _, m := range mf.GetMetric() {
			batches += m.GetHistogram().GetSampleCount()
			messages += m.GetHistogram().GetSampleSum()
		}
	}
	return batches, messages
}

// waitStreaming waits until the relay streams from slot: its stream exists
// and the slot is active.
func waitStreaming(ctx context.Context, env *benchEnv, db *benchDB, r *relayProc, slot string) (jetstream.Stream, error) {
	deadline := time.Now().Add(30 * time.Second)
	for {
		if err := r.exited(); err != nil {
			return nil, err
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("relay not streaming after 30s; log %s:\n%s", r.logPath, tail(r.logPath, 2000))
		}
		if db.walsenderPID(ctx, slot) != 0 {
			if stream, err := env.js.Stream(ctx, r.stream); err == nil {
				return stream, nil
			}
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
}
