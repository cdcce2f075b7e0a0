package main

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"golang.org/x/sync/errgroup"

	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/internal/provision"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/relay"
	"github.com/outbox-relay/outbox-relay/replication"
	"github.com/outbox-relay/outbox-relay/router"
)

// options are the demo's command-line flags.
type options struct {
	registrations int
	wait          time.Duration
	sqlDir        string
	verbose       bool
}

// demo holds the servers, connections and state of one run.
type demo struct {
	out      *printer
	opts     options
	sqlDir   string
	log      *zap.Logger
	cleanups []func() // run in reverse order by cleanup

	pg        *testenv.Postgres
	nats      *testenv.NATS
	appURL    string        // the application database: outbox + registration
	appPool   *pgxpool.Pool //
	cfg       config.Config // the relay's configuration, validated
	nc        *nats.Conn
	js        jetstream.JetStream
	arrivals  *arrivals
	streaming chan struct{} // closed when the relay first streams
	// republished counts the duplicates the demo itself published to the
	// event stream (the reward stage's redelivery).
	republished uint64
	// quietEvents stops the watcher printing events (the group stage
	// writes many).
	quietEvents atomic.Bool
}

func newDemo(out *printer, opts options) *demo {
	return &demo{out: out, opts: opts, arrivals: newArrivals(), streaming: make(chan struct{})}
}

// stage is one step of the foreground flow. Stages run in order while the
// relay and the stream watcher run in the background; the first error ends
// the demo.
type stage struct {
	name string
	run  func(ctx context.Context) error
}

// stages lists the foreground flow. Downstream stages (the reward service)
// go after "wait for events": by then every expected event is in the stream.
func (d *demo) stages() []stage {
	return []stage{
		{"start the relay", d.waitStreaming},
		{"confirm registrations", d.confirmRegistrations},
		{"wait for events", d.waitForEvents},
		{"reward service", d.rewards},
		{"reward service as a group", d.groupRewards},
		{"summary", d.summary},
	}
}

func (d *demo) onCleanup(f func()) { d.cleanups = append(d.cleanups, f) }

func (d *demo) cleanup() {
	for i := len(d.cleanups) - 1; i >= 0; i-- {
		d.cleanups[i]()
	}
	d.cleanups = nil
}

func (d *demo) expect(ev confirmedEvent) { d.arrivals.expect(ev) }

// run executes the whole demo and stops everything it started, whatever
// happens.
func (d *demo) run(ctx context.Context) error {
	defer d.cleanup()
	d.sqlDir = d.opts.sqlDir
	if d.sqlDir == "" {
		dir, err := findSQLDir()
		if err != nil {
			return err
		}
		d.sqlDir = dir
	}
	d.log = newLogger(d.opts.verbose)
	defer func() { _ = d.log.Sync() }()

	if err := d.startServices(ctx); err != nil {
		return err
	}
	d.out.step("creating the application database")
	var err error
	d.appURL, d.appPool, err = d.createDatabase(ctx, "outbox_demo", "outbox.sql", "example_registration.sql")
	if err != nil {
		return err
	}
	rl, cons, err := d.setupRelay(ctx)
	if err != nil {
		return err
	}

	bgCtx, stopBG := context.WithCancel(ctx)
	defer stopBG()
	g, gctx := errgroup.WithContext(bgCtx)
	g.Go(func() error {
		if err := rl.Run(gctx); err != nil {
			return fmt.Errorf("relay: %w", err)
		}
		return nil
	})
	g.Go(func() error { return d.watch(gctx, cons) })

	var fgErr error
	for _, s := range d.stages() {
		if fgErr = s.run(gctx); fgErr != nil {
			fgErr = fmt.Errorf("%s: %w", s.name, fgErr)
			break
		}
	}
	d.out.step("shutting down")
	stopBG()
	bgErr := g.Wait()
	d.out.detail("relay stopped after its final standby status update; stream watcher stopped")
	switch {
	case ctx.Err() != nil:
		return ctx.Err()
	case bgErr != nil:
		return bgErr // the cause; the foreground then only saw its context end
	default:
		return fgErr
	}
}

// setupRelay builds the relay's configuration the way outbox-relay run does
// (config defaults: table public.outbox, subjects
// outbox.{aggregate_type}.{aggregate_id}, streams OUTBOX and OUTBOX_DLQ),
// creates the publication, slot and streams, and returns the relay and an
// ordered consumer on the event stream.
func (d *demo) setupRelay(ctx context.Context) (*relay.Relay, jetstream.Consumer, error) {
	cfg := config.Default()
	cfg.Postgres.URL = d.appURL
	cfg.NATS.URL = d.nats.URL
	// Confirm often, so the summary shows the slot caught up.
	cfg.Postgres.StatusInterval = 200 * time.Millisecond
	cfg.Router.Tables = []router.TableConfig{{Table: "public.outbox"}}
	cfg.NATS.Partitions = demoPartitions // for the group stage
	cfg.HTTP.Listen = ""
	if err := cfg.Validate(); err != nil {
		return nil, nil, err
	}
	d.cfg = cfg

	d.out.step("setting up the relay (what `outbox-relay setup` does)")
	rep, err := replication.Setup(ctx, cfg.Replication())
	if err != nil {
		return nil, nil, err
	}
	for _, a := range rep.Actions {
		d.out.detail("%s", a)
	}
	nc, err := nats.Connect(cfg.NATS.URL, nats.Name("outbox-demo"), nats.MaxReconnects(-1))
	if err != nil {
		return nil, nil, fmt.Errorf("connect to nats: %w", err)
	}
	d.onCleanup(nc.Close)
	d.nc = nc
	if d.js, err = jetstream.New(nc); err != nil {
		return nil, nil, err
	}
	// Create the streams here rather than leave it to the relay, so the
	// watcher can attach before the first event.
	events, dlq := cfg.Streams()
	durableNote := false
	for _, spec := range []provision.StreamSpec{events, dlq} {
		rep, err := provision.EnsureStream(ctx, d.js, spec, true)
		if err != nil {
			return nil, nil, err
		}
		d.out.detail("stream %s on subjects %s (duplicate window %s)", spec.Name, strings.Join(spec.Subjects, ", "), spec.Duplicates)
		if !rep.Durable {
			durableNote = true
		}
	}
	if durableNote {
		d.out.detail("one NATS server, one replica: the relay warns (on stderr) that such acks are not durable; production streams use 3 replicas")
	}
	var once sync.Once
	rl, err := relay.New(cfg.Relay(), nc, relay.WithLogger(d.log), relay.WithReadiness(func(streaming bool) {
		if streaming {
			once.Do(func() { close(d.streaming) })
		}
	}))
	if err != nil {
		return nil, nil, err
	}
	cons, err := d.js.OrderedConsumer(ctx, cfg.NATS.Stream, jetstream.OrderedConsumerConfig{DeliverPolicy: jetstream.DeliverAllPolicy})
	if err != nil {
		return nil, nil, fmt.Errorf("ordered consumer on %s: %w", cfg.NATS.Stream, err)
	}
	return rl, cons, nil
}

// waitStreaming waits until the relay's replication stream is open, so that
// its start-up output comes before the registrations.
func (d *demo) waitStreaming(ctx context.Context) error {
	select {
	case <-d.streaming:
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(d.opts.wait):
		return fmt.Errorf("the relay did not start streaming within %s (run with -v to see its log)", d.opts.wait)
	}
	d.out.step("relay streaming: public.outbox -> stream %s, slot %s, publication %s", d.cfg.NATS.Stream, d.cfg.Postgres.Slot, d.cfg.Postgres.Publication)
	return nil
}

func (d *demo) waitForEvents(ctx context.Context) error {
	start := time.Now()
	if err := d.arrivals.wait(ctx, d.opts.wait); err != nil {
		return err
	}
	d.out.step("all %d expected events arrived (%s after the last confirm)", len(d.arrivals.expected), time.Since(start).Round(time.Millisecond))
	return nil
}

// summary checks that the stream holds exactly the expected events (the
// zero-row confirm must not have produced one) and shows the slot's
// confirmed position catching up with the published commits.
func (d *demo) summary(ctx context.Context) error {
	d.out.step("summary")
	want := uint64(len(d.arrivals.expected)) + d.republished
	events, err := streamMsgs(ctx, d.js, d.cfg.NATS.Stream)
	if err != nil {
		return err
	}
	dead, err := streamMsgs(ctx, d.js, d.cfg.NATS.DeadLetterStream)
	if err != nil {
		return err
	}
	if d.republished > 0 {
		d.out.detail("stream %s: %d messages (expected %d: %d events from the outbox and %d duplicate the demo published)", d.cfg.NATS.Stream, events, want, len(d.arrivals.expected), d.republished)
	} else {
		d.out.detail("stream %s: %d events (expected %d)", d.cfg.NATS.Stream, events, want)
	}
	d.out.detail("stream %s: %d dead letters", d.cfg.NATS.DeadLetterStream, dead)

	// The relay confirms a commit only after JetStream acknowledged its
	// events; wait (briefly) for the confirmation to reach the server.
	d.arrivals.mu.Lock()
	target := d.arrivals.maxLSN
	d.arrivals.mu.Unlock()
	var st replication.SlotStatus
	caughtUp := poll(ctx, 10*time.Second, func() bool {
		st, err = replication.Status(ctx, d.appURL, d.cfg.Postgres.Slot)
		return err == nil && st.ConfirmedFlushLSN >= target
	})
	if err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	current := st.ConfirmedFlushLSN + replication.LSN(st.LagBytes)
	d.out.detail("slot %s: confirmed_flush_lsn %s, newest published commit %s, current WAL %s",
		d.cfg.Postgres.Slot, st.ConfirmedFlushLSN, target, current)
	if caughtUp {
		d.out.detail("the slot confirmed every published commit: a restart would not send them again")
		if st.LagBytes > 0 {
			d.out.detail("the %d bytes of WAL after the confirmed position hold no outbox rows (e.g. the rewards database); an idle relay confirms them from keepalives", st.LagBytes)
		}
	} else {
		d.out.detail("the slot has not confirmed the newest published commit yet: a restart would send it again (JetStream drops the duplicate by Nats-Msg-Id)")
	}
	switch {
	case events < want:
		return fmt.Errorf("%w: stream %s holds %d events, want %d", errMissingEvents, d.cfg.NATS.Stream, events, want)
	case events > want:
		return fmt.Errorf("stream %s holds %d events, want %d: an event was written that the demo did not expect (the zero-row confirm?)", d.cfg.NATS.Stream, events, want)
	case dead != 0:
		return fmt.Errorf("stream %s holds %d dead letters, want 0: the relay could not route an event (see its reason header)", d.cfg.NATS.DeadLetterStream, dead)
	}
	return nil
}

func streamMsgs(ctx context.Context, js jetstream.JetStream, name string) (uint64, error) {
	s, err := js.Stream(ctx, name)
	if err != nil {
		return 0, fmt.Errorf("stream %s: %w", name, err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		return 0, fmt.Errorf("stream %s info: %w", name, err)
	}
	return info.State.Msgs, nil
}

// newLogger logs the relay for people, to stderr, at warn level (info with
// -v), so that its output does not drown the demo's.
func newLogger(verbose bool) *zap.Logger {
	zc := zap.NewDevelopmentConfig()
	zc.EncoderConfig.EncodeLevel = zapcore.CapitalLevelEncoder
	zc.DisableStacktrace = true
	zc.DisableCaller = true
	zc.Level = zap.NewAtomicLevelAt(zap.WarnLevel)
	if verbose {
		zc.Level = zap.NewAtomicLevelAt(zap.InfoLevel)
	}
	l, err := zc.Build()
	if err != nil {
		return zap.NewNop()
	}
	return l
}
