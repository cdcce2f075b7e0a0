package relay

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/trace"
	"go.uber.org/zap"
	"golang.org/x/sync/errgroup"

	"github.com/outbox-relay/outbox-relay/internal/backoff"
	"github.com/outbox-relay/outbox-relay/internal/provision"
	"github.com/outbox-relay/outbox-relay/publisher"
	"github.com/outbox-relay/outbox-relay/replication"
	"github.com/outbox-relay/outbox-relay/router"
	"github.com/outbox-relay/outbox-relay/watermark"
)

// Config configures a Relay.
type Config struct {
	Replication replication.Config
	Router      router.Config
	Publisher   publisher.Config
	// Stream and DeadLetterStream are checked (and created when
	// CreateStreams is set) before streaming starts.
	Stream           provision.StreamSpec
	DeadLetterStream provision.StreamSpec
	CreateStreams    bool
	// BatchPublish is "auto" (the default: fast-ingest batches when the
	// event stream allows them), "on" (require them) or "off" (publish per
	// aggregate).
	BatchPublish string
	// ShutdownTimeout bounds the wait for in-flight acks on shutdown.
	// Default 5s.
	ShutdownTimeout time.Duration
	// ReconnectMin and ReconnectMax bound the backoff between attempts to
	// (re)start streaming. Defaults 500ms and 30s.
	ReconnectMin, ReconnectMax time.Duration
	// MaxUnsettledTxs and MaxUnsettledBytes bound the tail behind the
	// watermark: transactions read and not yet confirmable, and the WAL
	// from the watermark to the newest of them. At either bound the
	// pipeline stops reading the WAL until the watermark moves. Without
	// it, one message held on one key (a dead-letter stream that is
	// missing, a per-subject limit with discard new) lets everything
	// behind it be published while nothing is confirmed, and the tracker,
	// the WAL the slot retains and what a restart re-sends (perhaps after
	// the duplicate window) grow without limit. Defaults 100,000 and 1 GiB.
	MaxUnsettledTxs   int
	MaxUnsettledBytes int64
	// StallWarning is how long the watermark may stand still with messages
	// unsettled before the relay logs the message holding it and reports
	// it in WatermarkStall. Default 1m.
	StallWarning time.Duration
	// PublicationCheck is how often the publication is checked while
	// streaming (replication.CheckPublication; it is also checked before
	// every session starts). A wrong one makes the relay not ready until
	// it is fixed. Default 1m.
	PublicationCheck time.Duration
}

// Defaults of Config, which the configuration file's defaults reuse.
const (
	DefaultMaxUnsettledTxs   = 100_000
	DefaultMaxUnsettledBytes = 1 << 30
	DefaultStallWarning      = time.Minute
	DefaultPublicationCheck  = time.Minute
	DefaultShutdownTimeout   = 5 * time.Second
	DefaultReconnectMin      = 500 * time.Millisecond
	DefaultReconnectMax      = 30 * time.Second
)

// The smallest values the configuration file accepts: below them the
// relay pauses intake (MaxUnsettledBytes), warns (StallWarning) or queries
// the catalog (PublicationCheck) so often that it gets in its own way.
const (
	MinMaxUnsettledBytes = 1 << 20
	MinStallWarning      = time.Second
	MinPublicationCheck  = time.Second
)

// Relay streams an outbox to JetStream.
type Relay struct {
	cfg    Config
	nc     *nats.Conn
	js     jetstream.JetStream
	log    *zap.Logger
	obs    Observer
	router *router.Router
	// pub publishes per aggregate: events when they are not batched,
	// dead-letter records, and the message a failed batch isolates.
	pub *publisher.Publisher
	// batch publishes events as fast-ingest batches; nil with
	// BatchPublish "off".
	batch *publisher.Batch
	// events is where routed events go: batch or pub, chosen when the
	// event stream's settings are known and changed back to pub when the
	// stream stops allowing batches.
	events  atomic.Pointer[eventPublisher]
	tracker atomic.Pointer[watermark.Tracker]
	ready   func(bool)
	durable atomic.Int32 // 1 when the event stream's acks are durable, 0 when not, -1 unknown
	// paused is set while the pipeline waits for the unsettled tail to
	// shrink below its bounds; stall is the watcher's latest verdict.
	paused atomic.Bool
	stall  atomic.Pointer[Stall]
	// backfillIncomplete is set when the slot's backfill was interrupted.
	backfillIncomplete atomic.Bool
	// streaming is set while a replication session runs; pubProblem holds
	// what the last publication check found wrong (nil when none). The
	// relay is ready when it streams with a right publication.
	streaming  atomic.Bool
	pubProblem atomic.Pointer[error]
	// streamProblem is what the last check of the streams while running
	// found wrong (streams.go); nil when none.
	streamProblem atomic.Pointer[error]
	// streamsUnread says the stream checks could not read the streams
	// for streamsUnreadChecks checks in a row (streams.go); nil when read.
	streamsUnread atomic.Pointer[error]
	readyMu       sync.Mutex
	// guard holds what the publication checks let the stream confirm;
	// gapLock is the slot's backfill lock while a publication gap waits to
	// be filled (owned by the stream goroutine).
	guard   *pubGuard
	gapLock *replication.BackfillGuard
	// checkFailure is why the last publication check could not run; nil
	// when it ran (PublicationCheckFailure).
	checkFailure atomic.Pointer[error]
	// afterBackfillCheck, when set (by tests, before Run), runs between
	// the backfill check and the start of a session.
	afterBackfillCheck func()
	// endSession ends the running replication session with a cause; nil
	// between sessions.
	endSession atomic.Pointer[context.CancelCauseFunc]
	// tracer makes relay spans when set (tracing.go); each session's
	// pipeline owns its open batch span.
	tracer trace.Tracer
}

// ErrInvalidOption is wrapped by the error New returns for a bad Option.
var ErrInvalidOption = errors.New("invalid relay option")

// Option configures a Relay; New fails with an error wrapping
// ErrInvalidOption when one is invalid.
type Option func(*options) error

type options struct {
	log    *zap.Logger
	obs    Observer
	ready  func(bool)
	tracer trace.Tracer // nil: no relay spans (tracing.go)
}

// WithLogger sets the logger (default: no logging); it must not be nil.
func WithLogger(l *zap.Logger) Option {
	return func(o *options) error {
		if l == nil {
			return fmt.Errorf("%w: nil logger", ErrInvalidOption)
		}
		o.log = l
		return nil
	}
}

// WithObserver sets the metrics observer (default: none); it must not be
// nil.
func WithObserver(obs Observer) Option {
	return func(o *options) error {
		if obs == nil {
			return fmt.Errorf("%w: nil observer", ErrInvalidOption)
		}
		o.obs = obs
		return nil
	}
}

// WithReadiness registers a callback told whether the relay is streaming
// (default: none); it must not be nil.
func WithReadiness(f func(bool)) Option {
	return func(o *options) error {
		if f == nil {
			return fmt.Errorf("%w: nil readiness callback", ErrInvalidOption)
		}
		o.ready = f
		return nil
	}
}

// New builds a relay publishing through nc. Run starts it. Options:
// WithLogger, WithObserver, WithReadiness, WithTracerProvider.
func New(cfg Config, nc *nats.Conn, opts ...Option) (*Relay, error) {
	o := options{log: zap.NewNop(), obs: NopObserver{}, ready: func(bool) {}}
	for _, opt := range opts {
		if err := opt(&o); err != nil {
			return nil, err
		}
	}
	if cfg.ShutdownTimeout <= 0 {
		cfg.ShutdownTimeout = DefaultShutdownTimeout
	}
	if cfg.ReconnectMin <= 0 {
		cfg.ReconnectMin = DefaultReconnectMin
	}
	if cfg.ReconnectMax < cfg.ReconnectMin {
		cfg.ReconnectMax = max(DefaultReconnectMax, cfg.ReconnectMin)
	}
	if len(cfg.Router.Messages) > 0 {
		cfg.Replication.Messages = true
	}
	if cfg.MaxUnsettledTxs <= 0 {
		cfg.MaxUnsettledTxs = DefaultMaxUnsettledTxs
	}
	if cfg.MaxUnsettledBytes <= 0 {
		cfg.MaxUnsettledBytes = DefaultMaxUnsettledBytes
	}
	if cfg.StallWarning <= 0 {
		cfg.StallWarning = DefaultStallWarning
	}
	if cfg.PublicationCheck <= 0 {
		cfg.PublicationCheck = DefaultPublicationCheck
	}
	r := &Relay{cfg: cfg, nc: nc, log: o.log, obs: o.obs, ready: o.ready, tracer: o.tracer, guard: &pubGuard{cfg: cfg.Replication, log: o.log}}
	r.durable.Store(-1)
	rt, err := router.New(cfg.Router, router.WithMaxPayload(int(nc.MaxPayload())))
	if err != nil {
		return nil, err
	}
	r.router = rt
	js, err := jetstream.New(nc)
	if err != nil {
		return nil, fmt.Errorf("jetstream: %w", err)
	}
	r.js = js
	pub, err := publisher.New(nc, cfg.Publisher, publisher.WithLogger(r.log.Named("publisher")), publisher.WithObserver(r.obs),
		publisher.WithStreamLookup(streamLookup(js, cfg.Stream.Name)), publisher.WithExpectedStream(expectedStream(cfg)))
	if err != nil {
		return nil, err
	}
	r.pub = pub
	var events eventPublisher = pub
	r.events.Store(&events)
	if cfg.BatchPublish != "off" {
		b, err := publisher.NewBatch(nc, pub, cfg.Publisher, publisher.BatchConfig{Stream: cfg.Stream.Name},
			publisher.WithLogger(r.log.Named("batch")), publisher.WithObserver(r.obs))
		if err != nil {
			return nil, err
		}
		r.batch = b
	}
	r.tracker.Store(watermark.NewTracker(0))
	return r, nil
}

// eventPublisher takes routed events: a per-aggregate Publisher or a Batch.
type eventPublisher interface {
	publishTarget
	Drain(ctx context.Context) error
	InFlight() int
}

func (r *Relay) eventPublisher() eventPublisher { return *r.events.Load() }

// InFlight returns the number of messages handed to the publishers and not
// yet acknowledged.
func (r *Relay) InFlight() int {
	n := r.pub.InFlight()
	if r.Batched() {
		n += r.batch.InFlight()
	}
	return n
}

// Batched reports whether events are published in fast-ingest batches.
func (r *Relay) Batched() bool {
	_, ok := r.eventPublisher().(*publisher.Batch)
	return ok
}

// expectedStream maps a subject to the stream meant to store it: the
// dead-letter stream for dead-letter subjects, the event stream otherwise.
// An ack from any other stream is not taken as one.
func expectedStream(cfg Config) func(subject string) string {
	prefix := cfg.Router.DeadLetterSubject
	if prefix == "" {
		prefix = router.DefaultDeadLetterSubject
	}
	prefix += "."
	return func(subject string) string {
		if strings.HasPrefix(subject, prefix) {
			return cfg.DeadLetterStream.Name
		}
		return cfg.Stream.Name
	}
}

// streamLookup tells a subject bound to no stream (a permanent rejection:
// dead-letter it) from a missing event stream (an outage: keep retrying and
// say so). Only when the configured stream exists and still no stream
// matches the subject is the message unroutable.
func streamLookup(js jetstream.JetStream, stream string) func(ctx context.Context, subject string) error {
	return func(ctx context.Context, subject string) error {
		if _, err := js.Stream(ctx, stream); err != nil {
			if errors.Is(err, jetstream.ErrStreamNotFound) {
				return fmt.Errorf("event stream %s does not exist: recreate it (outbox-relay setup) — the relay retries and the slot waits", stream)
			}
			return fmt.Errorf("look up event stream %s: %w", stream, err)
		}
		_, err := js.StreamNameBySubject(ctx, subject)
		if errors.Is(err, jetstream.ErrStreamNotFound) {
			return publisher.ErrNoStream
		}
		return err
	}
}

// StreamDurable returns 1 when the event stream's acks survive a server
// crash (file storage, ≥3 replicas), 0 when not, -1 before the check.
func (r *Relay) StreamDurable() int { return int(r.durable.Load()) }

// Tracker returns the ack tracker, for metrics.
func (r *Relay) Tracker() *watermark.Tracker { return r.tracker.Load() }

// Run streams until ctx ends, then waits (up to ShutdownTimeout) for
// in-flight acks, confirms the final watermark and returns nil. It returns
// an error only for conditions that need an operator, including a
// publisher that stopped for good (publisher.ErrClosed: the NATS
// connection closed); it returns after every goroutine it started.
func (r *Relay) Run(ctx context.Context) error {
	if err := r.checkStreams(ctx); err != nil {
		return err
	}
	// The publishers outlive ctx: a graceful stop drains them before it
	// confirms the final watermark.
	pubCtx, stopPub := context.WithCancel(context.Background())
	defer stopPub()
	g, gctx := errgroup.WithContext(pubCtx)
	g.Go(func() error { return publisherStopped(r.pub.Run(gctx)) })
	if r.batch != nil {
		g.Go(func() error {
			err := r.batch.Run(gctx)
			if errors.Is(err, publisher.ErrBatchDisabled) {
				// The pipeline learns it from TryPublish, but one that
				// handed every message over already would wait for acks
				// that never come: end the session, so that stream
				// switches to per-aggregate publishing and the next one
				// re-sends what the batch did not confirm.
				if end := r.endSession.Load(); end != nil {
					(*end)(err)
				}
			}
			return publisherStopped(err)
		})
	}
	g.Go(func() error { r.watchStall(gctx); return nil })
	g.Go(func() error { r.watchPublication(gctx); return nil })
	g.Go(func() error { r.watchStreams(gctx); return nil })
	// A publisher that stops for good (its NATS connection closed) ends
	// streaming too, and Run returns why.
	sctx, stopStream := context.WithCancel(ctx)
	defer stopStream()
	stopAfter := context.AfterFunc(gctx, stopStream)
	err := r.stream(sctx)
	r.releaseGapLock()
	stopAfter()
	stopPub()
	gerr := g.Wait()
	r.guard.close() // after the watcher, its other user, returned
	if r.batch != nil {
		_ = r.batch.Close()
	}
	_ = r.pub.Close()
	if err != nil {
		return err
	}
	return gerr
}

// publisherStopped is the error a publisher's Run ending means for the
// relay: none when Run stopped it, or when the batch publisher found that
// the stream no longer allows batches (stream then publishes per aggregate).
func publisherStopped(err error) error {
	if errors.Is(err, context.Canceled) || errors.Is(err, publisher.ErrBatchDisabled) {
		return nil
	}
	return err
}

func (r *Relay) checkStreams(ctx context.Context) error {
	reps, err := ensureStreams(ctx, r.js, r.cfg, r.log)
	if err != nil {
		return err
	}
	for _, rep := range reps {
		for _, w := range rep.Warnings {
			r.log.Warn(w, zap.String("stream", rep.Info.Config.Name))
		}
	}
	durable, batched := reps[0].Durable, reps[0].Info.Config.AllowBatchPublish
	switch {
	case r.batch == nil:
	case batched:
		var events eventPublisher = r.batch
		r.events.Store(&events)
		r.log.Info("publishing events in fast-ingest batches", zap.String("stream", r.cfg.Stream.Name))
	case r.cfg.BatchPublish == "on":
		return fmt.Errorf("stream %s does not allow batched publishing and nats.batch_publish is on: set allow_batched on the stream (nats-server 2.14 or later) or set nats.batch_publish to auto", r.cfg.Stream.Name)
	default:
		r.log.Info("publishing events per aggregate: the event stream does not allow batched publishing (set allow_batched on it, nats-server 2.14 or later, for fast-ingest batches)",
			zap.String("stream", r.cfg.Stream.Name))
	}
	if durable {
		r.durable.Store(1)
	} else {
		r.durable.Store(0)
	}
	return nil
}

// ensureStreams checks (and with CreateStreams creates) the event and
// dead-letter streams and returns their reports, events first; a created
// stream is logged, the warnings are the caller's.
func ensureStreams(ctx context.Context, js jetstream.JetStream, cfg Config, log *zap.Logger) ([2]*provision.StreamReport, error) {
	var reps [2]*provision.StreamReport
	for i, spec := range []provision.StreamSpec{cfg.Stream, cfg.DeadLetterStream} {
		rep, err := provision.EnsureStream(ctx, js, spec, cfg.CreateStreams)
		if err != nil {
			return reps, err
		}
		if rep.Created {
			log.Info("created stream", zap.String("stream", spec.Name), zap.Strings("subjects", spec.Subjects))
		}
		reps[i] = rep
	}
	return reps, nil
}

// stream (re)starts the replication stream until ctx ends or a permanent
// error occurs.
func (r *Relay) stream(ctx context.Context) error {
	attempt := 0
	var orphan uint32 // our walsender after we declared its connection dead
	var standby standbyLog
	for {
		streamed, err := r.streamOnce(ctx, &orphan)
		r.streaming.Store(false)
		r.setReady()
		if ctx.Err() != nil {
			return nil
		}
		if errors.Is(err, publisher.ErrBatchDisabled) {
			// The stream stopped allowing batches: what the batch did not
			// confirm is re-sent per aggregate by the next session.
			var events eventPublisher = r.pub
			r.events.Store(&events)
			r.log.Warn("event stream no longer allows batched publishing: publishing per aggregate from now on", zap.Error(err))
			continue
		}
		// A publication gone wrong while the relay ran is waited out.
		if replication.IsPermanent(err) && !errors.Is(err, ErrPublicationGap) || errors.Is(err, publisher.ErrClosed) {
			return err
		}
		if errors.Is(err, replication.ErrSlotInUse) && orphan != 0 {
			// The slot may be held by our own previous walsender, which the
			// server keeps until its wal_sender_timeout: end it and retry.
			tctx, cancel := context.WithTimeout(ctx, 10*time.Second)
			ended, terr := replication.TerminateOrphan(tctx, r.cfg.Replication.URL, r.cfg.Replication.Slot, orphan)
			cancel()
			orphan = 0
			if terr != nil {
				r.log.Warn("could not end our orphaned walsender; waiting for the server's wal_sender_timeout", zap.Error(terr))
			} else if ended {
				r.log.Info("ended our orphaned walsender that still held the slot")
				continue
			}
		}
		if streamed {
			attempt = 0
			standby.reset()
		}
		attempt++
		wait := reconnectWait(r.cfg, err, attempt)
		switch {
		case errors.Is(err, ErrPublicationGap):
			// Waiting for an operator's fix, noticed within a check
			// interval: no restart, and logged when the verdict changes
			// (recordPublication).
			wait = min(wait, r.checkInterval())
			r.log.Debug("waiting for the publication to be fixed", zap.Duration("retry_in", wait), zap.Error(err))
		case errors.Is(err, replication.ErrSlotInUse) || errors.Is(err, replication.ErrBackfillInProgress):
			// A standby: poll often, so takeover is quick.
			wait = min(wait, 2*time.Second)
			standby.retry(r.log, time.Now(), wait, err)
			r.obs.StandingBy()
		default:
			standby.reset()
			r.log.Warn("replication interrupted; reconnecting", zap.Duration("retry_in", wait), zap.Int("attempt", attempt), zap.Error(err))
			r.obs.Reconnected()
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(wait):
		}
	}
}

// reconnectWait is how long the relay waits before its attempt-th
// reconnection after err: a jittered backoff between cfg.ReconnectMin and
// cfg.ReconnectMax, capped at connectRetryMax when no host took the
// session or its server went away (a primary down, a standby not yet
// promoted). Asking again then costs one connection attempt, and a backoff
// grown during the outage would delay streaming long after a promotion.
func reconnectWait(cfg Config, err error, attempt int) time.Duration {
	wait := backoff.Jitter(backoff.Step(cfg.ReconnectMin, cfg.ReconnectMax, attempt))
	if replication.IsConnectFailure(err) || replication.IsServerGone(err) {
		wait = min(wait, max(cfg.ReconnectMin, connectRetryMax))
	}
	return wait
}

// connectRetryMax caps the wait after a failed connection attempt.
const connectRetryMax = time.Second

// open starts streaming from the slot once no backfill of it is running or
// unfinished: a standby must not overtake a backfill (the walsender lets go
// of a new slot while its snapshot is still being published), and nobody
// may stream past an interrupted one.
func (r *Relay) open(ctx context.Context, tracker *watermark.Tracker) (*replication.Stream, error) {
	// Held until the session started: a backfill must not create the slot
	// and publish its snapshot in between (replication.HoldBackfill).
	hold, _, err := replication.HoldBackfill(ctx, r.cfg.Replication)
	r.backfillIncomplete.Store(errors.Is(err, replication.ErrBackfillIncomplete))
	if err != nil {
		return nil, err
	}
	defer hold.Close(context.Background())
	if r.afterBackfillCheck != nil {
		r.afterBackfillCheck()
	}
	return replication.Open(ctx, r.cfg.Replication, tracker, replication.WithLogger(r.log.Named("replication")),
		replication.WithConfirmLimit(r.guard.limit), replication.WithRelationHook(r.relationChanged))
}

// BackfillIncomplete reports whether the relay found the slot's backfill
// interrupted (and so refuses to stream from it).
func (r *Relay) BackfillIncomplete() bool { return r.backfillIncomplete.Load() }

// streamOnce runs one replication session. It reports whether streaming
// started, so the reconnect backoff resets after a session that worked.
func (r *Relay) streamOnce(ctx context.Context, orphan *uint32) (bool, error) {
	// Messages still in flight from a previous session settle in the old
	// tracker; the server re-sends everything after the confirmed LSN, and
	// the publisher's per-key queue keeps those re-sends behind them.
	tracker := watermark.NewTracker(0)
	r.tracker.Store(tracker)
	// Whatever postgres.auto_setup says: a table missing from the
	// publication would be relayed as nothing, the slot confirming past it.
	// After a gap this also publishes what the publication withheld, which
	// may take longer than opening a session.
	if err := r.preparePublication(ctx); err != nil {
		return false, err
	}
	// Connecting and starting replication get a deadline of their own: a
	// blackholed network would otherwise hang a reconnect forever.
	openTimeout := r.cfg.Replication.ReceiveTimeout
	if openTimeout <= 0 {
		openTimeout = 30 * time.Second
	}
	octx, cancel := context.WithTimeout(ctx, openTimeout)
	st, err := r.open(octx, tracker)
	cancel()
	if err != nil {
		return false, err
	}
	// The unsettled WAL is measured from here (the slot's confirmed
	// position: nothing is confirmed yet), not from 0/0.
	tracker.Raise(st.Confirmed())
	r.streaming.Store(true)
	r.setReady()
	p := pipeline{r: r, st: st, events: func() publishTarget { return r.eventPublisher() }, deadLetters: r.pub,
		tracker: tracker, msgs: newMessagePrefixes(r.cfg.Router.MessagePrefixes()), spans: newBatchSpans(r.tracer, r.cfg.Stream.Name, st.WakeAt, st.Pending, st.Behind)}
	sctx, end := context.WithCancelCause(ctx)
	defer end(nil)
	r.endSession.Store(&end)
	defer r.endSession.Store(nil)
	err = p.run(sctx)
	if ctx.Err() == nil && sctx.Err() != nil {
		err = context.Cause(sctx)
	}
	if ctx.Err() != nil {
		// Graceful stop: wait for the acks, then confirm them.
		dctx, cancel := context.WithTimeout(context.Background(), r.cfg.ShutdownTimeout)
		derr := r.eventPublisher().Drain(dctx)
		if derr == nil {
			derr = r.pub.Drain(dctx)
		}
		if derr != nil {
			r.log.Warn("shutdown with unacknowledged messages; they are re-sent after restart", zap.Error(derr))
		}
		cancel()
		cctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		if cerr := st.Close(cctx); cerr != nil {
			r.log.Warn("final status update", zap.Error(cerr))
		} else {
			r.log.Info("stopped", zap.Stringer("confirmed_lsn", st.Confirmed()))
		}
		cancel()
		return true, nil
	}
	if undecodable(err) {
		r.guard.undecodableStretch()
		err = fmt.Errorf("%w: the slot cannot decode WAL written while the publication did not exist (dropped and created again): publishing the rows the event stream lacks, then advancing the slot past the stretch: %w", ErrPublicationGap, err)
	}
	if errors.Is(err, ErrPublicationGap) {
		// Before the slot is let go: a standby must not take it and stream
		// past the withheld rows.
		if lerr := r.holdGapLock(ctx); lerr != nil {
			r.log.Warn("could not hold standbys back until the publication gap is filled", zap.Error(lerr))
		}
	}
	if errors.Is(err, replication.ErrServerSilent) {
		// The server may not have noticed that this connection is dead.
		*orphan = st.BackendPID()
	}
	cctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	_ = st.Close(cctx)
	cancel()
	return true, err
}

// undecodable reports whether a session ended because pgoutput did not
// find the publication at a position it decoded (SQLSTATE 42704 from the
// stream): the publication was dropped, and perhaps created again.
func undecodable(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == pgerrcode.UndefinedObject
}
