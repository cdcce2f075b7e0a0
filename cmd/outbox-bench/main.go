// Command outbox-bench measures outbox-relay against the physical ceilings
// of the machine it runs on, in one run: what PostgreSQL can decode (a bare
// pglogrepl reader and pg_recvlogical), what JetStream can store (async
// publish with a bounded window, and the synchronous round trip), and what
// the relay achieves between them (drain of a pre-loaded backlog, latency
// at steady offered loads, CPU and peak RSS). Every relay figure is printed
// next to the ceilings and as a ratio to them: the machine is shared and
// noisy, absolute numbers drift, ratios hold.
//
// It starts the test harness's private PostgreSQL cluster and embedded
// JetStream server (or uses --postgres-url / --nats-url), runs the real
// outbox-relay binary as a child process (built by `make bench`, or named
// by --relay-bin), prints a table and writes JSON to bench/results.
//
//	go build -o bin/outbox-relay ./cmd/outbox-relay
//	go run ./cmd/outbox-bench --relay-bin bin/outbox-relay [--large]
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/outbox-relay/outbox-relay/consumer"
	"github.com/outbox-relay/outbox-relay/contract"
)

type options struct {
	pgURL, natsURL string
	relayBin       string
	out            string
	events         int64
	aggs           int
	pad            int
	window         int
	syncN          int
	rates          []int
	rowsPerTx      []int
	warmup, dur    time.Duration
	large          bool
	largeBacklog   int64
	largeTx        int64
	profileDir     string
	phases         map[string]bool
	drainTimeout   time.Duration
	repeat         int
	relayEnv       []string
	relayConfig    string // appended to the relay's configuration file
	tracingPerTx   int
	quietWait      time.Duration
	workDir        string
	// consumer and e2e phases
	consumerWorkers int
	consumerBatch   int
	consumerPending int
	consumerRuns    []string
	groupProcesses  int
	groupPartitions int
	e2eRates        []int
	e2eRepeat       int
	// load phase
	loadRates       []int
	loadBatches     []int
	loadWarmup      time.Duration
	loadDur         time.Duration
	loadDrainEvents int
	loadDrainPerTx  int
}

func main() {
	if len(os.Args) > 1 && os.Args[1] == memberCommand {
		if err := runMember(os.Args[2:]); err != nil {
			fmt.Fprintln(os.Stderr, "consumer member:", err)
			os.Exit(1)
		}
		return
	}
	if len(os.Args) > 1 && os.Args[1] == natsCommand {
		if err := runNATS(os.Args[2:]); err != nil {
			fmt.Fprintln(os.Stderr, "nats server:", err)
			os.Exit(1)
		}
		return
	}
	if len(os.Args) > 1 && os.Args[1] == readerCommand {
		if err := runReader(os.Args[2:]); err != nil {
			fmt.Fprintln(os.Stderr, "decode reader:", err)
			os.Exit(1)
		}
		return
	}
	o, err := parseFlags(os.Args[1:])
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, o); err != nil {
		fmt.Fprintln(os.Stderr, "outbox-bench:", err)
		os.Exit(1)
	}
}

func parseFlags(args []string) (*options, error) {
	o := &options{}
	fs := flag.NewFlagSet("outbox-bench", flag.ContinueOnError)
	fs.StringVar(&o.pgURL, "postgres-url", "", "superuser URL of an external PostgreSQL (wal_level=logical); default: a private cluster")
	fs.StringVar(&o.natsURL, "nats-url", "", "URL of an external JetStream server; default: an embedded one")
	fs.StringVar(&o.relayBin, "relay-bin", "bin/outbox-relay", "the outbox-relay binary to measure (go build -o bin/outbox-relay ./cmd/outbox-relay)")
	fs.StringVar(&o.out, "out", "bench/results", "directory for the JSON results (empty: JSON to stdout)")
	fs.Int64Var(&o.events, "events", 200000, "events per drain backlog")
	fs.IntVar(&o.aggs, "aggregates", 1000, "aggregates the events are spread over")
	fs.IntVar(&o.pad, "pad", 176, "filler bytes in each payload (176 makes ~256 B JSON)")
	fs.IntVar(&o.window, "window", 4096, "broker ceiling: async publishes in flight (the relay's default max_in_flight)")
	fs.IntVar(&o.syncN, "sync", 5000, "broker ceiling: synchronous publishes for the round trip")
	rates := fs.String("rates", "1000,2000,5000", "latency: offered loads in events/s")
	rowsPerTx := fs.String("rows-per-tx", "1,100", "drain: rows per transaction of each backlog")
	fs.DurationVar(&o.warmup, "warmup", 2*time.Second, "latency: warm-up per load, not sampled")
	fs.DurationVar(&o.dur, "duration", 10*time.Second, "latency: sampled time per load")
	fs.BoolVar(&o.large, "large", false, "also measure peak RSS for a large backlog and one huge transaction")
	fs.Int64Var(&o.largeBacklog, "large-backlog", 2000000, "--large: events of the large backlog (100 rows/tx)")
	fs.Int64Var(&o.largeTx, "large-tx", 1000000, "--large: rows of the huge transaction")
	fs.StringVar(&o.profileDir, "profile-dir", "", "write CPU profiles of the decode reader and the relay drains here")
	phases := fs.String("phases", "broker,drain,tracing,latency,consumer,e2e,load", "phases to run: broker, drain, tracing (drain with relay spans off and on), latency, consumer, e2e, load (cost per event at offered loads beside the drain's; and large, implied by --large)")
	fs.IntVar(&o.tracingPerTx, "tracing-rows-per-tx", 100, "tracing: rows per transaction of the traced backlog")
	fs.IntVar(&o.consumerWorkers, "consumer-workers", consumer.DefaultWorkers, "consumer, e2e: the consumer's Workers (and the apply ceiling's connections)")
	fs.IntVar(&o.consumerBatch, "consumer-batch", consumer.DefaultBatchSize, "consumer, e2e: the consumer's BatchSize for the batched runs (and the apply ceiling's)")
	fs.IntVar(&o.consumerPending, "consumer-max-ack-pending", 0, "consumer, e2e: the consumer's MaxAckPending (0: the library's default)")
	fs.IntVar(&o.groupProcesses, "group-processes", 3, "consumer: after the batched runs, the same runs as a consumer group of 1 and of this many member processes (0 or 1: none)")
	fs.IntVar(&o.groupPartitions, "group-partitions", 12, "consumer: the group runs' partition count")
	consumerRuns := fs.String("consumer-runs", "single,batched,batch", "consumer: which runs, each beside its apply ceiling: single (per-message handler, 1 message/tx), batched (per-message handler, batched), batch (batch handler)")
	fs.IntVar(&o.e2eRepeat, "e2e-repeat", 1, "e2e: alternate the batch size 1 and batched latency runs this many times at each rate (the least disturbed of each counts)")
	e2eRates := fs.String("e2e-rates", "100,2000", "e2e: offered loads in events/s for insert→applied latency, each with batch size 1 and --consumer-batch")
	loadRates := fs.String("load-rates", "100,500,2000,5000", "load: offered loads in events/s (1-row transactions)")
	loadBatches := fs.String("load-batches", "", "load: the consumer's batch sizes at each load (default: 1 and --consumer-batch)")
	fs.DurationVar(&o.loadWarmup, "load-warmup", time.Second, "load: warm-up per load, not sampled for latency")
	fs.DurationVar(&o.loadDur, "load-duration", 5*time.Second, "load: sampled time per load")
	fs.IntVar(&o.loadDrainEvents, "load-drain-events", 30000, "load: events of the backlog whose drain costs the same processes (0: no drain)")
	fs.IntVar(&o.loadDrainPerTx, "load-drain-rows-per-tx", 1, "load: rows per transaction of that backlog")
	relayEnv := fs.String("relay-env", "", "extra environment for the relay process, comma-separated KEY=VALUE (e.g. GOGC=200,GOMAXPROCS=1)")
	fs.IntVar(&o.repeat, "repeat", 3, "drains: alternate the bare reader and the relay this many times on the same backlog and keep the best of each (the machine is noisy)")
	fs.DurationVar(&o.drainTimeout, "drain-timeout", 5*time.Minute, "give up on a relay drain after this long")
	fs.DurationVar(&o.quietWait, "quiet-wait", 0, "wait up to this long for other processes to leave the CPUs idle (< 0.25 busy cores) before measuring")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	o.phases = map[string]bool{}
	for _, p := range strings.Split(*phases, ",") {
		if p = strings.TrimSpace(p); p != "" {
			o.phases[p] = true
		}
	}
	if o.large {
		o.phases["large"] = true
	}
	for _, kv := range strings.Split(*relayEnv, ",") {
		if kv = strings.TrimSpace(kv); kv != "" {
			if !strings.Contains(kv, "=") {
				return nil, fmt.Errorf("--relay-env: %q is not KEY=VALUE", kv)
			}
			o.relayEnv = append(o.relayEnv, kv)
		}
	}
	var err error
	if o.consumerWorkers < 1 || o.consumerBatch < 1 {
		return nil, fmt.Errorf("--consumer-workers %d, --consumer-batch %d: each must be at least 1 (--consumer-batch 1 is one transaction per message)", o.consumerWorkers, o.consumerBatch)
	}
	if o.groupProcesses > 1 && (o.groupPartitions < 1 || o.groupPartitions > contract.MaxPartitions) {
		return nil, fmt.Errorf("--group-partitions %d: want 1 to %d", o.groupPartitions, contract.MaxPartitions)
	}
	for _, r := range strings.Split(*consumerRuns, ",") {
		if r = strings.TrimSpace(r); r != "" {
			o.consumerRuns = append(o.consumerRuns, r)
		}
	}
	if o.e2eRates, err = positiveInts("--e2e-rates", *e2eRates); err != nil {
		return nil, err
	}
	if o.loadRates, err = positiveInts("--load-rates", *loadRates); err != nil {
		return nil, err
	}
	if *loadBatches == "" {
		*loadBatches = fmt.Sprintf("1,%d", o.consumerBatch)
	}
	if o.loadBatches, err = positiveInts("--load-batches", *loadBatches); err != nil {
		return nil, err
	}
	if o.loadDrainPerTx < 1 {
		return nil, fmt.Errorf("--load-drain-rows-per-tx %d: want at least 1", o.loadDrainPerTx)
	}
	if o.rates, err = positiveInts("--rates", *rates); err != nil {
		return nil, err
	}
	if o.rowsPerTx, err = positiveInts("--rows-per-tx", *rowsPerTx); err != nil {
		return nil, err
	}
	if _, err := os.Stat(o.relayBin); err != nil {
		return nil, fmt.Errorf("--relay-bin %s: %w (build it: go build -o bin/outbox-relay ./cmd/outbox-relay)", o.relayBin, err)
	}
	abs, err := filepath.Abs(o.relayBin)
	if err != nil {
		return nil, err
	}
	o.relayBin = abs
	if o.profileDir != "" {
		if err := os.MkdirAll(o.profileDir, 0o755); err != nil {
			return nil, err
		}
	}
	return o, nil
}

// results is the JSON document of one run.
type results struct {
	Date       string            `json:"date"`
	Machine    machineInfo       `json:"machine"`
	PostgreSQL string            `json:"postgresql"`
	PGSettings map[string]string `json:"postgresql_settings"`
	NATS       string            `json:"nats_server"`
	Commit     string            `json:"commit,omitempty"`
	Args       []string          `json:"args"`
	Events     int64             `json:"events"`
	Aggregates int               `json:"aggregates"`
	Broker     *brokerResult     `json:"broker_ceiling,omitempty"`
	Backlogs   []backlogResult   `json:"drain,omitempty"`
	Latency    []latencyResult   `json:"latency,omitempty"`
	// LatencyFloor is PostgreSQL's delivery latency at each offered load,
	// measured with the bare reader: the part of commit→ack no relay can
	// remove.
	LatencyFloor []floorResult `json:"latency_floor,omitempty"`
	// BrokerPaced is JetStream's publish→ack latency alone at each
	// offered load.
	BrokerPaced []brokerPaced `json:"broker_paced,omitempty"`
	Large       []largeResult `json:"large,omitempty"`
	// Tracing is the drain with relay spans off and on.
	Tracing *tracingResult `json:"tracing,omitempty"`
	// Consumer holds the consumer and end-to-end phases, measured with
	// PostgreSQL at durable settings.
	Consumer *consumerPhase `json:"consumer,omitempty"`
	// Load is the cost per event of every process at offered loads.
	Load    *loadPhase `json:"load,omitempty"`
	Targets []target   `json:"targets"`
	// BackgroundCores is the CPU other processes used just before the run
	// (sampled over 2 s with the servers idle): above ~0.2 the figures are
	// not trustworthy.
	BackgroundCores float64 `json:"background_cores"`
	WallSeconds     float64 `json:"wall_seconds"`
}

// backlogResult is one backlog shape drained by every reader.
type backlogResult struct {
	RowsPerTx   int          `json:"rows_per_tx"`
	Events      int64        `json:"events"`
	AvgPayload  float64      `json:"avg_payload_bytes"`
	LoadSeconds float64      `json:"load_seconds"`
	Recvlogical *drainResult `json:"pg_recvlogical,omitempty"`
	// Decode and Relay are the best of Repeat alternating drains (highest
	// rate; CPU is that drain's); every drain is in DecodeRuns/RelayRuns.
	Repeat       int           `json:"repeat"`
	Decode       drainResult   `json:"decode_ceiling"`
	Relay        drainResult   `json:"relay"`
	DecodeRuns   []drainResult `json:"decode_runs"`
	RelayRuns    []drainResult `json:"relay_runs"`
	RatioDecode  float64       `json:"relay_to_decode"`
	RatioCeiling float64       `json:"relay_to_min_ceiling"`
	RatioCPU     float64       `json:"relay_cpu_to_reader_cpu"`
}

// largeResult is a relay drain sized for memory, not speed.
type largeResult struct {
	Name        string      `json:"name"`
	RowsPerTx   int64       `json:"rows_per_tx"`
	LoadSeconds float64     `json:"load_seconds"`
	Relay       drainResult `json:"relay"`
}

// target is one of issue 5's targets, judged on this run.
type target struct {
	Name  string  `json:"name"`
	Value float64 `json:"value"`
	Limit float64 `json:"limit"`
	Le    bool    `json:"at_most"` // the value must be ≤ limit (else ≥)
	// Info marks a figure printed among the targets to read them by,
	// not judged.
	Info bool `json:"info,omitempty"`
	OK   bool `json:"ok"`
}

// positiveInts parses a comma-separated list of positive integers.
func positiveInts(flagName, list string) ([]int, error) {
	var out []int
	for _, s := range strings.Split(list, ",") {
		if s = strings.TrimSpace(s); s == "" {
			continue
		}
		n, err := strconv.Atoi(s)
		if err != nil || n <= 0 {
			return nil, fmt.Errorf("%s: %q is not a positive integer", flagName, s)
		}
		out = append(out, n)
	}
	return out, nil
}

func run(ctx context.Context, o *options) error {
	began := time.Now()
	work, err := os.MkdirTemp("", "outbox-bench-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(work)
	o.workDir = work
	logf("starting PostgreSQL and NATS")
	env, err := startEnv(ctx, o.pgURL, o.natsURL)
	if err != nil {
		return err
	}
	defer env.close()
	res := &results{
		Date: began.UTC().Format(time.RFC3339), Machine: readMachineInfo(),
		PostgreSQL: env.PGVersion, PGSettings: env.PGSettings, NATS: env.NATSVersion,
		Commit: gitCommit(), Args: os.Args[1:], Events: o.events, Aggregates: o.aggs,
	}
	res.BackgroundCores = waitQuiet(ctx, o.quietWait)
	if o.phases["broker"] {
		logf("broker ceiling: %d async publishes (window %d), %d sync", o.events, o.window, o.syncN)
		b, err := brokerCeiling(ctx, env, int(o.events), o.window, o.syncN, o.aggs, o.pad, o.repeat)
		if err != nil {
			return fmt.Errorf("broker ceiling: %w", err)
		}
		res.Broker = &b
	}
	if o.phases["drain"] {
		for _, perTx := range o.rowsPerTx {
			b, err := drainBacklog(ctx, o, env, perTx, res.Broker)
			if err != nil {
				return fmt.Errorf("drain %d rows/tx: %w", perTx, err)
			}
			res.Backlogs = append(res.Backlogs, b)
		}
	}
	if o.phases["tracing"] {
		if res.Tracing, err = tracingDrain(ctx, o, env, o.tracingPerTx); err != nil {
			return fmt.Errorf("tracing drain: %w", err)
		}
	}
	if o.phases["latency"] {
		for _, rate := range o.rates {
			logf("latency floor: JetStream alone at %d msgs/s for %s (+%s warm-up)", rate, o.dur, o.warmup)
			bp, err := brokerPacedRun(ctx, env, rate, o.warmup, o.dur, o.aggs, o.pad)
			if err != nil {
				return fmt.Errorf("broker at %d/s: %w", rate, err)
			}
			res.BrokerPaced = append(res.BrokerPaced, bp)
			logf("latency floor: bare reader at %d events/s for %s (+%s warm-up)", rate, o.dur, o.warmup)
			f, err := floorRun(ctx, env, rate, o.warmup, o.dur)
			if err != nil {
				return fmt.Errorf("latency floor at %d/s: %w", rate, err)
			}
			res.LatencyFloor = append(res.LatencyFloor, f)
			logf("latency: %d events/s for %s (+%s warm-up)", rate, o.dur, o.warmup)
			l, err := latencyRun(ctx, o, env, rate, o.warmup, o.dur)
			if err != nil {
				return fmt.Errorf("latency at %d/s: %w", rate, err)
			}
			res.Latency = append(res.Latency, l)
		}
	}
	if o.phases["consumer"] || o.phases["e2e"] {
		if err := consumerPhases(ctx, o, env, res); err != nil {
			return err
		}
	}
	if o.phases["load"] {
		if res.Load, err = loadPhaseRun(ctx, o, env); err != nil {
			return fmt.Errorf("load: %w", err)
		}
	}
	if o.phases["large"] {
		for _, l := range []struct {
			name          string
			events, perTx int64
		}{
			{fmt.Sprintf("%d-event backlog", o.largeBacklog), o.largeBacklog, 100},
			{fmt.Sprintf("one %d-row transaction", o.largeTx), o.largeTx, o.largeTx},
		} {
			r, err := largeDrain(ctx, o, env, l.name, l.events, l.perTx)
			if err != nil {
				return fmt.Errorf("%s: %w", l.name, err)
			}
			res.Large = append(res.Large, r)
		}
	}
	res.Targets = judge(res)
	res.WallSeconds = time.Since(began).Seconds()
	printTable(os.Stdout, res)
	return writeResults(o.out, res)
}

// drainBacklog loads one backlog into a slot per drain and drains it with
// pg_recvlogical, then alternately with the bare reader and the relay.
func drainBacklog(ctx context.Context, o *options, env *benchEnv, perTx int, broker *brokerResult) (backlogResult, error) {
	b := backlogResult{RowsPerTx: perTx, Events: o.events, Repeat: max(1, o.repeat)}
	slots := []string{"relay_1", "recvlogical"}
	for i := 1; i <= b.Repeat; i++ {
		slots = append(slots, fmt.Sprintf("reader_%d", i))
		if i > 1 {
			slots = append(slots, fmt.Sprintf("relay_%d", i))
		}
	}
	db, err := env.newDB(ctx, slots...)
	if err != nil {
		return b, err
	}
	defer db.drop()
	logf("drain %d rows/tx: loading %d events", perTx, o.events)
	el, err := db.load(ctx, 0, o.events, perTx, 2, o.aggs, o.pad)
	if err != nil {
		return b, fmt.Errorf("load: %w", err)
	}
	b.LoadSeconds = el.Seconds()
	if b.AvgPayload, err = db.avgPayload(ctx); err != nil {
		return b, err
	}
	var endpos string
	if err := db.pool.QueryRow(ctx, "SELECT pg_current_wal_lsn()::text").Scan(&endpos); err != nil {
		return b, err
	}
	logf("drain %d rows/tx: pg_recvlogical", perTx)
	if b.Recvlogical, err = recvlogical(ctx, db, "recvlogical", o.events, endpos); err != nil {
		return b, err
	}
	for i := 1; i <= b.Repeat; i++ {
		prof := func(name string) string {
			if o.profileDir == "" || i > 1 {
				return ""
			}
			return fmt.Sprintf("%s-%drow.pprof", name, perTx)
		}
		logf("drain %d rows/tx: bare pglogrepl reader (%d of %d)", perTx, i, b.Repeat)
		readerProf := ""
		if p := prof("reader"); p != "" {
			readerProf = filepath.Join(o.profileDir, p)
		}
		d, err := decodeCeiling(ctx, db, fmt.Sprintf("reader_%d", i), o.events, readerProf)
		if err != nil {
			return b, err
		}
		b.DecodeRuns = append(b.DecodeRuns, d)
		logf("drain %d rows/tx: relay (%d of %d)", perTx, i, b.Repeat)
		d, err = drainRelay(ctx, o, env, db, fmt.Sprintf("relay_%d", i), o.events, prof("relay"), int(0.8*d.Seconds))
		if err != nil {
			return b, err
		}
		b.RelayRuns = append(b.RelayRuns, d)
	}
	b.Decode, b.Relay = best(b.DecodeRuns), best(b.RelayRuns)
	b.RatioDecode = ratio(b.Relay.Rate, b.Decode.Rate)
	ceiling := b.Decode.Rate
	if broker != nil && broker.Rate < ceiling {
		ceiling = broker.Rate
	}
	b.RatioCeiling = ratio(b.Relay.Rate, ceiling)
	b.RatioCPU = ratio(b.Relay.CPUPer100k, b.Decode.CPUPer100k)
	return b, nil
}

// best returns the drain with the highest rate.
func best(runs []drainResult) drainResult {
	var b drainResult
	for _, r := range runs {
		if r.Rate > b.Rate {
			b = r
		}
	}
	return b
}

func largeDrain(ctx context.Context, o *options, env *benchEnv, name string, events, perTx int64) (largeResult, error) {
	r := largeResult{Name: name, RowsPerTx: perTx}
	db, err := env.newDB(ctx, "relay")
	if err != nil {
		return r, err
	}
	defer db.drop()
	logf("large: loading %s", name)
	workers := 2
	if perTx >= events {
		workers = 1
	}
	el, err := db.load(ctx, 0, events, int(perTx), workers, o.aggs, o.pad)
	if err != nil {
		return r, fmt.Errorf("load: %w", err)
	}
	r.LoadSeconds = el.Seconds()
	logf("large: relay drains %s", name)
	if r.Relay, err = drainRelay(ctx, o, env, db, "relay", events, "", 0); err != nil {
		return r, err
	}
	return r, nil
}

// waitQuiet samples how busy the machine is while the bench is idle, for up
// to patience until it is quiet, and returns the last sample.
func waitQuiet(ctx context.Context, patience time.Duration) float64 {
	deadline := time.Now().Add(patience)
	for {
		m0 := readMachineCPU()
		select {
		case <-ctx.Done():
			return 0
		case <-time.After(2 * time.Second):
		}
		busy := busyCores(m0, readMachineCPU())
		if busy < 0.25 || time.Now().After(deadline) {
			if busy >= 0.25 {
				logf("WARNING: other processes keep %.2f cores busy: figures will be low and noisy", busy)
			}
			return busy
		}
		logf("waiting for a quiet machine: %.2f cores busy", busy)
	}
}

func ratio(a, b float64) float64 {
	if b == 0 {
		return 0
	}
	return a / b
}

func logf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "%s  %s\n", time.Now().Format("15:04:05"), fmt.Sprintf(format, args...))
}

func gitCommit() string {
	out, err := exec.Command("git", "rev-parse", "--short", "HEAD").Output()
	if err != nil {
		return ""
	}
	s := strings.TrimSpace(string(out))
	if d, err := exec.Command("git", "status", "--porcelain", "--untracked-files=no").Output(); err == nil && len(d) > 0 {
		s += "+dirty"
	}
	return s
}

// writeResults writes the JSON document and, when the load phase ran, its
// markdown tables and SVG plots beside it under the same timestamp.
func writeResults(dir string, res *results) error {
	stamp := time.Now().UTC().Format("2006-01-02T150405Z")
	if dir != "" && res.Load != nil {
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return err
		}
		if err := writeLoadFiles(filepath.Join(dir, stamp), res); err != nil {
			return err
		}
	}
	return writeJSON(dir, stamp, res)
}

func writeJSON(dir, stamp string, res *results) error {
	b, err := json.MarshalIndent(res, "", "  ")
	if err != nil {
		return err
	}
	if dir == "" {
		_, err = os.Stdout.Write(append(b, '\n'))
		return err
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	path := filepath.Join(dir, stamp+".json")
	if err := os.WriteFile(path, append(b, '\n'), 0o644); err != nil {
		return err
	}
	logf("results written to %s", path)
	return nil
}
