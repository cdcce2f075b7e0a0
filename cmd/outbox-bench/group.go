package main

import (
	"bufio"
	"cmp"
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/outbox-relay/outbox-relay/consumer"
	"github.com/outbox-relay/outbox-relay/internal/logging"
	"github.com/outbox-relay/outbox-relay/internal/provision"
)

// The group runs measure consumer groups across real processes: the same
// backlog in a partitioned stream, drained by 1 and by N member processes
// of one group (each this binary re-executed as memberCommand, with the
// same configuration as a replica of one service would have). The rate runs
// from the first commit of any member to the last commit of all, so the
// members' joining and the first rebalances are part of it, as they are
// when a service scales out over a backlog.

// memberCommand is the argument that makes outbox-bench a group member.
const memberCommand = "consumer-member"

// memberReport is how often a member prints its progress line.
const memberReport = 100 * time.Millisecond

// partitionedBacklog publishes the backlog's events again to a fresh stream
// partitioned into partitions, configured as `outbox-relay setup` creates
// it with nats.partitions.
func partitionedBacklog(ctx context.Context, env *benchEnv, events, aggs, pad, partitions int) (string, func(), error) {
	stream, prefix := streamNames("group")
	spec := provision.StreamSpec{Name: stream, Subjects: []string{prefix + ".*.*"}, Duplicates: 2 * time.Minute, Partitions: partitions}
	if _, err := provision.EnsureStream(ctx, env.js, spec, true); err != nil {
		return "", nil, err
	}
	drop := func() { _ = env.js.DeleteStream(context.Background(), stream) }
	if err := publishRouted(ctx, env, prefix, events, aggs, pad, nil); err != nil {
		drop()
		return "", nil, err
	}
	return stream, drop, nil
}

// memberProgress is the last progress line of one member process.
type memberProgress struct {
	applied, first, last atomic.Int64 // count; unix ns of the first and last commit
	batches, batched     atomic.Int64 // at exit: batch transactions, the messages in them
	reported             atomic.Bool  // batches and batched were reported
	exited               atomic.Bool  // its stdout closed: the process ended
}

// groupRun drains stream with s.processes member processes of one fresh
// group into a fresh database.
func groupRun(ctx context.Context, o *options, env *benchEnv, stream string, events int, s consumerSpec) (consumerFigure, error) {
	workers := cmp.Or(s.workers, o.consumerWorkers)
	f := consumerFigure{Name: s.name, Handler: s.handler(), BatchSize: s.batchSize, Processes: s.processes, Workers: workers, Events: events, Plain: s.plain}
	partitions := o.groupPartitions
	if s.plain {
		partitions = 0 // runMember: a plain durable
	}
	db, err := consumerDB(ctx, env)
	if err != nil {
		return f, err
	}
	defer db.drop()
	self, err := os.Executable()
	if err != nil {
		return f, err
	}
	group := fmt.Sprintf("bench-group-%d", time.Now().UnixNano())
	progress := make([]*memberProgress, s.processes)
	cmds := make([]*exec.Cmd, s.processes)
	var readers sync.WaitGroup
	stopAll := func() {
		for _, c := range cmds {
			if c != nil && c.Process != nil {
				_ = c.Process.Signal(syscall.SIGTERM)
			}
		}
		readers.Wait()
		for _, c := range cmds {
			if c != nil {
				_ = c.Wait()
			}
		}
	}
	if o.profileDir != "" { // the bench process: mostly the NATS server
		stop, err := startProfile(filepath.Join(o.profileDir, fmt.Sprintf("bench-group-server-%s-%dp%s.pprof", s.handler(), s.processes, plainTag(s))))
		if err != nil {
			return f, err
		}
		defer stop()
	}
	pm := db.postmasterPID(ctx)
	m0, pg0, b0 := readMachineCPU(), treeCPU(pm), selfCPU()
	for i := range s.processes {
		args := []string{memberCommand,
			"--postgres-url", db.url, "--nats-url", env.natsURL, "--stream", stream, "--name", group,
			"--member", fmt.Sprintf("m%d", i), "--partitions", fmt.Sprint(partitions),
			"--workers", fmt.Sprint(workers), "--batch", fmt.Sprint(s.batchSize),
			"--max-ack-pending", fmt.Sprint(o.consumerPending), "--handler", s.handler(), "--log-level", "debug"}
		if o.profileDir != "" {
			args = append(args, "--cpuprofile", filepath.Join(o.profileDir, fmt.Sprintf("bench-group-%s-%dp%s-m%d.pprof", s.handler(), s.processes, plainTag(s), i)))
		}
		cmd := exec.CommandContext(ctx, self, args...)
		logPath := filepath.Join(os.TempDir(), fmt.Sprintf("%s-m%d.log", group, i))
		logFile, err := os.Create(logPath)
		if err != nil {
			stopAll()
			return f, err
		}
		defer logFile.Close()
		cmd.Stderr = logFile
		out, err := cmd.StdoutPipe()
		if err != nil {
			stopAll()
			return f, err
		}
		if err := cmd.Start(); err != nil {
			stopAll()
			return f, fmt.Errorf("member %d: %w", i, err)
		}
		cmds[i], progress[i] = cmd, &memberProgress{}
		readers.Add(1)
		go func(p *memberProgress) {
			defer readers.Done()
			defer p.exited.Store(true)
			sc := bufio.NewScanner(out)
			for sc.Scan() {
				var n, first, last int64
				if _, err := fmt.Sscanf(sc.Text(), "applied %d first %d last %d", &n, &first, &last); err == nil {
					p.applied.Store(n)
					p.first.Store(first)
					p.last.Store(last)
				} else if _, err := fmt.Sscanf(sc.Text(), "batches %d messages %d", &n, &first); err == nil {
					p.batches.Store(n)
					p.batched.Store(first)
				}
			}
		}(progress[i])
	}
	deadline := time.Now().Add(5 * time.Minute)
	for {
		var n int64
		for _, p := range progress {
			n += p.applied.Load()
		}
		if n >= int64(events) {
			break
		}
		for i, p := range progress {
			if p.exited.Load() {
				stopAll()
				log := filepath.Join(os.TempDir(), fmt.Sprintf("%s-m%d.log", group, i))
				return f, fmt.Errorf("member %d exited early; log %s:\n%s", i, log, tail(log, 2000))
			}
		}
		if time.Now().After(deadline) {
			stopAll()
			return f, fmt.Errorf("%d of %d events applied by %d members within 5m (member logs %s-m*.log in %s)", n, events, s.processes, group, os.TempDir())
		}
		select {
		case <-ctx.Done():
			stopAll()
			return f, ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
	// The members' CPU: read before they exit and are reaped.
	var members time.Duration
	for _, c := range cmds {
		if cpu, err := procCPU(c.Process.Pid); err == nil {
			members += cpu
		}
	}
	el := time.Since(time.Unix(0, minFirst(progress)))
	m1, pg1, b1 := readMachineCPU(), treeCPU(pm), selfCPU()
	stopAll()
	first, last := minFirst(progress), int64(0)
	for _, p := range progress {
		last = max(last, p.last.Load())
	}
	span := time.Duration(last - first)
	var batches, batched int64
	for _, p := range progress {
		batches, batched = batches+p.batches.Load(), batched+p.batched.Load()
	}
	if batches > 0 {
		f.MeanBatch = float64(batched) / float64(batches)
	}
	f.Seconds, f.Rate = span.Seconds(), float64(events)/span.Seconds()
	f.MachineCores = busyCores(m0, m1)
	f.PostgresCores = (pg1 - pg0).Seconds() / el.Seconds()
	f.BenchCores, f.MemberCores = (b1-b0).Seconds()/el.Seconds(), members.Seconds()/el.Seconds()
	f.BenchMicrosPerEvent = float64((b1 - b0).Microseconds()) / float64(events)
	if n := dbCount(ctx, db.pool, "SELECT count(*) FROM bench_effect"); n != int64(events) {
		return f, fmt.Errorf("%d processes applied %d effect rows for %d events", s.processes, n, events)
	}
	return f, nil
}

func minFirst(ps []*memberProgress) int64 {
	var first int64
	for _, p := range ps {
		if v := p.first.Load(); v != 0 && (first == 0 || v < first) {
			first = v
		}
	}
	return first
}

func dbCount(ctx context.Context, pool *pgxpool.Pool, q string) int64 {
	var n int64
	if err := pool.QueryRow(ctx, q).Scan(&n); err != nil {
		return -1
	}
	return n
}

// runMember is one member process of groupRun: it consumes until SIGTERM
// and prints "applied N first F last L" every memberReport and at the end.
func runMember(args []string) error {
	fs := flag.NewFlagSet(memberCommand, flag.ContinueOnError)
	pgURL := fs.String("postgres-url", "", "database URL")
	natsURL := fs.String("nats-url", "", "NATS URL")
	stream := fs.String("stream", "", "stream")
	name := fs.String("name", "", "group name")
	member := fs.String("member", "", "member id")
	partitions := fs.Int("partitions", 0, "partition count")
	workers := fs.Int("workers", consumer.DefaultWorkers, "workers")
	batch := fs.Int("batch", consumer.DefaultBatchSize, "batch size")
	pending := fs.Int("max-ack-pending", 0, "MaxAckPending (0: default)")
	handler := fs.String("handler", "per-message", "per-message or batch")
	logLevel := fs.String("log-level", "info", "the member's log level (its stderr is a log file)")
	cpuprofile := fs.String("cpuprofile", "", "write a CPU profile of the member")
	latencyOut := fs.String("latency-out", "", "on exit, write each applied event's insert time (from the payload's ins) and commit time here, as pairs of little-endian int64 unix ns")
	if err := fs.Parse(args); err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	if *cpuprofile != "" {
		stop, err := startProfile(*cpuprofile)
		if err != nil {
			return err
		}
		defer stop()
	}
	pcfg, err := pgxpool.ParseConfig(*pgURL)
	if err != nil {
		return err
	}
	pcfg.MaxConns = int32(*workers + 4)
	// The load phase tells the consumer's backends from the others by it.
	pcfg.ConnConfig.RuntimeParams["application_name"] = consumerAppName
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return err
	}
	defer pool.Close()
	nc, err := nats.Connect(*natsURL)
	if err != nil {
		return err
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	log, err := logging.New(*logLevel, logging.FormatJSON)
	if err != nil {
		return err
	}
	defer func() { _ = log.Sync() }()
	var h consumer.Handler = benchHandler{}
	if *handler == "batch" {
		h = benchBatchHandler{}
	}
	var applied, first, last atomic.Int64
	cfg := consumer.Config{Name: *name, Stream: *stream, Workers: *workers, BatchSize: *batch, MaxAckPending: *pending}
	if *partitions > 0 {
		cfg.Group = &consumer.GroupConfig{Partitions: *partitions, Member: *member}
	}
	lat := &appliedTimes{}
	reg := prometheus.NewRegistry()
	c, err := consumer.New(pool, js, cfg, h, consumer.WithLogger(log.Named(*member)), consumer.WithRegisterer(reg), consumer.WithAfterCommit(func(m *consumer.Message) {
		now := time.Now().UnixNano()
		if applied.Add(1) == 1 {
			first.Store(now)
		}
		last.Store(now)
		if *latencyOut != "" {
			lat.add(m.Payload, now)
		}
	}))
	if err != nil {
		return err
	}
	var wg sync.WaitGroup
	report := func() { fmt.Printf("applied %d first %d last %d\n", applied.Load(), first.Load(), last.Load()) }
	rctx, cancel := context.WithCancel(ctx)
	wg.Add(1)
	go func() {
		defer wg.Done()
		t := time.NewTicker(memberReport)
		defer t.Stop()
		for {
			select {
			case <-rctx.Done():
				return
			case <-t.C:
				report()
			}
		}
	}()
	err = c.Run(ctx)
	cancel()
	wg.Wait()
	report()
	batches, batched := batchStats(reg)
	fmt.Printf("batches %d messages %.0f\n", batches, batched)
	log.Info("member done", zap.Int64("applied", applied.Load()), zap.Uint64("batches", batches), zap.Float64("batched_messages", batched))
	if errors.Is(err, context.Canceled) {
		err = nil
	}
	if *latencyOut != "" {
		err = errors.Join(err, lat.write(*latencyOut))
	}
	return err
}

// groupSpecs are the group runs for the batched specs: 1 process and n
// with the same workers each (replicas of one service), and n sharing the
// one process's workers between them (the same connections to the same
// database in all: what the split into processes costs by itself).
func groupSpecs(specs []consumerSpec, n, workers int) []consumerSpec {
	var out []consumerSpec
	for _, s := range specs {
		if s.batchSize == 1 {
			continue
		}
		for _, p := range []int{1, n} {
			g := s
			g.processes = p
			g.name = fmt.Sprintf("%s, %d-process group", s.name, p)
			out = append(out, g)
		}
		if shared := (workers + n - 1) / n; shared < workers {
			g := s
			g.processes, g.workers = n, shared
			g.name = fmt.Sprintf("%s, %d-process group, %d workers each", s.name, n, shared)
			out = append(out, g)
		}
	}
	return out
}

// groupPhase runs groupSpecs of specs over a partitioned copy of the
// backlog, each beside the apply ceiling of its spec.
func groupPhase(ctx context.Context, o *options, env *benchEnv, p *consumerPhase, specs []consumerSpec) error {
	gs := groupSpecs(specs, o.groupProcesses, o.consumerWorkers)
	if len(gs) == 0 {
		return nil
	}
	logf("consumer groups: %d events into a stream with %d partitions", o.events, o.groupPartitions)
	stream, drop, err := partitionedBacklog(ctx, env, int(o.events), o.aggs, o.pad, o.groupPartitions)
	if err != nil {
		return fmt.Errorf("partitioned backlog: %w", err)
	}
	defer drop()
	p.GroupPartitions = o.groupPartitions
	for _, s := range gs {
		logf("consumer groups: %s (%d workers each)", s.name, cmp.Or(s.workers, o.consumerWorkers))
		r, err := groupRun(ctx, o, env, stream, int(o.events), s)
		if err != nil {
			return fmt.Errorf("%s: %w", s.name, err)
		}
		for _, c := range p.Ceilings {
			if c.Handler == s.handler() && c.BatchSize == s.batchSize {
				r.Ceiling, r.Ratio = c.Rate, ratio(r.Rate, c.Rate)
			}
		}
		p.GroupRuns = append(p.GroupRuns, r)
	}
	// The controls: as many workers as the n-process groups have, in one
	// consumer of a plain durable on the same stream. In a process of its
	// own, like the members, it is what the group's overhead is measured
	// against: the members differ from it only in being a group (n
	// processes, their partitions' durables and the coordination). Inside
	// the bench process it shows what the extra connections to the one
	// database cost without any process or group in between.
	n := o.groupProcesses * o.consumerWorkers
	for _, s := range specs {
		if s.batchSize == 1 {
			continue
		}
		proc := s
		proc.processes, proc.workers, proc.plain = 1, n, true
		proc.name = fmt.Sprintf("%s, one consumer process with %d workers", s.name, n)
		logf("consumer groups: control, %s", proc.name)
		r, err := groupRun(ctx, o, env, stream, int(o.events), proc)
		if err != nil {
			return fmt.Errorf("%s: %w", proc.name, err)
		}
		p.GroupRuns = append(p.GroupRuns, r)

		s.workers, s.name = n, fmt.Sprintf("%s, one consumer with %d workers", s.name, n)
		logf("consumer groups: control, %s", s.name)
		r, err = consumerRun(ctx, env, stream, int(o.events), s, n, o.consumerPending, "")
		if err != nil {
			return fmt.Errorf("%s: %w", s.name, err)
		}
		r.Workers = n
		p.GroupRuns = append(p.GroupRuns, r)
	}
	return nil
}

// plainTag marks the profile files of a plain-durable control run.
func plainTag(s consumerSpec) string {
	if s.plain {
		return "-plain"
	}
	return ""
}
