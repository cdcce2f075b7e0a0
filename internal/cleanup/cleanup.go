package cleanup

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"

	"github.com/outbox-relay/outbox-relay/contract"
	"github.com/outbox-relay/outbox-relay/internal/provision"
	"github.com/outbox-relay/outbox-relay/internal/reconcile"
	"github.com/outbox-relay/outbox-relay/router"
)

// Mode says how a row is proven relayed.
type Mode string

// Modes.
const (
	// ModeStream deletes rows whose event id is in the event stream.
	ModeStream Mode = "stream"
	// ModePublished deletes rows whose publish_state is 'PUBLISHED'.
	ModePublished Mode = "published"
)

// Defaults of Config fields left at their zero value.
const (
	DefaultBatchSize = 1000
	DefaultClockSkew = time.Minute
	// DefaultStoredMargin is how long an event must have been stored in the
	// stream before its row may go.
	DefaultStoredMargin = 10 * time.Minute
	// MinStoredMargin is the shortest StoredMargin accepted unless
	// WithMinStoredMargin lowers it: JetStream's default sync interval. A
	// stream acknowledges before fsync, so an event stored less than that
	// ago may exist only in the OS cache; a server crash would lose it
	// together with its row, and nothing could show the loss.
	MinStoredMargin = 2 * time.Minute
	// MaxBatchSize bounds a batch: one DELETE holds its rows' locks until
	// it commits.
	MaxBatchSize = 10_000
	// MaxPause bounds Pause: batches are deleted while the stream is being
	// scanned, and a scan consumer idle for a minute is removed by the
	// server, which would abort the run.
	MaxPause = 10 * time.Second
)

// Config says what to delete.
type Config struct {
	// Router is the relay's table mapping.
	Router router.Config
	// Stream is the event stream (ModeStream).
	Stream string
	// Mode is ModeStream (default) or ModePublished.
	Mode Mode
	// OlderThan keeps rows whose occurred-at time is within this long of
	// now. Required (a positive duration).
	OlderThan time.Duration
	// StoredMargin keeps rows whose event the stream stored within this
	// long of now (ModeStream): the row is the only copy until the server
	// has synced the event to disk. Default DefaultStoredMargin, at least
	// MinStoredMargin.
	StoredMargin time.Duration
	// BatchSize is the rows per DELETE transaction. Default
	// DefaultBatchSize, at most MaxBatchSize.
	BatchSize int
	// ClockSkew is subtracted from the oldest candidate's time where the
	// stream is read by storage time. Default DefaultClockSkew.
	ClockSkew time.Duration
	// Pause is slept between batches, to spread the load. Default none.
	Pause time.Duration
	// DryRun counts what would be deleted and deletes nothing.
	DryRun bool
}

func (c *Config) setDefaults(minMargin time.Duration) error {
	if c.StoredMargin == 0 {
		c.StoredMargin = DefaultStoredMargin
	}
	if c.Mode == "" {
		c.Mode = ModeStream
	}
	if c.BatchSize == 0 {
		c.BatchSize = DefaultBatchSize
	}
	if c.ClockSkew == 0 {
		c.ClockSkew = DefaultClockSkew
	}
	switch {
	case c.Mode != ModeStream && c.Mode != ModePublished:
		return fmt.Errorf("%w: mode %q: use %s or %s", ErrInvalidConfig, c.Mode, ModeStream, ModePublished)
	case c.Mode == ModeStream && c.Stream == "":
		return fmt.Errorf("%w: mode stream needs the event stream", ErrInvalidConfig)
	case c.OlderThan <= 0:
		return fmt.Errorf("%w: older-than %s: give a positive age (e.g. 168h keeps a week of rows; rows younger than the reconcile window are still needed)", ErrInvalidConfig, c.OlderThan)
	case c.Mode == ModeStream && c.StoredMargin < minMargin:
		return fmt.Errorf("%w: stored margin %s is shorter than %s, JetStream's default sync interval: an event stored more recently may not be on disk yet", ErrInvalidConfig, c.StoredMargin, minMargin)
	case c.BatchSize < 1 || c.BatchSize > MaxBatchSize:
		return fmt.Errorf("%w: batch size %d: use 1 to %d", ErrInvalidConfig, c.BatchSize, MaxBatchSize)
	case c.ClockSkew < 0 || c.Pause < 0:
		return fmt.Errorf("%w: clock skew and pause must not be negative", ErrInvalidConfig)
	case c.Pause > MaxPause:
		return fmt.Errorf("%w: pause %s is longer than %s: the stream scan that batches run in would time out (use a smaller --batch-size to spread the load further)", ErrInvalidConfig, c.Pause, MaxPause)
	}
	return nil
}

// TableReport is one table's outcome.
type TableReport struct {
	Table string `json:"table"`
	// Candidates is the rows older than the cutoff before cleanup.
	Candidates int64 `json:"candidates"`
	// Deleted is the rows deleted (with DryRun: that would be deleted).
	Deleted int64 `json:"deleted"`
	// Remaining is the rows older than the cutoff left afterwards: not
	// proven relayed (or locked, or inserted meanwhile).
	Remaining int64 `json:"remaining"`
	// Batches is the DELETE transactions run.
	Batches int `json:"batches"`
	// OldestRemaining is the occurred-at time of the oldest remaining row:
	// every run reads the stream from there, so a row that can never be
	// proven relayed (lost, only dead-lettered) makes each run read more.
	OldestRemaining *time.Time `json:"oldest_remaining,omitempty"`
	// NoOccurredAt is the rows whose occurred-at time is NULL: no cutoff
	// selects them, so they are never deleted.
	NoOccurredAt int64 `json:"no_occurred_at"`
	// StoredRecently is the events older than the cutoff found in the
	// stream but stored within the stored margin: their rows are kept
	// until a later run (ModeStream).
	StoredRecently int64 `json:"stored_recently"`
}

// Report is the outcome of Run.
type Report struct {
	Mode   Mode          `json:"mode"`
	Cutoff time.Time     `json:"cutoff"`
	DryRun bool          `json:"dry_run"`
	Tables []TableReport `json:"tables"`
	// StreamMessages is the messages read (ModeStream).
	StreamMessages uint64 `json:"stream_messages_read"`
	// StoredBefore is the newest storage time an event may have for its
	// row to be deleted: the start of the run less the stored margin.
	StoredBefore *time.Time `json:"stored_before,omitempty"`
	// Warnings are conditions the operator should know about, such as an
	// event stream whose acknowledgements do not survive a server crash.
	Warnings []string      `json:"warnings,omitempty"`
	Duration time.Duration `json:"duration_ns"`
}

// Option configures Run.
type Option func(*options)

type options struct {
	log       *zap.Logger
	progress  func(TableReport)
	minMargin time.Duration
}

// WithLogger sets the logger (default zap.NewNop()).
func WithLogger(l *zap.Logger) Option { return func(o *options) { o.log = l } }

// WithProgress calls f after every batch with the table's running totals.
func WithProgress(f func(TableReport)) Option { return func(o *options) { o.progress = f } }

// WithMinStoredMargin lowers the shortest accepted Config.StoredMargin
// (default MinStoredMargin): for a server that syncs more often
// (jetstream sync_interval), and for tests. Negative values count as 0.
func WithMinStoredMargin(d time.Duration) Option {
	return func(o *options) { o.minMargin = max(d, 0) }
}

// Run deletes the rows older than the cutoff that cfg.Mode proves relayed.
func Run(ctx context.Context, db reconcile.DB, js jetstream.JetStream, cfg Config, opts ...Option) (*Report, error) {
	o := options{log: zap.NewNop(), progress: func(TableReport) {}, minMargin: MinStoredMargin}
	for _, opt := range opts {
		opt(&o)
	}
	if err := cfg.setDefaults(o.minMargin); err != nil {
		return nil, err
	}
	start := time.Now()
	tables, err := reconcile.LoadTables(ctx, db, cfg.Router)
	if err != nil {
		return nil, err
	}
	if cfg.Mode == ModePublished {
		for _, t := range tables {
			if t.StateColumn == "" {
				return nil, fmt.Errorf("%w: %s (mode published deletes rows marked publish_state = 'PUBLISHED'; use mode stream)", ErrNoStateColumn, t.Qualified)
			}
		}
	}
	c := &cleaner{db: db, cfg: cfg, log: o.log, progress: o.progress, rep: &Report{Mode: cfg.Mode, Cutoff: start.Add(-cfg.OlderThan).UTC(), DryRun: cfg.DryRun}}
	if cfg.Mode == ModeStream {
		before := start.Add(-cfg.StoredMargin).UTC()
		c.rep.StoredBefore = &before
		if err := c.checkDurable(ctx, js); err != nil {
			return nil, err
		}
	}
	c.rep.Tables = make([]TableReport, len(tables))
	var oldest time.Time
	for i, t := range tables {
		tr := &c.rep.Tables[i]
		tr.Table = t.Qualified
		var min *time.Time
		if err := db.QueryRow(ctx, fmt.Sprintf("SELECT count(*), min(%s) FROM %s WHERE %s < $1", t.Time, t.Ident, t.Time), c.rep.Cutoff).Scan(&tr.Candidates, &min); err != nil {
			return nil, fmt.Errorf("count %s: %w", t.Qualified, err)
		}
		if min != nil && (oldest.IsZero() || min.Before(oldest)) {
			oldest = *min
		}
	}
	if !oldest.IsZero() {
		switch cfg.Mode {
		case ModeStream:
			err = c.byStream(ctx, js, tables, oldest)
		case ModePublished:
			err = c.byState(ctx, tables)
		}
		if err != nil {
			return c.rep, err
		}
	}
	for i, t := range tables {
		tr := &c.rep.Tables[i]
		if err := db.QueryRow(ctx, fmt.Sprintf("SELECT count(*) FILTER (WHERE %[1]s < $1), count(*) FILTER (WHERE %[1]s IS NULL), min(%[1]s) FILTER (WHERE %[1]s < $1) FROM %[2]s", t.Time, t.Ident), c.rep.Cutoff).Scan(&tr.Remaining, &tr.NoOccurredAt, &tr.OldestRemaining); err != nil {
			return c.rep, fmt.Errorf("count %s: %w", t.Qualified, err)
		}
	}
	c.rep.Duration = time.Since(start)
	return c.rep, nil
}

// checkDurable refuses a stream in memory, whose events a restart loses:
// deleting their rows would leave no copy at all. A stream with fewer than
// three replicas is reported in Warnings: the stored margin covers the
// fsync delay, not the loss of the server's disk.
func (c *cleaner) checkDurable(ctx context.Context, js jetstream.JetStream) error {
	s, err := js.Stream(ctx, c.cfg.Stream)
	if err != nil {
		return fmt.Errorf("stream %s: %w", c.cfg.Stream, err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		return fmt.Errorf("stream %s info: %w", c.cfg.Stream, err)
	}
	// A stream that deletes events by itself (work-queue retention, a
	// per-subject limit) cannot prove a row relayed by their absence or
	// presence now, and its rows may be the last copy.
	warnings, err := provision.CheckShape(info.Config)
	if err != nil {
		return err
	}
	c.rep.Warnings = append(c.rep.Warnings, warnings...)
	if info.Config.Storage != jetstream.FileStorage {
		return fmt.Errorf("%w: stream %s keeps its events in memory, so its rows are the only copy that survives a restart (use --mode published, or move the stream to file storage)", ErrNotDurable, c.cfg.Stream)
	}
	if ok, reason := provision.Durability(info.Config); !ok {
		c.rep.Warnings = append(c.rep.Warnings, fmt.Sprintf("stream %s: %s; cleanup deletes a row only once its event has been stored for %s", c.cfg.Stream, reason, c.cfg.StoredMargin))
	}
	return nil
}

type cleaner struct {
	db       reconcile.DB
	cfg      Config
	log      *zap.Logger
	progress func(TableReport)
	rep      *Report
}

// byStream reads the stream's headers from the oldest candidate's time and
// deletes, batch by batch, the rows whose event it found. Memory holds one
// batch of ids per table.
func (c *cleaner) byStream(ctx context.Context, js jetstream.JetStream, tables []*reconcile.Table, oldest time.Time) error {
	idx := map[string]int{}
	for i, t := range tables {
		idx[t.Qualified] = i
	}
	batches := make([][]string, len(tables))
	// The whole stream, not today's subject templates: an event stored
	// under an earlier template proves its row relayed too. Only an event
	// naming its table does (contract.EventKey): one without Outbox-Table
	// (another producer's, a polling relay's) proves no row relayed, so
	// its id deletes nothing.
	res, err := reconcile.ScanStream(ctx, js, c.cfg.Stream, nil, reconcile.ScanFrom{Time: oldest.Add(-c.cfg.ClockSkew)}, func(ev *reconcile.StreamEvent) error {
		if _, ok := contract.EventKey(ev.Table, ev.EventID); !ok {
			return nil
		}
		i, ok := idx[ev.Table]
		if !ok {
			return nil
		}
		return c.add(ctx, tables, batches, i, ev)
	})
	c.rep.StreamMessages = res.Messages
	if err != nil {
		return err
	}
	for i, b := range batches {
		if len(b) > 0 {
			if err := c.deleteIDs(ctx, tables[i], &c.rep.Tables[i], b); err != nil {
				return err
			}
		}
	}
	return nil
}

// add queues ev's id for deletion from tables[i], and deletes a full batch.
func (c *cleaner) add(ctx context.Context, tables []*reconcile.Table, batches [][]string, i int, ev *reconcile.StreamEvent) error {
	if !tables[i].ValidID(ev.EventID) {
		return nil
	}
	// Only an event older than the cutoff can have a row to delete; the
	// DELETE checks the row's own time again.
	if !ev.OccurredAt.IsZero() && !ev.OccurredAt.Before(c.rep.Cutoff) {
		return nil
	}
	// The row's age says nothing of when its event was stored (a relay
	// that was down for hours stores old rows now): the event must have
	// had time to reach the server's disk.
	if !ev.Stored.Before(*c.rep.StoredBefore) {
		c.rep.Tables[i].StoredRecently++
		return nil
	}
	batches[i] = append(batches[i], ev.EventID)
	if len(batches[i]) < c.cfg.BatchSize {
		return nil
	}
	err := c.deleteIDs(ctx, tables[i], &c.rep.Tables[i], batches[i])
	batches[i] = batches[i][:0]
	return err
}

// deleteIDs deletes, in one short transaction, the rows of t with these
// event ids (all found in the stream) that are older than the cutoff.
func (c *cleaner) deleteIDs(ctx context.Context, t *reconcile.Table, tr *TableReport, ids []string) error {
	cond := fmt.Sprintf("%s AND %s < $2", t.IDIn("$1"), t.Time)
	q := fmt.Sprintf("SELECT count(*) FROM %s WHERE %s", t.Ident, cond)
	if !c.cfg.DryRun {
		q = deleteLocked(t, cond, "")
	}
	return c.batch(ctx, t, tr, q, ids, c.rep.Cutoff)
}

// deleteLocked returns a statement deleting the rows of t matching cond
// that no other transaction holds locked (at most limit rows when limit is
// not empty), and counting them.
//
// A ctid is unique only within one heap: on a partitioned table every
// partition has a row at (0,1). The rows are therefore keyed on (tableoid,
// ctid), and the DELETE checks cond again, so it can only ever remove a row
// that is itself proven relayed and old enough.
func deleteLocked(t *reconcile.Table, cond, limit string) string {
	if limit != "" {
		limit = " LIMIT " + limit
	}
	return fmt.Sprintf(`WITH c AS (SELECT tableoid, ctid FROM %[1]s WHERE %[2]s%[3]s FOR UPDATE SKIP LOCKED),
d AS (DELETE FROM %[1]s WHERE (tableoid, ctid) IN (SELECT tableoid, ctid FROM c) AND %[2]s RETURNING 1)
SELECT count(*) FROM d`, t.Ident, cond, limit)
}

// byState deletes rows marked published, batch by batch, until a batch
// finds none.
func (c *cleaner) byState(ctx context.Context, tables []*reconcile.Table) error {
	for i, t := range tables {
		tr := &c.rep.Tables[i]
		cond := fmt.Sprintf("%s = 'PUBLISHED' AND %s < $1", t.StateColumn, t.Time)
		if c.cfg.DryRun {
			q := fmt.Sprintf("SELECT count(*) FROM %s WHERE %s", t.Ident, cond)
			if err := c.batch(ctx, t, tr, q, c.rep.Cutoff); err != nil {
				return err
			}
			continue
		}
		q := deleteLocked(t, cond, strconv.Itoa(c.cfg.BatchSize))
		for {
			before := tr.Deleted
			if err := c.batch(ctx, t, tr, q, c.rep.Cutoff); err != nil {
				return err
			}
			if tr.Deleted == before {
				break
			}
		}
	}
	return nil
}

// batch runs one counting statement as its own transaction and adds its
// count to tr.
func (c *cleaner) batch(ctx context.Context, t *reconcile.Table, tr *TableReport, q string, args ...any) error {
	var n int64
	err := c.db.QueryRow(ctx, q, args...).Scan(&n)
	if errors.Is(err, pgx.ErrNoRows) {
		n, err = 0, nil
	}
	if err != nil {
		return fmt.Errorf("clean %s: %w", t.Qualified, err)
	}
	tr.Deleted += n
	tr.Batches++
	c.progress(*tr)
	c.log.Debug("cleanup batch", zap.String("table", t.Qualified), zap.Int64("deleted", n), zap.Int64("total", tr.Deleted))
	if c.cfg.Pause > 0 {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(c.cfg.Pause):
		}
	}
	return nil
}
