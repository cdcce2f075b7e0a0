package consumer

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"
)

// Metadata keys recording which database and filter a durable consumer
// serves. Two services configured with the same Name would otherwise share
// one durable consumer: each start rewrote its filter, and each service
// received, and applied with its handler, the other's events.
const (
	metaDatabase = "outbox-relay.database" // "<system identifier>/<database name>"
	metaFilter   = "outbox-relay.filter"   // sorted filter subjects, space-separated
)

// identity is what the durable consumer's metadata records of its owner.
type identity struct {
	sysID, dbName, filter string
}

func (id identity) database() string { return id.sysID + "/" + id.dbName }

// sameDatabase compares a recorded database with ours. The system
// identifier needs a role that may call pg_control_system(); when either
// side could not read it, the database names alone decide.
func (id identity) sameDatabase(recorded string) bool {
	sys, name, ok := strings.Cut(recorded, "/")
	if !ok {
		return false
	}
	if sys != "" && id.sysID != "" && sys != id.sysID {
		return false
	}
	return name == id.dbName
}

func (c *Consumer) identity(ctx context.Context) (identity, error) {
	var id identity
	if err := c.db.QueryRow(ctx, `SELECT current_database()`).Scan(&id.dbName); err != nil {
		return id, fmt.Errorf("read the database name: %w", err)
	}
	// Not every role may read the control data: then the name stands alone.
	_ = c.db.QueryRow(ctx, `SELECT system_identifier::text FROM pg_control_system()`).Scan(&id.sysID)
	filter := slices.Clone(c.cfg.FilterSubjects)
	slices.Sort(filter)
	id.filter = strings.Join(filter, " ")
	return id, nil
}

// durable creates the durable consumer, or updates it after checking that
// it is this consumer's: recorded for the same database, and with the same
// filter unless Config.AllowFilterChange. A durable without recorded
// identity (made by an earlier version) is adopted when its filter matches.
func (c *Consumer) durable(ctx context.Context) (jetstream.Consumer, error) {
	id, err := c.identity(ctx)
	if err != nil {
		return nil, err
	}
	cfg := c.consumerConfig()
	cfg.Metadata = map[string]string{metaDatabase: id.database(), metaFilter: id.filter}
	return c.ensureDurable(ctx, cfg, id, true)
}

// ensureDurable creates the durable consumer cfg, or checks that the one
// that exists is of identity id (checkIdentity) and, with update, brings
// it to cfg. One created concurrently by another process is checked like
// any existing one: two services starting at the same moment with the
// same Name must not share it silently.
func (c *Consumer) ensureDurable(ctx context.Context, cfg jetstream.ConsumerConfig, id identity, update bool) (jetstream.Consumer, error) {
	for attempt := 0; ; attempt++ {
		existing, err := c.js.Consumer(ctx, c.cfg.Stream, cfg.Durable)
		if errors.Is(err, jetstream.ErrConsumerNotFound) {
			cons, err := c.js.CreateConsumer(ctx, c.cfg.Stream, cfg)
			if errors.Is(err, jetstream.ErrConsumerExists) && attempt == 0 {
				continue // created concurrently: check whose it is
			}
			return cons, err
		}
		if err != nil {
			return nil, err
		}
		if err := c.checkIdentity(id, existing.CachedInfo().Config); err != nil {
			return nil, err
		}
		if !update {
			return existing, nil
		}
		return c.js.UpdateConsumer(ctx, c.cfg.Stream, cfg)
	}
}

func (c *Consumer) checkIdentity(id identity, have jetstream.ConsumerConfig) error {
	haveFilter := have.Metadata[metaFilter]
	if _, ok := have.Metadata[metaFilter]; !ok {
		f := slices.Clone(have.FilterSubjects)
		if have.FilterSubject != "" {
			f = append(f, have.FilterSubject)
		}
		slices.Sort(f)
		haveFilter = strings.Join(f, " ")
	}
	show := func(f string) string {
		if f == "" {
			return "(the whole stream)"
		}
		return f
	}
	if db, ok := have.Metadata[metaDatabase]; ok && !id.sameDatabase(db) {
		return fmt.Errorf("%w: durable consumer %s on stream %s belongs to database %s (filter %s); this consumer writes to database %s (filter %s). Two services must not share a Name: give this one its own Config.Name",
			ErrDurableClash, c.cfg.Name, c.cfg.Stream, db, show(haveFilter), id.database(), show(id.filter))
	}
	if haveFilter != id.filter && !c.cfg.AllowFilterChange {
		return fmt.Errorf("%w: durable consumer %s on stream %s filters %s, this consumer %s. If another service uses the same Name, give this one its own Config.Name; if this service's filter changed on purpose, start it once with Config.AllowFilterChange",
			ErrDurableClash, c.cfg.Name, c.cfg.Stream, show(haveFilter), show(id.filter))
	}
	return nil
}

// durableSource is the source of a plain consumer: the durable consumer
// Config.Name, pulled through one feed.
type durableSource struct {
	c    *Consumer
	strm jetstream.Stream
	cons jetstream.Consumer // set by setUp
}

// setUp creates or checks the durable consumer.
func (s *durableSource) setUp(ctx context.Context) error {
	c := s.c
	cons, err := c.durable(ctx)
	if err != nil {
		return fmt.Errorf("create durable consumer %s on stream %s: %w", c.cfg.Name, c.cfg.Stream, err)
	}
	s.cons = cons
	return nil
}

// run feeds the durable consumer's deliveries to the engine until ctx ends.
func (s *durableSource) run(ctx, _ context.Context, e *engine) error {
	c, cons := s.c, s.cons
	c.log.Info("consuming", zap.String("stream", c.cfg.Stream), zap.Strings("filter_subjects", c.cfg.FilterSubjects),
		zap.Int("workers", c.cfg.Workers), zap.Int("max_ack_pending", c.cfg.MaxAckPending),
		zap.Duration("ack_wait", c.cfg.AckWait), zap.Bool("version_check", c.cfg.VersionCheck))
	f := newFeed(e, cons, c.cfg.Name, c.log, jetstream.PullMaxMessages(min(c.cfg.MaxAckPending, 500)), jetstream.PullHeartbeat(pullHeartbeat))
	// Several processes may share a plain durable (feed.go). With
	// VersionCheck the feed keeps resetting on their gaps: a reset delivers
	// what is pending in stream order again, which resolves the version
	// gaps that splitting an aggregate between processes makes.
	f.shareable = !c.cfg.VersionCheck
	defer f.stop()
	err := e.pump(ctx, f)
	if ctx.Err() != nil {
		return nil
	}
	return fmt.Errorf("consume %s from stream %s: %w", c.cfg.Name, c.cfg.Stream, err)
}

// gone: a sequence is gone at or below the durable consumer's ack floor,
// or when it left the stream. The lookups are bounded so that an
// unreachable server delays the calling worker by little.
func (s *durableSource) gone(ctx context.Context, seqs []uint64) map[uint64]bool {
	ctx, cancel := context.WithTimeout(ctx, min(s.c.cfg.AckWait/3, 5*time.Second))
	defer cancel()
	info, err := s.cons.Info(ctx)
	if err != nil {
		return nil
	}
	gone := make(map[uint64]bool, len(seqs))
	for _, seq := range seqs {
		if seq <= info.AckFloor.Stream {
			gone[seq] = true
			continue
		}
		_, err := s.strm.GetMsg(ctx, seq)
		gone[seq] = errors.Is(err, jetstream.ErrMsgNotFound)
	}
	return gone
}

// forget has nothing to give back: a plain durable's feed has no budget,
// and a naked message it keeps counted goes when the feed closes.
func (s *durableSource) forget([]uint64) {}
