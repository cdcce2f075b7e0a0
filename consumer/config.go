package consumer

import (
	"fmt"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/trace"
	"go.uber.org/zap"
)

// Defaults of Config fields left at their zero value.
const (
	DefaultWorkers            = 8
	DefaultPendingPerWorker   = 64
	DefaultMinMaxAckPending   = 4096
	DefaultAckWait            = 30 * time.Second
	DefaultMaxAttempts        = 5
	DefaultRetryBase          = 200 * time.Millisecond
	DefaultRetryMax           = 30 * time.Second
	DefaultGapWait            = time.Minute
	DefaultGapRecheck         = time.Second
	DefaultReplayPollInterval = time.Second
	DefaultReplayBatch        = 100
	DefaultStatsInterval      = 15 * time.Second
	DefaultBatchSize          = 64
)

// Config configures a Consumer. Only Name, Stream and Handler-independent
// limits live here; the handler is a parameter of [New].
type Config struct {
	// Name is the JetStream durable consumer name and the consumer column of
	// every table row the library writes. Required. Two services must not
	// share a name: Run records the database and filter subjects in the
	// durable consumer's metadata and refuses to start (ErrDurableClash)
	// when they differ from its own.
	Name string
	// Stream is the JetStream stream to consume. Required.
	Stream string
	// FilterSubjects restricts the durable consumer to these subjects
	// (e.g. "outbox.registration.>"). Empty: the whole stream.
	FilterSubjects []string
	// AllowFilterChange lets Run change the filter subjects of a durable
	// consumer recorded for this database (a deliberate reconfiguration).
	// A durable consumer recorded for another database is never taken over.
	AllowFilterChange bool
	// Owner names who must act on this consumer's dead letters (a team or
	// an on-call rotation). It is stored on every dead-letter record, shown
	// by `outbox-relay dlq list` and used as a metric label for alerts.
	Owner string

	// Workers is the number of goroutines applying messages; a message goes
	// to the worker chosen by a hash of its aggregate type and id, so one
	// aggregate's messages are applied by one worker, in order. Default
	// DefaultWorkers. The database pool needs at least Workers+1
	// connections to keep every worker busy.
	Workers int
	// MaxAckPending is the durable consumer's max_ack_pending: how many
	// messages may be delivered and not yet acknowledged. It bounds the
	// library's memory and how many later messages a failing aggregate can
	// hold back (see the package doc). Default Workers times the larger of
	// DefaultPendingPerWorker and 4*BatchSize (a batch in flight and three
	// queued per worker: with one, the acknowledgements of a batch and the
	// deliveries that refill the queue race the next take, and batches run
	// short), at least DefaultMinMaxAckPending (with few workers, a worker
	// whose aggregates are busy waits for the budget others hold). In a group it bounds the member whatever it owns: each
	// partition durable's max_ack_pending is MaxAckPending, and the
	// partitions a member owns share MaxAckPending for the messages in its
	// workers; their pull buffers hold up to MaxAckPending more
	// (docs/consumer.md "Consumer groups").
	MaxAckPending int
	// AckWait is the durable consumer's ack_wait. Messages waiting in a
	// worker's queue are kept alive with progress acks every AckWait/3, so
	// AckWait only has to exceed the time one message takes to handle.
	// Default DefaultAckWait; at least 1s.
	AckWait time.Duration
	// HandlerTimeout bounds one transaction (dedup insert, handler, commit).
	// Default AckWait/2; must be below AckWait.
	HandlerTimeout time.Duration

	// BatchSize is how many messages a worker applies in one database
	// transaction at most: one dedup statement for all of them, the handler
	// per message in order (or a [BatchHandler] once), one commit, then an
	// ack for each. A worker never waits for a batch to fill: it takes what
	// is already queued for it, so under light load every message goes
	// alone, as soon as it arrives. A failing message does not fail its
	// neighbours: see the package doc, "Batches". 1 applies every message
	// in a transaction of its own. Default DefaultBatchSize; a worker's
	// batches are also bounded by its share of MaxAckPending.
	BatchSize int

	// VersionCheck declares that this consumer sees every event of each
	// aggregate it receives, so aggregate versions must follow each other:
	// current 5 + version 6 is applied, 6 again is a duplicate, 8 is a gap
	// (deferred up to GapWait, then dead-lettered), a known version with
	// another event identity is a conflict. Leave it off when the consumer
	// filters event types or subjects so that it sees only some of an
	// aggregate's events, or when the producer does not emit an event for
	// every version: skipped versions are then legitimate and would be
	// dead-lettered as gaps.
	VersionCheck bool
	// InitialVersion is, with VersionCheck, the version an aggregate the
	// consumer has never seen must start at; anything later is a gap. 0
	// accepts whatever version arrives first as the starting point, for
	// consumers that start in the middle of a stream's history.
	InitialVersion int64
	// EventTypes, when not empty, lists the event types the handler wants;
	// other events are acknowledged without a transaction or dedup row.
	// Incompatible with VersionCheck, for the reason given there.
	EventTypes []string

	// MaxAttempts is how many ClassUnknown failures of a message are
	// allowed before it is dead-lettered. Each class counts against its own
	// limit: transient failures (an outage) do not use up these attempts.
	// Default DefaultMaxAttempts.
	MaxAttempts int
	// TransientAttempts, when positive, dead-letters a message after that
	// many transient failures (other classes' failures not counted). 0 retries transient failures without limit:
	// a database outage must not empty the stream into the dead-letter
	// queue. Only the failing aggregate waits meanwhile.
	TransientAttempts int
	// RetryBase and RetryMax bound the retry backoff: attempt n waits
	// between half and all of min(RetryMax, RetryBase*2^(n-1)) (NakWithDelay).
	// Defaults DefaultRetryBase and DefaultRetryMax.
	RetryBase time.Duration
	RetryMax  time.Duration
	// GapWait is how long a message may wait for the versions before it to
	// arrive before it is dead-lettered as a gap. With VersionCheck it must
	// be at least RetryMax + AckWait, the longest an earlier version can take
	// to come back after a crash. Default the larger of DefaultGapWait and
	// RetryMax + AckWait.
	GapWait time.Duration
	// GapRecheck is the delay of each deferral while waiting for a gap to
	// fill. Default DefaultGapRecheck, at most GapWait.
	GapRecheck time.Duration

	// ReplayPollInterval is how often the consumer looks for dead letters
	// an operator asked to replay (`outbox-relay dlq replay`). Default
	// DefaultReplayPollInterval.
	ReplayPollInterval time.Duration
	// ReplayBatch is how many replay requests are taken at a time. Default
	// DefaultReplayBatch.
	ReplayBatch int
	// StatsInterval is how often the open dead-letter gauges are refreshed
	// from the database. Default DefaultStatsInterval.
	StatsInterval time.Duration

	// Group, when not nil, runs this consumer as one member of the
	// partitioned consumer group Name: see GroupConfig and docs/consumer.md
	// "Consumer groups".
	Group *GroupConfig
}

func (c *Config) setDefaults() {
	if c.Workers == 0 {
		c.Workers = DefaultWorkers
	}
	if c.BatchSize == 0 {
		c.BatchSize = DefaultBatchSize
	}
	if c.MaxAckPending == 0 {
		// Room for a batch in flight and a full one queued behind it per
		// worker: with less, a worker waits for its acks to be answered
		// with new messages between batches. And room for the aggregates
		// not to be spread evenly over the workers: at Workers x 256 the
		// group members of bench/README.md's batch handler runs waited
		// for the budget (issue 23, the member-wide MaxAckPending).
		c.MaxAckPending = max(DefaultMinMaxAckPending, c.Workers*max(DefaultPendingPerWorker, 4*c.BatchSize))
	}
	if c.AckWait == 0 {
		c.AckWait = DefaultAckWait
	}
	if c.HandlerTimeout == 0 {
		c.HandlerTimeout = c.AckWait / 2
	}
	if c.MaxAttempts == 0 {
		c.MaxAttempts = DefaultMaxAttempts
	}
	if c.RetryBase == 0 {
		c.RetryBase = DefaultRetryBase
	}
	if c.RetryMax == 0 {
		c.RetryMax = DefaultRetryMax
	}
	if c.GapWait == 0 {
		// Long enough for an earlier version to come back after a crash
		// (see validate), whatever AckWait and RetryMax are.
		c.GapWait = max(DefaultGapWait, c.RetryMax+c.AckWait)
	}
	if c.GapRecheck == 0 {
		c.GapRecheck = min(DefaultGapRecheck, c.GapWait)
	}
	if c.ReplayPollInterval == 0 {
		c.ReplayPollInterval = DefaultReplayPollInterval
	}
	if c.ReplayBatch == 0 {
		c.ReplayBatch = DefaultReplayBatch
	}
	if c.StatsInterval == 0 {
		c.StatsInterval = DefaultStatsInterval
	}
	// Consumer groups (group.go).
	if c.Group != nil {
		c.setGroupDefaults()
	}
}

// validate checks a Config after setDefaults.
func (c *Config) validate() error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: %s", ErrInvalidConfig, fmt.Sprintf(format, args...))
	}
	switch {
	case c.Name == "":
		return bad("Name is required: it is the durable consumer name and the key of the dedup rows")
	case c.Stream == "":
		return bad("Stream is required: name the JetStream stream the relay publishes to")
	case c.Workers < 1:
		return bad("Workers is %d, want at least 1", c.Workers)
	case c.MaxAckPending < c.Workers:
		return bad("MaxAckPending %d is below Workers %d: some workers could never get a message", c.MaxAckPending, c.Workers)
	case c.AckWait < time.Second:
		return bad("AckWait %s is below 1s", c.AckWait)
	case c.HandlerTimeout <= 0 || c.HandlerTimeout >= c.AckWait:
		return bad("HandlerTimeout %s must be positive and below AckWait %s, or the broker redelivers messages still being handled", c.HandlerTimeout, c.AckWait)
	case c.BatchSize < 1:
		return bad("BatchSize is %d: set 1 for one transaction per message, more to apply up to that many messages in one transaction, or leave it 0 for DefaultBatchSize (%d)", c.BatchSize, DefaultBatchSize)
	case c.MaxAttempts < 1:
		return bad("MaxAttempts is %d, want at least 1", c.MaxAttempts)
	case c.TransientAttempts < 0:
		return bad("TransientAttempts is %d, want 0 (unlimited) or more", c.TransientAttempts)
	case c.RetryBase <= 0 || c.RetryMax < c.RetryBase:
		return bad("RetryBase %s and RetryMax %s: want 0 < RetryBase <= RetryMax", c.RetryBase, c.RetryMax)
	case c.GapWait <= 0 || c.GapRecheck <= 0 || c.GapRecheck > c.GapWait:
		return bad("GapWait %s and GapRecheck %s: want 0 < GapRecheck <= GapWait", c.GapWait, c.GapRecheck)
	case c.VersionCheck && c.GapWait < c.RetryMax+c.AckWait:
		// After a crash the earlier version of an aggregate comes back only
		// when its nak delay (up to RetryMax) or its ack wait expires, while
		// a later one may arrive at once: a shorter GapWait dead-letters the
		// later one as a gap that would have filled.
		return bad("GapWait %s is below RetryMax %s + AckWait %s: after a crash a later version would be dead-lettered as a gap while the earlier one waits out its redelivery; raise GapWait or leave it 0",
			c.GapWait, c.RetryMax, c.AckWait)
	case c.VersionCheck && len(c.EventTypes) > 0:
		return bad("VersionCheck needs every event of an aggregate but EventTypes filters them: versions of the filtered-out events would look like gaps; turn one of them off")
	case c.InitialVersion < 0:
		return bad("InitialVersion is %d, want 0 or more", c.InitialVersion)
	case c.ReplayPollInterval <= 0 || c.ReplayBatch < 1 || c.StatsInterval <= 0:
		return bad("ReplayPollInterval, ReplayBatch and StatsInterval must be positive")
	}
	// Consumer groups (group.go).
	if c.Group != nil {
		return c.validateGroup()
	}
	return nil
}

// Option configures a Consumer.
type Option func(*options) error

type options struct {
	logger      *zap.Logger
	registerer  prometheus.Registerer
	afterCommit func(*Message)
	// tracerProvider is set by WithTracerProvider (tracing.go).
	tracerProvider trace.TracerProvider
}

// WithLogger sets the logger. Default zap.NewNop().
func WithLogger(l *zap.Logger) Option {
	return func(o *options) error {
		if l == nil {
			return fmt.Errorf("%w: nil logger", ErrInvalidConfig)
		}
		o.logger = l
		return nil
	}
}

// WithRegisterer registers the consumer's metrics (outbox_consumer_*) with r.
// Several consumers may share r: their series differ by the consumer label.
// Default: a private registry nobody scrapes.
func WithRegisterer(r prometheus.Registerer) Option {
	return func(o *options) error {
		if r == nil {
			return fmt.Errorf("%w: nil registerer", ErrInvalidConfig)
		}
		o.registerer = r
		return nil
	}
}

// WithAfterCommit calls f after a message's transaction committed and before
// the message is acknowledged, on the goroutine processing the message. It exists for
// fault-injection tests (a crash exactly between commit and ack) and
// tracing; f must not block for long, or the broker redelivers.
func WithAfterCommit(f func(*Message)) Option {
	return func(o *options) error {
		o.afterCommit = f
		return nil
	}
}
