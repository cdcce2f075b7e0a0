package reconcile

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"

	"github.com/outbox-relay/outbox-relay/contract"
	"github.com/outbox-relay/outbox-relay/internal/provision"
	"github.com/outbox-relay/outbox-relay/replication"
	"github.com/outbox-relay/outbox-relay/router"
)

// Defaults of Config fields left at their zero value.
const (
	DefaultClockSkew   = time.Minute
	DefaultConfirmWait = 30 * time.Second
	DefaultMaxRows     = 5_000_000
	// MaxListed bounds the unexpected events listed in a Report (all are
	// counted).
	MaxListed = 1000
	// MaxLookedUp bounds the rows not found by the window's scan that Run
	// looks up by subject (see Report.FoundBySubject); with more, the
	// look-up is left to Repair, which does it before every publish.
	MaxLookedUp = 10_000
)

// Config says what to compare.
type Config struct {
	// Router is the relay's table mapping (the configuration's tables).
	Router router.Config
	// Stream and DeadLetterStream are the relay's streams.
	Stream, DeadLetterStream string
	// Slot is the relay's replication slot, whose confirmed position proves
	// that the rows read were relayed (see the package doc).
	Slot string
	// Since and Until bound the rows' occurred-at time: Since <= t < Until.
	// Until defaults to now.
	Since, Until time.Time
	// ClockSkew is subtracted from Since where the stream is read by storage
	// time. Default DefaultClockSkew.
	ClockSkew time.Duration
	// ConfirmWait bounds the wait for the slot to confirm the rows read.
	// Default DefaultConfirmWait; negative does not wait.
	ConfirmWait time.Duration
	// MaxRows bounds the rows read (memory: about 200 bytes each). Default
	// DefaultMaxRows.
	MaxRows int
}

func (c *Config) setDefaults(now time.Time) error {
	if c.Until.IsZero() {
		c.Until = now
	}
	if c.ClockSkew == 0 {
		c.ClockSkew = DefaultClockSkew
	}
	if c.ConfirmWait == 0 {
		c.ConfirmWait = DefaultConfirmWait
	}
	if c.MaxRows == 0 {
		c.MaxRows = DefaultMaxRows
	}
	switch {
	case c.Since.IsZero():
		return fmt.Errorf("%w: since is required (e.g. --since 24h)", ErrInvalidConfig)
	case !c.Until.After(c.Since):
		return fmt.Errorf("%w: until %s is not after since %s", ErrInvalidConfig, c.Until.Format(time.RFC3339), c.Since.Format(time.RFC3339))
	case c.Stream == "":
		return fmt.Errorf("%w: no event stream", ErrInvalidConfig)
	case c.ClockSkew < 0:
		return fmt.Errorf("%w: clock skew %s is negative", ErrInvalidConfig, c.ClockSkew)
	}
	return nil
}

// Event is one event reported by Run: a row (missing, pending or
// dead-lettered) or a stream message (unexpected).
type Event struct {
	Table            string    `json:"table"`
	AggregateType    string    `json:"aggregate_type"`
	AggregateID      string    `json:"aggregate_id"`
	AggregateVersion string    `json:"aggregate_version"`
	EventID          string    `json:"event_id"`
	OccurredAt       time.Time `json:"occurred_at"`
	// StreamSeq is set for unexpected events.
	StreamSeq uint64 `json:"stream_seq,omitempty"`
}

// Group counts one (table, aggregate type).
type Group struct {
	Table         string `json:"table"`
	AggregateType string `json:"aggregate_type"`
	// Rows is the rows in the window.
	Rows int `json:"rows"`
	// InStream is the rows whose event is in the stream.
	InStream int `json:"in_stream"`
	// Missing is the rows the relay provably had its chance to publish and
	// whose event is neither in the stream nor dead-lettered.
	Missing int `json:"missing"`
	// Pending is rows not in the stream while the slot has not confirmed
	// them yet: the relay may still be publishing them.
	Pending int `json:"pending"`
	// DeadLettered is rows whose event is only in the dead-letter stream.
	DeadLettered int `json:"dead_lettered"`
	// Expired is rows not in the streams and older than the event
	// stream's first stored message (plus the clock skew), after its
	// limits (max_age, max_msgs, max_bytes) removed messages from its
	// head: their event may have been stored and removed since, so they
	// cannot be checked, and are never repaired.
	Expired int `json:"expired"`
	// Unexpected is the events in the stream, in the window, whose row is
	// not in the table (deleted, or never written by this database).
	Unexpected int `json:"unexpected"`
	// SharedID is the rows in the window whose event id another row of the
	// table has too (a partitioned table's unique constraints hold per
	// partition only): one event id for two facts, so consumers keep one.
	SharedID int `json:"shared_id"`
	// NoEventID is the rows in the window whose event id is NULL (a table
	// without NOT NULL on it): the relay dead-letters them, and nothing
	// can match them with an event. Not counted in Rows.
	NoEventID int `json:"no_event_id"`
	// Duplicates is extra copies of an event stored more than once (a
	// re-publish after the duplicate window passed).
	Duplicates int `json:"duplicates"`
}

// Report is the outcome of Run.
type Report struct {
	Since time.Time `json:"since"`
	Until time.Time `json:"until"`
	// SnapshotLSN is pg_current_wal_insert_lsn() in the rows' snapshot
	// (pg_last_wal_replay_lsn() on a standby).
	SnapshotLSN string `json:"snapshot_lsn"`
	// ConfirmedLSN is the slot's confirmed_flush_lsn, read when some rows
	// were not found in the streams; empty when it was not needed or the
	// slot does not exist.
	ConfirmedLSN string `json:"slot_confirmed_lsn,omitempty"`
	// Confirmed reports that every row read is in a stream or that the
	// slot confirmed the snapshot: Missing is definitive. Otherwise the
	// rows not found are Pending.
	Confirmed bool `json:"confirmed"`
	// ExpiredBefore is the occurred-at time before which a row not in the
	// streams counts as expired, not missing; zero when the event stream
	// never removed messages from its head.
	ExpiredBefore *time.Time `json:"expired_before,omitempty"`
	// FoundBySubject is the rows the window's scan did not find whose event
	// a look-up of their subject found in the stream: stored before the
	// window's start, their row dated ahead of its commit (a writer's clock,
	// a business time). They count as in stream.
	FoundBySubject int `json:"found_by_subject"`
	// Tableless lists the configured message prefixes (table-less events
	// from pg_logical_emit_message): they have no rows, so nothing of them
	// is checked — neither missing events (only the slot's position and
	// the relay's dead letters vouch for them) nor unexpected ones.
	Tableless []string `json:"tableless_prefixes,omitempty"`
	// StreamMessages and DeadLetterMessages count the messages read.
	StreamMessages     uint64  `json:"stream_messages_read"`
	DeadLetterMessages uint64  `json:"dead_letter_messages_read"`
	Groups             []Group `json:"groups"`
	Total              Group   `json:"total"`
	// Missing lists every missing row; Pending every pending row,
	// DeadLettered every dead-lettered row, in (table, aggregate,
	// version) order.
	Missing      []Event `json:"missing"`
	Pending      []Event `json:"pending"`
	DeadLettered []Event `json:"dead_lettered"`
	// SharedID lists the first MaxListed rows whose event id an earlier row
	// of the same table has.
	SharedID []Event `json:"shared_id"`
	// NoOccurredAt counts, per table, the rows whose occurred-at time is
	// NULL: no time window selects them, so they are never reconciled (nor
	// cleaned up).
	NoOccurredAt map[string]int64 `json:"no_occurred_at,omitempty"`
	// NoEventID lists the first MaxListed rows without an event id (the
	// EventID field empty).
	NoEventID []Event `json:"no_event_id"`
	// Expired lists the first MaxListed expired rows, in the same order.
	Expired []Event `json:"expired"`
	// Unexpected lists up to MaxListed unexpected events.
	Unexpected []Event `json:"unexpected"`
	// Duration is how long the run took.
	Duration time.Duration `json:"duration_ns"`
}

// Differences is the number of missing, pending and unexpected events.
func (r *Report) Differences() int {
	return r.Total.Missing + r.Total.Pending + r.Total.Unexpected + r.Total.SharedID
}

// row is one outbox row of the window.
type row struct {
	ev    Event
	group *Group
	found int
	dlq   bool
	noID  bool // the event id is NULL
}

// Option configures Run and Repair.
type Option func(*options)

type options struct {
	log *zap.Logger
	now func() time.Time
}

// WithLogger sets the logger (default zap.NewNop()).
func WithLogger(l *zap.Logger) Option { return func(o *options) { o.log = l } }

func newOptions(opts []Option) options {
	o := options{log: zap.NewNop(), now: time.Now}
	for _, opt := range opts {
		opt(&o)
	}
	return o
}

// Run compares the rows whose occurred-at time is in [Since, Until) with
// the streams. It changes nothing.
func Run(ctx context.Context, db DB, js jetstream.JetStream, cfg Config, opts ...Option) (*Report, error) {
	o := newOptions(opts)
	start := o.now()
	if err := cfg.setDefaults(start); err != nil {
		return nil, err
	}
	tables, err := LoadTables(ctx, db, cfg.Router)
	if err != nil {
		return nil, err
	}
	rep := &Report{Since: cfg.Since.UTC(), Until: cfg.Until.UTC(), Tableless: Tableless(cfg.Router)}
	groups := map[[2]string]*Group{}
	group := func(table, aggType string) *Group {
		k := [2]string{table, aggType}
		g := groups[k]
		if g == nil {
			g = &Group{Table: table, AggregateType: aggType}
			groups[k] = g
		}
		return g
	}

	// 1. The rows, in one snapshot, and an LSN past all of their commits.
	rows := map[string]*row{}
	snapshot, err := readRows(ctx, db, tables, cfg, rep, func(r *row) error {
		if r.noID {
			// Report the row and go on: one bad row must not hide the
			// state of every other.
			group(r.ev.Table, r.ev.AggregateType).NoEventID++
			if len(rep.NoEventID) < MaxListed {
				rep.NoEventID = append(rep.NoEventID, r.ev)
			}
			return nil
		}
		if len(rows) >= cfg.MaxRows {
			return fmt.Errorf("%w: more than %d rows between %s and %s (reconcile a narrower window, e.g. --since/--until one day apart)",
				ErrTooManyRows, cfg.MaxRows, cfg.Since.Format(time.RFC3339), cfg.Until.Format(time.RFC3339))
		}
		k := key(r.ev.Table, r.ev.EventID)
		if rows[k] != nil {
			// Keyed by id, the second row would silently replace the
			// first, and one event would vouch for both.
			group(r.ev.Table, r.ev.AggregateType).SharedID++
			if len(rep.SharedID) < MaxListed {
				rep.SharedID = append(rep.SharedID, r.ev)
			}
			return nil
		}
		r.group = group(r.ev.Table, r.ev.AggregateType)
		r.group.Rows++
		rows[k] = r
		return nil
	})
	if err != nil {
		return nil, err
	}
	rep.SnapshotLSN = snapshot.String()
	// A stream that deletes events by itself would make every consumed
	// event look missing, and a repair would store it again.
	if _, err := provision.CheckStream(ctx, js, cfg.Stream); err != nil {
		return nil, err
	}

	known := make(map[string]bool, len(tables))
	for _, t := range tables {
		known[t.Qualified] = true
	}
	// The streams are read whole, not through today's subject templates:
	// an event stored under an earlier template is still its row's event.
	// An event is its row's only when it names the row's table
	// (contract.EventKey): one without Outbox-Table (another producer's, a
	// polling relay's) proves nothing of any row, or a foreign message
	// with a colliding id would vouch for a row never relayed.
	rowOf := func(ev *StreamEvent) *row {
		k, ok := contract.EventKey(ev.Table, ev.EventID)
		if !ok {
			return nil
		}
		return rows[k]
	}
	// 2. Dead letters: rows the relay could not publish are accounted for.
	markDLQ := func(ev *StreamEvent) error {
		if r := rowOf(ev); r != nil {
			r.dlq = true
		}
		return nil
	}
	var dlqScan ScanResult
	if cfg.DeadLetterStream != "" {
		dlqScan, err = ScanStream(ctx, js, cfg.DeadLetterStream, nil, ScanFrom{}, markDLQ)
		if errors.Is(err, jetstream.ErrStreamNotFound) {
			err = nil // no dead letter was ever written
		}
		if err != nil {
			return nil, err
		}
	}

	// 3. The events.
	var unexpected []*StreamEvent
	markFound := func(ev *StreamEvent) error {
		if r := rowOf(ev); r != nil {
			r.found++
		}
		return nil
	}
	evScan, err := ScanStream(ctx, js, cfg.Stream, nil, ScanFrom{Time: cfg.Since.Add(-cfg.ClockSkew)}, func(ev *StreamEvent) error {
		if r := rowOf(ev); r != nil {
			r.found++
			return nil
		}
		// Unexpected only on today's subjects (checked below, in their
		// published form, once the scan has read the stream's layout): a
		// stream may hold other producers' events too.
		if !known[ev.Table] {
			return nil
		}
		if ev.OccurredAt.IsZero() || ev.OccurredAt.Before(cfg.Since) || !ev.OccurredAt.Before(cfg.Until) {
			return nil
		}
		if len(unexpected) >= cfg.MaxRows {
			return fmt.Errorf("%w: more than %d events in the stream without a row between %s and %s (reconcile a narrower window)",
				ErrTooManyRows, cfg.MaxRows, cfg.Since.Format(time.RFC3339), cfg.Until.Format(time.RFC3339))
		}
		cp := *ev
		unexpected = append(unexpected, &cp)
		return nil
	})
	if err != nil {
		return nil, err
	}
	unexpected = onSubjects(unexpected, evScan.Layout, cfg.Router.SubjectFilters())
	rep.StreamMessages, rep.DeadLetterMessages = evScan.Messages, dlqScan.Messages
	if t := evScan.ExpiredBefore(cfg.ClockSkew); !t.IsZero() {
		t = t.UTC()
		rep.ExpiredBefore = &t
	}

	// 4. Rows not found yet: wait until the relay confirmed the snapshot.
	// From then on each is in a stream, unless it was never decoded or was
	// deleted since; the streams' tails hold those published meanwhile.
	unfound := 0
	for _, r := range rows {
		if r.found == 0 && !r.dlq && !rep.expired(r) {
			unfound++
		}
	}
	rep.Confirmed = true
	if unfound > 0 {
		confirmed, exists, err := waitConfirmed(ctx, db, cfg.Slot, snapshot, cfg.ConfirmWait)
		if err != nil {
			return nil, err
		}
		rep.Confirmed = exists && confirmed >= snapshot
		if exists {
			rep.ConfirmedLSN = confirmed.String()
		}
		if cfg.DeadLetterStream != "" {
			tail, err := ScanStream(ctx, js, cfg.DeadLetterStream, nil, ScanFrom{Seq: dlqScan.LastSeq + 1}, markDLQ)
			if err != nil && !errors.Is(err, jetstream.ErrStreamNotFound) {
				return nil, err
			}
			rep.DeadLetterMessages += tail.Messages
		}
		tail, err := ScanStream(ctx, js, cfg.Stream, nil, ScanFrom{Seq: evScan.LastSeq + 1}, markFound)
		if err != nil {
			return nil, err
		}
		rep.StreamMessages += tail.Messages
	}

	// 4b. The scan started at since minus the clock skew by storage time:
	// an event stored earlier, its row dated ahead of its commit, is not
	// missing. Look the rows still not found up by their subjects.
	if err := lookUpBySubject(ctx, db, js, cfg, evScan.Layout, tables, rows, rep); err != nil {
		return nil, err
	}

	// 5. An event without a row in the snapshot may belong to a transaction
	// that committed after it: look again.
	unexpected, err = recheck(ctx, db, tables, unexpected)
	if err != nil {
		return nil, err
	}
	for _, ev := range unexpected {
		g := group(ev.Table, ev.AggregateType)
		g.Unexpected++
		if len(rep.Unexpected) < MaxListed {
			rep.Unexpected = append(rep.Unexpected, Event{
				Table: ev.Table, AggregateType: ev.AggregateType, AggregateID: ev.AggregateID,
				AggregateVersion: ev.Version, EventID: ev.EventID, OccurredAt: ev.OccurredAt.UTC(), StreamSeq: ev.Seq,
			})
		}
	}

	rep.classify(rows)
	rep.summarise(groups)
	rep.Duration = o.now().Sub(start)
	return rep, nil
}

func key(table, id string) string { k, _ := contract.EventKey(table, id); return k }

// onSubjects keeps the events published on one of the filters: a
// partitioned stream stores them under another subject (layout).
func onSubjects(evs []*StreamEvent, layout contract.Layout, filters []string) []*StreamEvent {
	out := evs[:0]
	for _, ev := range evs {
		if contract.SubjectMatches(layout.Published(ev.Subject), filters...) {
			out = append(out, ev)
		}
	}
	return out
}

// lookUpBySubject marks found the rows in neither stream (and not expired)
// whose event is on its subject in the event stream, up to MaxLookedUp rows.
func lookUpBySubject(ctx context.Context, db DB, js jetstream.JetStream, cfg Config, layout contract.Layout, tables []*Table, rows map[string]*row, rep *Report) error {
	byTable := map[string][]Event{}
	n := 0
	for _, r := range rows {
		if r.found == 0 && !r.dlq && !rep.expired(r) {
			byTable[r.ev.Table] = append(byTable[r.ev.Table], r.ev)
			n++
		}
	}
	if n == 0 || n > MaxLookedUp {
		return nil
	}
	rt, err := router.New(cfg.Router)
	if err != nil {
		return fmt.Errorf("%w: %w", ErrInvalidConfig, err)
	}
	for _, t := range tables {
		evs := byTable[t.Qualified]
		for len(evs) > 0 {
			chunk := evs[:min(len(evs), repairChunk)]
			evs = evs[len(chunk):]
			rs, err := routeRows(ctx, db, t, rt, chunk, func(Event, string) {})
			if err != nil {
				return err
			}
			found, err := inStream(ctx, js, cfg.Stream, layout, t.Qualified, rs)
			if err != nil {
				return err
			}
			for id := range found {
				if r := rows[key(t.Qualified, id)]; r != nil && r.found == 0 {
					r.found++
					rep.FoundBySubject++
				}
			}
		}
	}
	return nil
}

// classify files every row of the window under its outcome.
func (rep *Report) classify(rows map[string]*row) {
	for _, r := range rows {
		switch {
		case r.found > 0:
			r.group.InStream++
			r.group.Duplicates += r.found - 1
		case r.dlq:
			r.group.DeadLettered++
			rep.DeadLettered = append(rep.DeadLettered, r.ev)
		case rep.expired(r):
			// Not a difference: whether the stream ever held it cannot be
			// told, and republishing an event consumers may have applied
			// and forgotten (docs/consumer.md allows pruning dedup rows
			// past the stream's max_age) would apply it twice.
			r.group.Expired++
			rep.Expired = append(rep.Expired, r.ev)
		case rep.Confirmed:
			r.group.Missing++
			rep.Missing = append(rep.Missing, r.ev)
		default:
			r.group.Pending++
			rep.Pending = append(rep.Pending, r.ev)
		}
	}
}

// summarise adds the groups up into Total and puts the groups and lists in
// their report order.
func (rep *Report) summarise(groups map[[2]string]*Group) {
	for _, g := range groups {
		rep.Groups = append(rep.Groups, *g)
		t := &rep.Total
		t.Rows += g.Rows
		t.InStream += g.InStream
		t.Missing += g.Missing
		t.Pending += g.Pending
		t.DeadLettered += g.DeadLettered
		t.Expired += g.Expired
		t.NoEventID += g.NoEventID
		t.SharedID += g.SharedID
		t.Unexpected += g.Unexpected
		t.Duplicates += g.Duplicates
	}
	sort.Slice(rep.Groups, func(i, j int) bool {
		a, b := rep.Groups[i], rep.Groups[j]
		if a.Table != b.Table {
			return a.Table < b.Table
		}
		return a.AggregateType < b.AggregateType
	})
	SortEvents(rep.Missing)
	SortEvents(rep.Pending)
	SortEvents(rep.DeadLettered)
	SortEvents(rep.Expired)
	SortEvents(rep.NoEventID)
	n := min(len(rep.Expired), MaxListed)
	rep.Expired = rep.Expired[:n:n]
}

// expired reports whether r's event may have been removed by the stream's
// limits (see Group.Expired).
func (rep *Report) expired(r *row) bool {
	return rep.ExpiredBefore != nil && r.ev.OccurredAt.Before(*rep.ExpiredBefore)
}

// SortEvents orders events by table, aggregate type, aggregate id and
// numeric version: the order Repair publishes them in.
func SortEvents(evs []Event) {
	sort.SliceStable(evs, func(i, j int) bool {
		a, b := &evs[i], &evs[j]
		switch {
		case a.Table != b.Table:
			return a.Table < b.Table
		case a.AggregateType != b.AggregateType:
			return a.AggregateType < b.AggregateType
		case a.AggregateID != b.AggregateID:
			return a.AggregateID < b.AggregateID
		}
		va, errA := strconv.ParseInt(a.AggregateVersion, 10, 64)
		vb, errB := strconv.ParseInt(b.AggregateVersion, 10, 64)
		if errA != nil || errB != nil {
			return a.AggregateVersion < b.AggregateVersion
		}
		return va < vb
	})
}

// snapshotLSN reads a WAL position past every commit the snapshot sees,
// on a primary and during recovery alike.
const snapshotLSN = `SELECT (CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn() ELSE pg_current_wal_insert_lsn() END)::text,
	set_config('TimeZone', 'UTC', true)`

// readRows reads the window's rows of every table in one REPEATABLE READ
// snapshot and returns an LSN after the commit of every row it saw.
func readRows(ctx context.Context, db DB, tables []*Table, cfg Config, rep *Report, fn func(*row) error) (replication.LSN, error) {
	tx, err := db.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly})
	if err != nil {
		return 0, fmt.Errorf("begin snapshot: %w", err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	// The first statement takes the snapshot; the insert position read
	// while it runs is past the commit record of every transaction the
	// snapshot sees (a commit record is written before the transaction
	// becomes visible). On a standby (decoding from PostgreSQL 16 on) no
	// WAL is inserted: the replay position is past every commit record
	// the snapshot sees (replayed before it becomes visible there).
	var lsnText string
	if err := tx.QueryRow(ctx, snapshotLSN).Scan(&lsnText, new(string)); err != nil {
		return 0, fmt.Errorf("read WAL position: %w", err)
	}
	lsn, err := replication.ParseLSN(lsnText)
	if err != nil {
		return 0, fmt.Errorf("parse WAL position %q: %w", lsnText, err)
	}
	for _, t := range tables {
		var noTime int64
		if err := tx.QueryRow(ctx, fmt.Sprintf("SELECT count(*) FROM %s WHERE %s IS NULL", t.Ident, t.Time)).Scan(&noTime); err != nil {
			return 0, fmt.Errorf("read %s: %w", t.Qualified, err)
		}
		if noTime > 0 {
			if rep.NoOccurredAt == nil {
				rep.NoOccurredAt = map[string]int64{}
			}
			rep.NoOccurredAt[t.Qualified] = noTime
		}
		q := fmt.Sprintf(`SELECT %s::text, %s, %s::text, %s::text, %s FROM %s WHERE %s >= $1 AND %s < $2`,
			t.EventID, t.aggType, t.aggID, t.version, t.Time, t.Ident, t.Time, t.Time)
		rs, err := tx.Query(ctx, q, cfg.Since, cfg.Until)
		if err != nil {
			return 0, fmt.Errorf("read %s: %w", t.Qualified, err)
		}
		for rs.Next() {
			var aggType string
			var id, aggID, version *string
			var at time.Time
			if err := rs.Scan(&id, &aggType, &aggID, &version, &at); err != nil {
				rs.Close()
				return 0, fmt.Errorf("read %s: %w", t.Qualified, err)
			}
			r := &row{ev: Event{Table: t.Qualified, AggregateType: aggType, OccurredAt: at.UTC()}, noID: id == nil}
			if id != nil {
				r.ev.EventID = *id
			}
			if aggID != nil {
				r.ev.AggregateID = *aggID
			}
			if version != nil {
				r.ev.AggregateVersion = *version
			}
			if err := fn(r); err != nil {
				rs.Close()
				return 0, err
			}
		}
		if err := rs.Err(); err != nil {
			return 0, fmt.Errorf("read %s: %w", t.Qualified, err)
		}
	}
	return lsn, tx.Commit(ctx)
}

// waitConfirmed polls the slot until its confirmed_flush_lsn reaches lsn or
// wait passes. exists is false when there is no such slot.
func waitConfirmed(ctx context.Context, db DB, slot string, lsn replication.LSN, wait time.Duration) (confirmed replication.LSN, exists bool, err error) {
	if slot == "" {
		return 0, false, nil
	}
	deadline := time.Now().Add(max(wait, 0))
	for {
		var text *string
		err := db.QueryRow(ctx, "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1", slot).Scan(&text)
		switch {
		case errors.Is(err, pgx.ErrNoRows):
			return 0, false, nil
		case err != nil:
			return 0, false, fmt.Errorf("read slot %s: %w", slot, err)
		}
		if text != nil {
			if confirmed, err = replication.ParseLSN(*text); err != nil {
				return 0, true, fmt.Errorf("parse confirmed_flush_lsn %q: %w", *text, err)
			}
		}
		if confirmed >= lsn || !time.Now().Before(deadline) {
			return confirmed, true, nil
		}
		select {
		case <-ctx.Done():
			return confirmed, true, ctx.Err()
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// recheck drops the events whose row exists now.
func recheck(ctx context.Context, db DB, tables []*Table, evs []*StreamEvent) ([]*StreamEvent, error) {
	if len(evs) == 0 {
		return evs, nil
	}
	byTable := map[string]*Table{}
	for _, t := range tables {
		byTable[t.Qualified] = t
	}
	present := map[string]bool{}
	const chunk = 1000
	pending := map[string][]string{}
	flush := func(table string) error {
		ids := pending[table]
		if len(ids) == 0 {
			return nil
		}
		pending[table] = ids[:0]
		t := byTable[table]
		rs, err := db.Query(ctx, fmt.Sprintf("SELECT %s::text FROM %s WHERE %s", t.EventID, t.Ident, t.IDIn("$1")), ids)
		if err != nil {
			return fmt.Errorf("recheck %s: %w", table, err)
		}
		defer rs.Close()
		for rs.Next() {
			var id string
			if err := rs.Scan(&id); err != nil {
				return fmt.Errorf("recheck %s: %w", table, err)
			}
			present[key(table, id)] = true
		}
		return rs.Err()
	}
	for _, ev := range evs {
		if !byTable[ev.Table].ValidID(ev.EventID) {
			continue // cannot be the id of a row
		}
		pending[ev.Table] = append(pending[ev.Table], ev.EventID)
		if len(pending[ev.Table]) >= chunk {
			if err := flush(ev.Table); err != nil {
				return nil, err
			}
		}
	}
	for table := range pending {
		if err := flush(table); err != nil {
			return nil, err
		}
	}
	out := evs[:0]
	for _, ev := range evs {
		if !present[key(ev.Table, ev.EventID)] {
			out = append(out, ev)
		}
	}
	return out, nil
}
