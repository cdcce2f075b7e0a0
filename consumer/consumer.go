package consumer

import (
	"context"
	"fmt"
	"hash/maphash"
	"strconv"
	"strings"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/trace"
	"go.uber.org/zap"

	"github.com/outbox-relay/outbox-relay/consumer/internal/group"
	"github.com/outbox-relay/outbox-relay/consumer/internal/observe"
	"github.com/outbox-relay/outbox-relay/contract"
)

// DB is what the consumer needs of a database: *pgxpool.Pool implements it.
type DB interface {
	Begin(ctx context.Context) (pgx.Tx, error)
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Log field names.
const (
	fieldConsumer  = "consumer"
	fieldEventID   = "event_id"
	fieldSeq       = "stream_seq"
	fieldClass     = "class"
	fieldAttempt   = "attempt"
	fieldDelay     = "delay"
	fieldDeadID    = "dead_letter_id"
	fieldAggregate = "aggregate"
)

// Consumer applies the events of a JetStream stream to a PostgreSQL database
// idempotently. Create it with [New] and start it with [Run].
type Consumer struct {
	cfg         Config
	db          DB
	js          jetstream.JetStream
	h           Handler
	log         *zap.Logger
	met         *metrics
	afterCommit func(*Message)
	tracer      trace.Tracer // nil: no spans (tracing.go)
	wanted      map[string]bool
	reg         prometheus.Registerer // for a group member's metrics
	running     atomic.Bool           // a Consumer runs once at a time; a run's state is its engine's
}

// New returns a consumer of cfg.Stream that applies each event with h inside
// a transaction on db. It validates cfg (filling defaults, see [Config]) and
// starts nothing; call Run. Options: [WithLogger] (default zap.NewNop()),
// [WithRegisterer] (default a private registry), [WithAfterCommit],
// [WithTracerProvider] (default no spans).
func New(db DB, js jetstream.JetStream, cfg Config, h Handler, opts ...Option) (*Consumer, error) {
	if db == nil || js == nil || h == nil {
		return nil, fmt.Errorf("%w: database, JetStream context and handler are required", ErrInvalidConfig)
	}
	cfg.FilterSubjects = append([]string(nil), cfg.FilterSubjects...)
	cfg.setDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	o := options{logger: zap.NewNop(), registerer: prometheus.NewRegistry()}
	for _, opt := range opts {
		if err := opt(&o); err != nil {
			return nil, err
		}
	}
	met, err := newMetrics(o.registerer, cfg.Name, cfg.Owner)
	if err != nil {
		return nil, err
	}
	if err := group.RegisterMetrics(o.registerer); err != nil { // known before a group runs
		return nil, err
	}
	c := &Consumer{
		cfg:         cfg,
		db:          db,
		js:          js,
		h:           h,
		log:         o.logger.Named("consumer").With(zap.String(fieldConsumer, cfg.Name)),
		met:         met,
		afterCommit: o.afterCommit,
		reg:         o.registerer,
	}
	if o.tracerProvider != nil {
		c.tracer = o.tracerProvider.Tracer(TracerName)
	}
	if len(cfg.EventTypes) > 0 {
		c.wanted = make(map[string]bool, len(cfg.EventTypes))
		for _, t := range cfg.EventTypes {
			c.wanted[t] = true
		}
	}
	return c, nil
}

// Config returns the consumer's configuration with defaults filled in.
func (c *Consumer) Config() Config { return c.cfg }

// Run checks the schema, creates or updates the durable consumer and applies
// messages until ctx is cancelled (it then returns nil) or the durable
// consumer can no longer be used. A ctx cancelled before that set-up is
// done makes Run return an error wrapping ctx's. It returns only after every goroutine it
// started has returned. A Consumer runs at most once at a time.
func (c *Consumer) Run(ctx context.Context) error {
	if !c.running.CompareAndSwap(false, true) {
		return fmt.Errorf("consumer %s is already running", c.cfg.Name)
	}
	defer c.running.Store(false)
	if err := CheckSchema(ctx, c.db); err != nil {
		return err
	}
	if err := Migrate(ctx, c.db); err != nil {
		return err
	}
	strm, err := c.js.Stream(ctx, c.cfg.Stream)
	if err != nil {
		return fmt.Errorf("look up stream %s: %w", c.cfg.Stream, err)
	}
	e := &engine{c: c, src: c.newSource(strm)}
	return e.run(ctx)
}

// consumerConfig is the durable consumer the library needs: explicit acks,
// the ack wait and max ack pending its workers are sized for, and no
// delivery limit, because the library dead-letters by itself and a message
// JetStream stopped delivering would be dropped without a trace.
func (c *Consumer) consumerConfig() jetstream.ConsumerConfig {
	return jetstream.ConsumerConfig{
		Durable:        c.cfg.Name,
		Description:    "outbox-relay idempotent consumer",
		AckPolicy:      jetstream.AckExplicitPolicy,
		AckWait:        c.cfg.AckWait,
		MaxAckPending:  c.cfg.MaxAckPending,
		MaxDeliver:     -1,
		DeliverPolicy:  jetstream.DeliverAllPolicy,
		FilterSubjects: c.cfg.FilterSubjects,
	}
}

// item is one message on its way through a worker: a delivery from the
// stream, or a dead letter being replayed.
type item struct {
	msg      jetstream.Msg // nil for a replay
	m        Message
	err      error // the message breaks the header contract
	key      string
	hash     []byte
	replay   *replayRequest
	received time.Time
	// rejected: the handler rejected this delivery in an attempt that was
	// rolled back (a batch's). A later attempt records the rejection
	// instead of calling the handler again, as a message alone is redone;
	// processBatch clears it when an earlier message of the aggregate, whose
	// uncommitted effect the handler saw, is still to be applied.
	rejected *RejectError
	span     trace.Span // nil unless tracing (tracing.go)
	spanDead bool       // dead-lettered: the span's outcome
}

func (c *Consumer) newItem(msg jetstream.Msg) *item {
	md, err := msg.Metadata()
	return c.newItemOf(msg, md, err)
}

// newItemOf is newItem for a delivery whose metadata is parsed already
// (mdErr: it could not be): the feed parses it once per delivery and
// carries it, rather than once per look-up.
func (c *Consumer) newItemOf(msg jetstream.Msg, md *jetstream.MsgMetadata, mdErr error) *item {
	it := &item{msg: msg, received: time.Now()}
	it.m.Subject = msg.Subject()
	it.m.Header = msg.Headers()
	if mdErr == nil {
		it.m.Stream = md.Stream
		it.m.StreamSeq = md.Sequence.Stream
		it.m.Stored = md.Timestamp
		it.m.Deliveries = md.NumDelivered
	} else {
		it.err = fmt.Errorf("read JetStream metadata: %w", mdErr)
	}
	c.parse(it, msg.Data())
	return it
}

// parse fills the event fields of it from its headers and payload.
func (c *Consumer) parse(it *item, data []byte) {
	ev, err := contract.Parse(it.m.Header, data)
	it.m.Event = ev
	if err == nil {
		err = storableIdentity(&ev)
	}
	if err != nil && it.err == nil {
		it.err = err
	}
	if it.err != nil {
		// No trustworthy aggregate: keep the subject's messages together.
		it.key = "\x00subject\x00" + it.m.Subject
		return
	}
	it.key = ev.AggregateType + "\x00" + ev.AggregateID
	it.hash = ContentHash(&it.m.Event)
}

// storableIdentity refuses event fields the dedup row cannot hold: text
// that is not UTF-8 or holds NUL would fail every attempt (SQLSTATE 22021),
// so the message is broken, not failing.
func storableIdentity(ev *contract.Event) error {
	for _, f := range []struct{ header, v string }{
		{contract.EventID, ev.ID}, {contract.EventType, ev.Type},
		{contract.AggregateType, ev.AggregateType}, {contract.AggregateID, ev.AggregateID},
	} {
		if !utf8.ValidString(f.v) || strings.ContainsRune(f.v, 0) {
			return fmt.Errorf("header %s %s is not valid UTF-8 text", f.header, strconv.QuoteToASCII(f.v))
		}
	}
	return nil
}

// workerSeed seeds the hash that picks an aggregate's worker: any fixed
// seed keeps an aggregate on one worker for the life of the process.
var workerSeed = maphash.MakeSeed()

// workerIndex is the worker owning key's aggregate. Not FNV: a stream's
// partition transform hashes the same fields with FNV-1a, whose low bits
// then repeat in the worker's, and a partition's aggregates went to a
// quarter of 8 workers (TestWorkerIndexSpreadsPartitions).
func (c *Consumer) workerIndex(key string) int {
	return int(maphash.String(workerSeed, key) % uint64(c.cfg.Workers))
}

// statsLoop refreshes the open dead-letter gauges.
func (c *Consumer) statsLoop(ctx context.Context) error {
	t := time.NewTicker(c.cfg.StatsInterval)
	defer t.Stop()
	var failing loopHealth
	for {
		var open int64
		var oldest float64
		err := c.db.QueryRow(ctx, `
			SELECT count(*), COALESCE(EXTRACT(EPOCH FROM now() - min(dead_lettered_at)), 0)::float8
			FROM consumer_dead_letter
			WHERE consumer = $1 AND status IN ('open', 'replaying')`, c.cfg.Name).Scan(&open, &oldest)
		if err == nil {
			c.met.openDLQ.Set(float64(open))
			c.met.oldest.Set(oldest)
		}
		if ctx.Err() == nil {
			// A monitoring loop has nobody to return to; the next tick retries.
			failing.report(c.log, "refresh dead-letter gauges", err)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}

// loopHealth is observe.LoopHealth, the quiet log of a polling loop.
type loopHealth struct{ h observe.LoopHealth }

func (l *loopHealth) report(log *zap.Logger, what string, err error) { l.h.Report(log, what, err) }
