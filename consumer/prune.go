package consumer

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"
)

// Pruner defaults.
const (
	DefaultPruneInterval = time.Hour
	DefaultPruneBatch    = 5000
)

// PruneConfig configures a Pruner.
type PruneConfig struct {
	// Consumer is the consumer whose dedup rows are pruned. Required.
	Consumer string
	// Stream is the stream the consumer reads; its max_age bounds how old
	// an event JetStream can still deliver. Required.
	Stream string
	// Retention is how long a consumed_message row is kept. Required.
	Retention time.Duration
	// ReplayWindow is how far back operators may re-consume the stream by
	// hand (a durable consumer reset to an earlier start time or sequence).
	// The retention must cover it too.
	ReplayWindow time.Duration
	// Interval between prunes in Run. Default DefaultPruneInterval.
	Interval time.Duration
	// Batch is how many rows one DELETE removes, to keep transactions and
	// locks short. Default DefaultPruneBatch.
	Batch int
}

// Pruner deletes old dedup rows of one consumer. A dedup row may go only
// when its event can no longer arrive again:
//
//   - JetStream can deliver an event as long as the stream keeps it (the
//     stream's max_age); a stream without max_age keeps events forever, and
//     then no retention is safe;
//   - a message whose row committed but whose ack was lost comes back after
//     ack_wait plus at most the retry backoff;
//   - an operator may re-consume the stream by hand within ReplayWindow;
//   - a dead letter of the same event id that is still open may be replayed
//     at any time: rows with an open dead letter are never pruned, whatever
//     their age.
//
// [Pruner.Check] refuses a Retention shorter than the largest of the first
// three with ErrRetentionTooShort.
type Pruner struct {
	cfg PruneConfig
	db  DB
	js  jetstream.JetStream
	log *zap.Logger
}

// NewPruner returns a pruner. Its only option is [WithLogger]; other options
// are ignored.
func NewPruner(db DB, js jetstream.JetStream, cfg PruneConfig, opts ...Option) (*Pruner, error) {
	if cfg.Interval == 0 {
		cfg.Interval = DefaultPruneInterval
	}
	if cfg.Batch == 0 {
		cfg.Batch = DefaultPruneBatch
	}
	switch {
	case db == nil || js == nil:
		return nil, fmt.Errorf("%w: pruner needs a database and a JetStream context", ErrInvalidConfig)
	case cfg.Consumer == "" || cfg.Stream == "":
		return nil, fmt.Errorf("%w: pruner needs Consumer and Stream", ErrInvalidConfig)
	case cfg.Retention <= 0:
		return nil, fmt.Errorf("%w: pruner Retention must be positive", ErrInvalidConfig)
	case cfg.ReplayWindow < 0 || cfg.Interval < 0 || cfg.Batch < 0:
		return nil, fmt.Errorf("%w: pruner ReplayWindow, Interval and Batch must not be negative", ErrInvalidConfig)
	}
	o := options{logger: zap.NewNop()}
	for _, opt := range opts {
		if err := opt(&o); err != nil {
			return nil, err
		}
	}
	return &Pruner{cfg: cfg, db: db, js: js, log: o.logger.Named("pruner").With(zap.String(fieldConsumer, cfg.Consumer))}, nil
}

// Check reads the stream and durable consumer settings and refuses a
// retention that does not cover their redelivery window or ReplayWindow.
func (p *Pruner) Check(ctx context.Context) error {
	s, err := p.js.Stream(ctx, p.cfg.Stream)
	if err != nil {
		return fmt.Errorf("read stream %s: %w", p.cfg.Stream, err)
	}
	maxAge := s.CachedInfo().Config.MaxAge
	if maxAge == 0 {
		return fmt.Errorf("%w: stream %s keeps messages forever (max_age 0), so any event can be delivered again by a reset or new consumer; set max_age on the stream, or do not prune",
			ErrRetentionTooShort, p.cfg.Stream)
	}
	redelivery := time.Duration(0)
	if ci, err := s.Consumer(ctx, p.cfg.Consumer); err == nil {
		redelivery = ci.CachedInfo().Config.AckWait + DefaultRetryMax
	} else if !errors.Is(err, jetstream.ErrConsumerNotFound) {
		return fmt.Errorf("read consumer %s: %w", p.cfg.Consumer, err)
	}
	need, what := maxAge, fmt.Sprintf("the max_age %s of stream %s", maxAge, p.cfg.Stream)
	if p.cfg.ReplayWindow > need {
		need, what = p.cfg.ReplayWindow, fmt.Sprintf("the replay window %s", p.cfg.ReplayWindow)
	}
	if redelivery > need {
		need, what = redelivery, fmt.Sprintf("the redelivery window %s (ack_wait plus retry backoff)", redelivery)
	}
	if p.cfg.Retention < need {
		return fmt.Errorf("%w: retention %s is shorter than %s; an event could arrive again after its dedup row is gone and be applied twice",
			ErrRetentionTooShort, p.cfg.Retention, what)
	}
	return nil
}

// PruneOnce checks the retention and deletes the consumer's dedup rows older
// than it, except rows whose event has an open dead letter. It returns the
// number of rows deleted.
func (p *Pruner) PruneOnce(ctx context.Context) (int64, error) {
	if err := p.Check(ctx); err != nil {
		return 0, err
	}
	cutoff := time.Now().Add(-p.cfg.Retention)
	var total int64
	for {
		tag, err := p.db.Exec(ctx, `
			DELETE FROM consumed_message
			WHERE (consumer, event_id) IN (
				SELECT m.consumer, m.event_id FROM consumed_message m
				WHERE m.consumer = $1 AND m.consumed_at < $2
				  AND NOT EXISTS (
					SELECT 1 FROM consumer_dead_letter d
					WHERE d.consumer = m.consumer AND d.event_id = m.event_id
					  AND d.status IN ('open', 'replaying'))
				LIMIT $3)`, p.cfg.Consumer, cutoff, p.cfg.Batch)
		if err != nil {
			return total, fmt.Errorf("prune consumed_message of %s: %w", p.cfg.Consumer, err)
		}
		total += tag.RowsAffected()
		if tag.RowsAffected() < int64(p.cfg.Batch) {
			return total, nil
		}
	}
}

// Run prunes every Interval until ctx is cancelled (it then returns nil). A
// retention that fails Check stops it with the error; other failures are
// logged and retried at the next interval.
func (p *Pruner) Run(ctx context.Context) error {
	t := time.NewTicker(p.cfg.Interval)
	defer t.Stop()
	for {
		n, err := p.PruneOnce(ctx)
		switch {
		case ctx.Err() != nil:
			return nil
		case err != nil && errors.Is(err, ErrRetentionTooShort):
			return err
		case err != nil:
			p.log.Warn("prune dedup rows", zap.Error(err))
		case n > 0:
			p.log.Info("pruned dedup rows", zap.Int64("rows", n))
		}
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}
