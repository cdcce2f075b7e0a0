package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// The load phase measures what the pipeline costs at the loads users run
// (tens to thousands of events per second), next to what the same
// processes cost per event when draining, in one run. Every process is its
// own: the relay (the binary), the consumer (this binary as a plain-durable
// memberCommand), the NATS server (this binary as natsCommand) and the
// PostgreSQL cluster, whose walsender and consumer backends are counted
// apart. PostgreSQL runs with durable settings, as in the end-to-end
// phase, so that the floor beside each load is the same two durable
// commits the pipeline's latency contains.

// loadPhase is the JSON of the load phase.
type loadPhase struct {
	PGSettings    map[string]string `json:"postgresql_settings"`
	WarmupSeconds float64           `json:"warmup_seconds"`
	Seconds       float64           `json:"sampled_seconds"`
	Workers       int               `json:"consumer_workers"`
	// Drain is the cost per event of the same processes on a backlog of
	// DrainRowsPerTx-row transactions, consumed batched.
	DrainRowsPerTx int         `json:"drain_rows_per_tx"`
	Drain          *loadPoint  `json:"drain"`
	Runs           []loadPoint `json:"runs"`
	// Floor is each offered load's two durable commits back to back and a
	// bare reader's commit→receive meanwhile (e2eFloorRun).
	Floor []e2eFloor `json:"floor"`
}

// procCost is one process's (or group of processes') cost in a run.
type procCost struct {
	CPUPer1k float64 `json:"cpu_s_per_1k_events"`
	// WakeupsPerEvent counts voluntary context switches (a thread
	// blocking, to be woken later), PreemptsPerEvent involuntary ones.
	WakeupsPerEvent  float64 `json:"wakeups_per_event"`
	PreemptsPerEvent float64 `json:"preempts_per_event"`
	Cores            float64 `json:"cores"`
}

// loadPoint is one offered load (Offered 0: the drain) with one consumer
// batch size.
type loadPoint struct {
	Offered   int     `json:"offered_per_sec"`
	BatchSize int     `json:"consumer_batch_size"`
	Events    int     `json:"events"`
	Achieved  float64 `json:"achieved_per_sec"`
	Seconds   float64 `json:"seconds"`
	// InsertToApplied runs from the writer's clock before the INSERT to
	// the consumer's commit, for the events after the warm-up.
	InsertToApplied quantiles `json:"insert_to_applied"`
	Relay           procCost  `json:"relay"`
	Consumer        procCost  `json:"consumer"`
	NATS            procCost  `json:"nats_server"`
	// Postgres is the whole cluster; Walsender and ConsumerBackends are
	// parts of it (the rest: the writers' backends, the WAL writer, …).
	Postgres         procCost `json:"postgres"`
	Walsender        procCost `json:"postgres_walsender"`
	ConsumerBackends procCost `json:"postgres_consumer_backends"`
	MachineCores     float64  `json:"machine_cores"`
	// ConsumerBatches and ConsumerBatched are the consumer's batch
	// transactions over the run and the messages in them, as the member
	// reports them at exit; ConsumerTx is every transaction, the lone
	// messages' too (0: the member reported nothing). How much a batch
	// size above 1 batched at this load.
	ConsumerBatches int64 `json:"consumer_batches"`
	ConsumerBatched int64 `json:"consumer_batched_messages"`
	ConsumerTx      int64 `json:"consumer_transactions,omitempty"`
}

// messagesPerTx is how many messages the consumer's transactions carried
// on average in pt, 0 when not known.
func (pt *loadPoint) messagesPerTx() float64 {
	if pt.ConsumerTx == 0 {
		return 0
	}
	return float64(pt.Events) / float64(pt.ConsumerTx)
}

// setBatches records what the stopped member reported of its batches.
func (pt *loadPoint) setBatches(m *memberProc) {
	if !m.progress.reported.Load() {
		return
	}
	pt.ConsumerBatches, pt.ConsumerBatched = m.progress.batches.Load(), m.progress.batched.Load()
	pt.ConsumerTx = pt.ConsumerBatches + int64(pt.Events) - pt.ConsumerBatched
}

func costOf(s procSample, events int, seconds float64) procCost {
	if events <= 0 || seconds <= 0 {
		return procCost{}
	}
	n := float64(events)
	return procCost{CPUPer1k: s.CPU.Seconds() / n * 1000, WakeupsPerEvent: float64(s.Voluntary) / n,
		PreemptsPerEvent: float64(s.Involuntary) / n, Cores: s.CPU.Seconds() / seconds}
}

// loadStage is the servers and processes of one load run.
type loadStage struct {
	o    *options
	env  *benchEnv // natsURL and js point at the NATS child
	nats *natsProc
}

// loadPhaseRun runs the phase: the drain first, then each rate with each
// batch size, then the rate's floor.
func loadPhaseRun(ctx context.Context, o *options, env *benchEnv) (*loadPhase, error) {
	settings, reset, err := durableOn(ctx, env)
	if err != nil {
		return nil, err
	}
	defer reset()
	np, err := startNATSProc()
	if err != nil {
		return nil, err
	}
	defer np.stop()
	lenv := *env
	lenv.natsURL = np.url
	if lenv.nc, err = nats.Connect(np.url, nats.Name("outbox-bench load")); err != nil {
		return nil, err
	}
	defer lenv.nc.Close()
	if lenv.js, err = jetstream.New(lenv.nc); err != nil {
		return nil, err
	}
	st := &loadStage{o: o, env: &lenv, nats: np}
	p := &loadPhase{PGSettings: settings, WarmupSeconds: o.loadWarmup.Seconds(), Seconds: o.loadDur.Seconds(),
		Workers: o.consumerWorkers, DrainRowsPerTx: o.loadDrainPerTx}
	if o.loadDrainEvents > 0 {
		logf("load: drain cost, %d events of %d rows/tx, consumer batch size %d", o.loadDrainEvents, o.loadDrainPerTx, o.consumerBatch)
		d, err := st.drain(ctx)
		if err != nil {
			return nil, fmt.Errorf("drain: %w", err)
		}
		p.Drain = &d
	}
	fo := *o
	fo.warmup, fo.dur = o.loadWarmup, o.loadDur
	for _, rate := range o.loadRates {
		for _, batch := range o.loadBatches {
			logf("load: %d events/s, 1 row/tx, consumer batch size %d, for %s (+%s warm-up)", rate, batch, o.loadDur, o.loadWarmup)
			pt, err := st.atRate(ctx, rate, batch)
			if err != nil {
				return nil, fmt.Errorf("%d/s, batch size %d: %w", rate, batch, err)
			}
			p.Runs = append(p.Runs, pt)
		}
		logf("load: floor at %d events/s (two durable commits + a bare reader)", rate)
		f, err := e2eFloorRun(ctx, &fo, env, rate)
		if err != nil {
			return nil, fmt.Errorf("floor at %d/s: %w", rate, err)
		}
		p.Floor = append(p.Floor, f)
	}
	return p, nil
}

// pipeline is one run's relay and consumer processes on a fresh database.
type pipeline struct {
	db       *benchDB
	relay    *relayProc
	consumer *memberProc
}

func (p *pipeline) close(env *benchEnv) {
	if p.consumer != nil {
		_ = p.consumer.stop()
	}
	if p.relay != nil {
		_, _ = p.relay.stop(env)
	}
	if p.db != nil {
		p.db.drop()
	}
}

// start creates the database (loading a backlog first when backlog > 0)
// and starts the relay and then the consumer.
func (st *loadStage) start(ctx context.Context, batch, backlog int, profile bool, latencyOut string) (*pipeline, error) {
	p := &pipeline{}
	var err error
	if p.db, err = consumerDB(ctx, st.env, "relay"); err != nil {
		return nil, err
	}
	if backlog > 0 {
		if _, err := p.db.load(ctx, 0, int64(backlog), st.o.loadDrainPerTx, 2, st.o.aggs, st.o.pad); err != nil {
			p.close(st.env)
			return nil, fmt.Errorf("load: %w", err)
		}
	}
	if p.relay, err = startRelay(st.o, st.env, p.db, "relay", profile); err != nil {
		p.close(st.env)
		return nil, err
	}
	if _, err := waitStreaming(ctx, st.env, p.db, p.relay, "relay"); err != nil {
		p.close(st.env)
		return nil, err
	}
	if p.consumer, err = startMemberProc(ctx, st.o, st.env, p.db, p.relay.stream, batch, latencyOut); err != nil {
		p.close(st.env)
		return nil, err
	}
	return p, nil
}

// sample is every process of a run at one moment.
type sample struct {
	at                    time.Time
	relay, consumer, nats procSample
	pg                    map[int]procSample
	machine               machineCPU
}

func (st *loadStage) sample(p *pipeline, pm int) sample {
	s := sample{at: time.Now(), machine: readMachineCPU(), pg: sampleTree(pm)}
	s.relay, _ = sampleProc(p.relay.pid())
	s.consumer, _ = sampleProc(p.consumer.pid())
	s.nats, _ = sampleProc(st.nats.pid())
	return s
}

// pgCosts splits the cluster's CPU between two samples into the whole, the
// walsender and the consumer's backends.
func pgCosts(ctx context.Context, db *benchDB, a, b sample, events int) (all, ws, cons procCost) {
	d := treeDelta(a.pg, b.pg)
	roles := map[int]string{}
	rows, err := db.pool.Query(ctx, "SELECT pid, backend_type, coalesce(application_name, '') FROM pg_stat_activity")
	if err == nil {
		for rows.Next() {
			var pid int32
			var typ, app string
			if rows.Scan(&pid, &typ, &app) == nil {
				switch {
				case typ == "walsender":
					roles[int(pid)] = "walsender"
				case app == consumerAppName:
					roles[int(pid)] = "consumer"
				}
			}
		}
		rows.Close()
	}
	var sAll, sWS, sCons procSample
	for pid, s := range d {
		sAll = sAll.add(s)
		switch roles[pid] {
		case "walsender":
			sWS = sWS.add(s)
		case "consumer":
			sCons = sCons.add(s)
		}
	}
	sec := b.at.Sub(a.at).Seconds()
	return costOf(sAll, events, sec), costOf(sWS, events, sec), costOf(sCons, events, sec)
}

// atRate offers rate events/s in 1-row transactions for warm-up + sampled
// time with the pipeline streaming, and costs every process from the
// first insert to the last commit of the consumer.
func (st *loadStage) atRate(ctx context.Context, rate, batch int) (loadPoint, error) {
	pt := loadPoint{Offered: rate, BatchSize: batch}
	latPath := filepath.Join(st.o.workDir, fmt.Sprintf("applied-%d-%d.bin", rate, batch))
	p, err := st.start(ctx, batch, 0, st.o.profileDir != "", latPath)
	if err != nil {
		return pt, err
	}
	defer p.close(st.env)
	total := int(float64(rate) * (st.o.loadWarmup + st.o.loadDur).Seconds())
	pt.Events = total
	pm := p.db.postmasterPID(ctx)
	t0 := time.Now().Add(50 * time.Millisecond)
	from := t0.Add(st.o.loadWarmup)
	profErr := st.profile(ctx, p.relay, from, rate, batch)
	a := st.sample(p, pm)
	if _, err := offerLoad(ctx, p.db, rate, total, t0).wait(); err != nil {
		return pt, err
	}
	pt.Achieved = float64(total) / time.Since(t0).Seconds()
	if err := p.consumer.waitApplied(ctx, int64(total), time.Minute, p.relay); err != nil {
		return pt, err
	}
	b := st.sample(p, pm)
	if err := <-profErr; err != nil {
		return pt, fmt.Errorf("profile: %w", err)
	}
	st.fill(ctx, &pt, p, a, b, total, total)
	if err := p.consumer.stop(); err != nil {
		return pt, fmt.Errorf("consumer: %w", err)
	}
	pt.setBatches(p.consumer)
	lat, err := readAppliedTimes(latPath, from)
	if err != nil {
		return pt, err
	}
	pt.InsertToApplied = quantilesOf(lat)
	return pt, nil
}

// profile fetches a CPU profile and an execution trace of the relay over
// the sampled part of a run when --profile-dir is set.
func (st *loadStage) profile(ctx context.Context, r *relayProc, from time.Time, rate, batch int) <-chan error {
	done := make(chan error, 1)
	if st.o.profileDir == "" {
		done <- nil
		return done
	}
	secs := max(1, int(st.o.loadDur.Seconds())/2)
	base := filepath.Join(st.o.profileDir, fmt.Sprintf("relay-load-%d-b%d", rate, batch))
	go func() {
		select {
		case <-time.After(time.Until(from)):
		case <-ctx.Done():
		}
		err := r.fetch(ctx, "profile", secs, base+".pprof")
		done <- errors.Join(err, r.fetch(ctx, "trace", 1, base+".trace"))
	}()
	return done
}

// fill sets pt's costs from samples a and b: relayEvents and
// consumerEvents are what each of the two did between them.
func (st *loadStage) fill(ctx context.Context, pt *loadPoint, p *pipeline, a, b sample, relayEvents, consumerEvents int) {
	sec := b.at.Sub(a.at).Seconds()
	pt.Seconds = sec
	pt.MachineCores = busyCores(a.machine, b.machine)
	pt.Relay = costOf(b.relay.sub(a.relay), relayEvents, sec)
	pt.Consumer = costOf(b.consumer.sub(a.consumer), consumerEvents, sec)
	pt.NATS = costOf(b.nats.sub(a.nats), consumerEvents, sec)
	pt.Postgres, pt.Walsender, pt.ConsumerBackends = pgCosts(ctx, p.db, a, b, consumerEvents)
}

// drain loads a backlog, then starts the pipeline on it and costs the
// relay and the consumer each over the middle of its own drain (10% to 90%
// of the events through it: the relay's by its stream, the consumer's by
// its progress lines), NATS and PostgreSQL from the relay's start to the
// last commit.
func (st *loadStage) drain(ctx context.Context) (loadPoint, error) {
	n := st.o.loadDrainEvents
	pt := loadPoint{BatchSize: st.o.consumerBatch, Events: n}
	p, err := st.start(ctx, st.o.consumerBatch, n, false, "")
	if err != nil {
		return pt, err
	}
	defer p.close(st.env)
	pm := p.db.postmasterPID(ctx)
	a := st.sample(p, pm)
	type mark struct {
		n int64
		s procSample
	}
	var marks [4]mark // relay at 10%, at 90%; consumer at 10%, at 90%
	take := func(i int, have, want int64, pid int) {
		if marks[i].n == 0 && have >= want {
			marks[i].s, _ = sampleProc(pid)
			marks[i].n = have
		}
	}
	lo, hi := int64(n/10), int64(n-n/10)
	deadline := time.Now().Add(st.o.drainTimeout)
	for marks[0].n == 0 || marks[1].n == 0 || marks[2].n == 0 || marks[3].n == 0 {
		if err := p.relay.exited(); err != nil {
			return pt, err
		}
		if time.Now().After(deadline) {
			return pt, fmt.Errorf("drain of %d events not done within %s", n, st.o.drainTimeout)
		}
		ss, err := streamState(ctx, st.env.js, p.relay.stream)
		if err != nil {
			return pt, err
		}
		applied := p.consumer.progress.applied.Load()
		take(0, int64(ss.Msgs), lo, p.relay.pid())
		take(1, int64(ss.Msgs), hi, p.relay.pid())
		take(2, applied, lo, p.consumer.pid())
		take(3, applied, hi, p.consumer.pid())
		time.Sleep(5 * time.Millisecond)
	}
	if err := p.consumer.waitApplied(ctx, int64(n), st.o.drainTimeout, p.relay); err != nil {
		return pt, err
	}
	b := st.sample(p, pm)
	st.fill(ctx, &pt, p, a, b, n, n)
	pt.Relay = costOf(marks[1].s.sub(marks[0].s), int(marks[1].n-marks[0].n), 1)
	pt.Consumer = costOf(marks[3].s.sub(marks[2].s), int(marks[3].n-marks[2].n), 1)
	pt.Relay.Cores, pt.Consumer.Cores = 0, 0 // not over the run's window
	pt.Achieved = float64(n) / pt.Seconds
	if err := p.consumer.stop(); err != nil {
		return pt, fmt.Errorf("consumer: %w", err)
	}
	pt.setBatches(p.consumer)
	return pt, nil
}

// memberProc is a consumer member process of the load phase (a plain
// durable).
type memberProc struct {
	cmd      *exec.Cmd
	progress *memberProgress
	logPath  string
	done     chan struct{}
}

// startMemberProc starts this binary as memberCommand consuming stream
// into db, and waits for its durable consumer to exist.
func startMemberProc(ctx context.Context, o *options, env *benchEnv, db *benchDB, stream string, batch int, latencyOut string) (*memberProc, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	name := fmt.Sprintf("load-%d", time.Now().UnixNano())
	args := []string{memberCommand, "--postgres-url", db.url, "--nats-url", env.natsURL, "--stream", stream, "--name", name,
		"--partitions", "0", "--workers", fmt.Sprint(o.consumerWorkers), "--batch", fmt.Sprint(batch),
		"--max-ack-pending", fmt.Sprint(o.consumerPending), "--log-level", "warn"}
	if latencyOut != "" {
		args = append(args, "--latency-out", latencyOut)
	}
	m := &memberProc{cmd: exec.Command(self, args...), progress: &memberProgress{}, done: make(chan struct{}),
		logPath: filepath.Join(o.workDir, name+".log")}
	logFile, err := os.Create(m.logPath)
	if err != nil {
		return nil, err
	}
	m.cmd.Stderr = logFile
	out, err := m.cmd.StdoutPipe()
	if err != nil {
		logFile.Close()
		return nil, err
	}
	if err := m.cmd.Start(); err != nil {
		logFile.Close()
		return nil, err
	}
	go func() {
		defer close(m.done)
		defer logFile.Close()
		defer m.progress.exited.Store(true)
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			var n, first, last int64
			if _, err := fmt.Sscanf(sc.Text(), "applied %d first %d last %d", &n, &first, &last); err == nil {
				m.progress.applied.Store(n)
			} else if _, err := fmt.Sscanf(sc.Text(), "batches %d messages %d", &n, &first); err == nil {
				m.progress.batches.Store(n)
				m.progress.batched.Store(first)
				m.progress.reported.Store(true)
			}
		}
	}()
	deadline := time.Now().Add(30 * time.Second)
	for {
		if _, err := env.js.Consumer(ctx, stream, name); err == nil {
			return m, nil
		}
		if m.progress.exited.Load() || time.Now().After(deadline) {
			_ = m.stop()
			return nil, fmt.Errorf("consumer process not consuming within 30s; log %s:\n%s", m.logPath, tail(m.logPath, 2000))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func (m *memberProc) pid() int { return m.cmd.Process.Pid }

// stop sends SIGTERM and waits for the process (once).
func (m *memberProc) stop() error {
	if m.cmd.ProcessState != nil {
		return nil
	}
	_ = m.cmd.Process.Signal(syscall.SIGTERM)
	t := time.AfterFunc(30*time.Second, func() { _ = m.cmd.Process.Kill() })
	defer t.Stop()
	<-m.done
	if err := m.cmd.Wait(); err != nil {
		return fmt.Errorf("%w; log %s:\n%s", err, m.logPath, tail(m.logPath, 2000))
	}
	return nil
}

// waitApplied waits until the consumer process applied n events.
func (m *memberProc) waitApplied(ctx context.Context, n int64, limit time.Duration, r *relayProc) error {
	deadline := time.Now().Add(limit)
	for m.progress.applied.Load() < n {
		if err := r.exited(); err != nil {
			return err
		}
		if m.progress.exited.Load() {
			return fmt.Errorf("consumer process exited; log %s:\n%s", m.logPath, tail(m.logPath, 2000))
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("consumer applied %d of %d events within %s", m.progress.applied.Load(), n, limit)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(10 * time.Millisecond):
		}
	}
	return nil
}
