package dlq

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/outbox-relay/outbox-relay/consumer"
	"github.com/outbox-relay/outbox-relay/contract"
)

// DB is what the store needs of the consumer's database: *pgxpool.Pool
// implements it.
type DB interface {
	Begin(ctx context.Context) (pgx.Tx, error)
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Record statuses (column consumer_dead_letter.status).
const (
	StatusOpen      = "open"
	StatusReplaying = "replaying"
	StatusReplayed  = "replayed"
	StatusDiscarded = "discarded"
)

// Audit actions.
const (
	ActionReplay  = "replay"
	ActionDiscard = "discard"
)

// Record is one row of consumer_dead_letter.
type Record struct {
	ID                int64               `json:"id"`
	Consumer          string              `json:"consumer"`
	Owner             string              `json:"owner"`
	EventID           string              `json:"event_id"`
	EventType         string              `json:"event_type,omitempty"`
	AggregateType     string              `json:"aggregate_type,omitempty"`
	AggregateID       *string             `json:"aggregate_id,omitempty"`
	AggregateVersion  *int64              `json:"aggregate_version,omitempty"`
	Subject           string              `json:"subject"`
	Stream            string              `json:"stream"`
	StreamSeq         int64               `json:"stream_seq"`
	Deliveries        int64               `json:"deliveries"`
	Headers           map[string][]string `json:"headers"`
	Payload           []byte              `json:"payload"`
	Class             string              `json:"failure_class"`
	Reason            string              `json:"reason"`
	Attempts          int                 `json:"attempts"`
	FirstFailedAt     time.Time           `json:"first_failed_at"`
	LastFailedAt      time.Time           `json:"last_failed_at"`
	DeadLetteredAt    time.Time           `json:"dead_lettered_at"`
	Status            string              `json:"status"`
	ReplayToken       *uuid.UUID          `json:"replay_token,omitempty"`
	ReplayRequestedAt *time.Time          `json:"replay_requested_at,omitempty"`
	ReplayRequestedBy *string             `json:"replay_requested_by,omitempty"`
	ReplayCount       int                 `json:"replay_count"`
	ReplayOutcome     *string             `json:"replay_outcome,omitempty"`
	ResolvedAt        *time.Time          `json:"resolved_at,omitempty"`
	ResolvedBy        *string             `json:"resolved_by,omitempty"`
	ResolutionReason  *string             `json:"resolution_reason,omitempty"`
}

const recordColumns = `id, consumer, owner, event_id, COALESCE(event_type, ''), COALESCE(aggregate_type, ''), aggregate_id,
	aggregate_version, subject, stream, stream_seq, deliveries, headers, payload, failure_class, reason, attempts,
	first_failed_at, last_failed_at, dead_lettered_at, status, replay_token, replay_requested_at, replay_requested_by,
	replay_count, replay_outcome, resolved_at, resolved_by, resolution_reason`

func scanRecord(row pgx.Row) (Record, error) {
	var r Record
	err := row.Scan(&r.ID, &r.Consumer, &r.Owner, &r.EventID, &r.EventType, &r.AggregateType, &r.AggregateID,
		&r.AggregateVersion, &r.Subject, &r.Stream, &r.StreamSeq, &r.Deliveries, &r.Headers, &r.Payload, &r.Class,
		&r.Reason, &r.Attempts, &r.FirstFailedAt, &r.LastFailedAt, &r.DeadLetteredAt, &r.Status, &r.ReplayToken,
		&r.ReplayRequestedAt, &r.ReplayRequestedBy, &r.ReplayCount, &r.ReplayOutcome, &r.ResolvedAt, &r.ResolvedBy,
		&r.ResolutionReason)
	return r, err
}

// Filter selects records. Zero fields do not filter, except Statuses,
// which defaults to open and replaying records.
type Filter struct {
	IDs       []int64
	Consumer  string
	Class     string
	Statuses  []string // "all" as the only element selects every status
	OlderThan time.Duration
	NewerThan time.Duration
	Limit     int // 0: no limit
}

func (f Filter) where(now time.Time) (string, []any) {
	var conds []string
	var args []any
	add := func(cond string, arg any) {
		args = append(args, arg)
		conds = append(conds, fmt.Sprintf(cond, len(args)))
	}
	if len(f.IDs) > 0 {
		add("id = ANY($%d)", f.IDs)
	}
	if f.Consumer != "" {
		add("consumer = $%d", f.Consumer)
	}
	if f.Class != "" {
		add("failure_class = $%d", f.Class)
	}
	switch {
	case len(f.Statuses) == 1 && f.Statuses[0] == "all":
	case len(f.Statuses) > 0:
		add("status = ANY($%d)", f.Statuses)
	default:
		add("status = ANY($%d)", []string{StatusOpen, StatusReplaying})
	}
	if f.OlderThan > 0 {
		add("dead_lettered_at < $%d", now.Add(-f.OlderThan))
	}
	if f.NewerThan > 0 {
		add("dead_lettered_at >= $%d", now.Add(-f.NewerThan))
	}
	if len(conds) == 0 {
		return "TRUE", nil
	}
	return strings.Join(conds, " AND "), args
}

// Store reads and acts on consumer dead letters (sql/consumer.sql).
type Store struct {
	db  DB
	now func() time.Time
}

// NewStore returns a store on db.
func NewStore(db DB) *Store { return &Store{db: db, now: time.Now} }

// List returns the records matching f, oldest first.
func (s *Store) List(ctx context.Context, f Filter) ([]Record, error) {
	where, args := f.where(s.now())
	q := "SELECT " + recordColumns + " FROM consumer_dead_letter WHERE " + where + " ORDER BY dead_lettered_at, id"
	if f.Limit > 0 {
		q += fmt.Sprintf(" LIMIT %d", f.Limit)
	}
	rows, err := s.db.Query(ctx, q, args...)
	if err != nil {
		return nil, fmt.Errorf("list dead letters: %w", err)
	}
	recs, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Record, error) { return scanRecord(r) })
	if err != nil {
		return nil, fmt.Errorf("list dead letters: %w", err)
	}
	return recs, nil
}

// Get returns one record, in any status.
func (s *Store) Get(ctx context.Context, id int64) (Record, error) {
	r, err := scanRecord(s.db.QueryRow(ctx, "SELECT "+recordColumns+" FROM consumer_dead_letter WHERE id = $1", id))
	if errors.Is(err, pgx.ErrNoRows) {
		return r, fmt.Errorf("%w: id %d", ErrNotFound, id)
	}
	if err != nil {
		return r, fmt.Errorf("read dead letter %d: %w", id, err)
	}
	return r, nil
}

// Action is who does an audited action and why.
type Action struct {
	Actor  string
	Reason string
}

// Ticket identifies a replay request.
type Ticket struct {
	Token uuid.UUID
	IDs   []int64
}

// RequestReplay marks the open records selected by f (which must select
// something) as 'replaying' and audits it, in one transaction. Each record
// is then applied by its own consumer, and only by it, when it next polls
// for replay requests (consumer.Config.ReplayPollInterval). Records selected
// by id must all be open.
func (s *Store) RequestReplay(ctx context.Context, act Action, f Filter) (Ticket, error) {
	if act.Actor == "" {
		return Ticket{}, ErrActorRequired
	}
	token := uuid.New()
	ids, err := s.transition(ctx, act, ActionReplay, f, nil, `
		UPDATE consumer_dead_letter
		SET status = 'replaying', replay_token = $2, replay_requested_at = CURRENT_TIMESTAMP, replay_requested_by = $3
		WHERE id = ANY($1)`, token, act.Actor)
	if err != nil {
		return Ticket{}, err
	}
	return Ticket{Token: token, IDs: ids}, nil
}

// Discard closes the open records selected by f without applying them and
// audits it, in one transaction. The reason is required. Records stay in the
// table as history with status 'discarded'. In the same transaction each
// discarded event is recorded in consumed_message with outcome 'discarded'
// (so a redelivery is a duplicate, not applied), and an aggregate whose
// version-check position stands just before the discarded version is moved
// past it (so the consumer's later versions are not gaps for good); the
// consumer also skips discarded versions when it finds a gap.
func (s *Store) Discard(ctx context.Context, act Action, f Filter) ([]int64, error) {
	if act.Actor == "" {
		return nil, ErrActorRequired
	}
	if strings.TrimSpace(act.Reason) == "" {
		return nil, fmt.Errorf("%w: say why the dead letters may be dropped (--reason)", ErrReasonRequired)
	}
	return s.transition(ctx, act, ActionDiscard, f, settleDiscarded, `
		UPDATE consumer_dead_letter
		SET status = 'discarded', resolved_at = CURRENT_TIMESTAMP, resolved_by = $2, resolution_reason = $3
		WHERE id = ANY($1)`, act.Actor, act.Reason)
}

// selected is a dead letter chosen for an action, locked by transition.
type selected struct {
	id                                    int64
	consumer, eventID, status, class, why string
	eventType, aggType                    string
	aggID                                 *string
	version                               *int64
	payload                               []byte
}

// settleDiscarded records a discarded event in the dedup table and moves
// its aggregate's position past it (consumer.RecordDiscard); it returns what
// it did for the audit. A record without a usable identity (a message
// breaking the header contract) has nothing to record.
func settleDiscarded(ctx context.Context, tx pgx.Tx, x selected, reason string) (map[string]any, error) {
	if x.eventID == "" || x.aggID == nil || x.version == nil {
		return nil, nil
	}
	d, err := consumer.RecordDiscard(ctx, tx, x.consumer, &contract.Event{ID: x.eventID, Type: x.eventType,
		AggregateType: x.aggType, AggregateID: *x.aggID, AggregateVersion: *x.version, Payload: x.payload}, reason)
	if err != nil {
		return nil, err
	}
	detail := map[string]any{"dedup_recorded": d.DedupRecorded}
	if d.PositionMoved {
		detail["position_moved_to"] = *x.version
	}
	return detail, nil
}

// transition locks the selected records, checks they are open, runs update
// on them, then each (when not nil) on every record in aggregate and version
// order, and writes one audit row per record, all in one transaction.
func (s *Store) transition(ctx context.Context, act Action, action string, f Filter,
	each func(context.Context, pgx.Tx, selected, string) (map[string]any, error), update string, args ...any) ([]int64, error) {
	if len(f.IDs) == 0 && f.Consumer == "" {
		return nil, fmt.Errorf("%w: name record ids, or a consumer (with --all or filters)", ErrUsage)
	}
	f.Statuses = []string{"all"}
	f.Limit = 0
	tx, err := s.db.Begin(ctx)
	if err != nil {
		return nil, fmt.Errorf("begin: %w", err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	where, wargs := f.where(s.now())
	if len(f.IDs) == 0 {
		// Selected by filter: act on the open ones only.
		wargs = append(wargs, StatusOpen)
		where += fmt.Sprintf(" AND status = $%d", len(wargs))
	}
	rows, err := tx.Query(ctx, `SELECT id, consumer, event_id, status, failure_class, reason, COALESCE(event_type, ''),
			COALESCE(aggregate_type, ''), aggregate_id, aggregate_version, payload
		FROM consumer_dead_letter
		WHERE `+where+` ORDER BY aggregate_type NULLS FIRST, aggregate_id NULLS FIRST, aggregate_version NULLS FIRST, stream_seq, id
		FOR UPDATE`, wargs...)
	if err != nil {
		return nil, fmt.Errorf("select dead letters: %w", err)
	}
	selected, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (selected, error) {
		var x selected
		err := r.Scan(&x.id, &x.consumer, &x.eventID, &x.status, &x.class, &x.why, &x.eventType, &x.aggType,
			&x.aggID, &x.version, &x.payload)
		return x, err
	})
	if err != nil {
		return nil, fmt.Errorf("select dead letters: %w", err)
	}
	found := map[int64]bool{}
	var notOpen []string
	ids := make([]int64, 0, len(selected))
	for _, x := range selected {
		found[x.id] = true
		if x.status != StatusOpen {
			notOpen = append(notOpen, fmt.Sprintf("%d is %s", x.id, x.status))
		}
		ids = append(ids, x.id)
	}
	for _, id := range f.IDs {
		if !found[id] {
			return nil, fmt.Errorf("%w: id %d", ErrNotFound, id)
		}
	}
	if len(notOpen) > 0 {
		return nil, fmt.Errorf("%w: %s", ErrNotOpen, strings.Join(notOpen, ", "))
	}
	if len(ids) == 0 {
		return nil, ErrNothingSelected
	}
	if _, err := tx.Exec(ctx, update, append([]any{ids}, args...)...); err != nil {
		return nil, fmt.Errorf("update dead letters: %w", err)
	}
	for _, x := range selected {
		d := map[string]any{"failure_class": x.class, "reason": x.why}
		if each != nil {
			extra, err := each(ctx, tx, x, act.Reason)
			if err != nil {
				return nil, err
			}
			for k, v := range extra {
				d[k] = v
			}
		}
		detail, _ := json.Marshal(d)
		if _, err := tx.Exec(ctx, `INSERT INTO consumer_dlq_audit (actor, action, consumer, dead_letter_id, event_id, reason, detail)
			VALUES ($1, $2, $3, $4, $5, $6, $7)`, act.Actor, action, x.consumer, x.id, x.eventID, act.Reason, detail); err != nil {
			return nil, fmt.Errorf("audit %s of dead letter %d: %w", action, x.id, err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		return nil, fmt.Errorf("commit: %w", err)
	}
	return ids, nil
}

// Progress counts the records of one replay request by state.
type Progress struct {
	Total     int
	Waiting   int // still 'replaying'
	Applied   int
	Duplicate int
	Rejected  int
	Failed    int // back to open: failed again, or held back by an earlier failure of the aggregate
	Other     int // discarded or requested again meanwhile
}

// Done reports whether no record waits anymore.
func (p Progress) Done() bool { return p.Waiting == 0 }

// ReplayProgress reports the state of the records of t.
func (s *Store) ReplayProgress(ctx context.Context, t Ticket) (Progress, error) {
	rows, err := s.db.Query(ctx, `SELECT status, COALESCE(replay_outcome, ''), COALESCE(replay_token = $2, false), count(*)
		FROM consumer_dead_letter WHERE id = ANY($1) GROUP BY 1, 2, 3`, t.IDs, t.Token)
	if err != nil {
		return Progress{}, fmt.Errorf("read replay progress: %w", err)
	}
	defer rows.Close()
	p := Progress{Total: len(t.IDs)}
	for rows.Next() {
		var status, outcome string
		var mine bool
		var n int
		if err := rows.Scan(&status, &outcome, &mine, &n); err != nil {
			return Progress{}, err
		}
		switch {
		case !mine:
			p.Other += n
		case status == StatusReplaying:
			p.Waiting += n
		case status == StatusOpen:
			p.Failed += n
		case status == StatusReplayed && outcome == "applied":
			p.Applied += n
		case status == StatusReplayed && outcome == "duplicate":
			p.Duplicate += n
		case status == StatusReplayed && outcome == "rejected":
			p.Rejected += n
		default:
			p.Other += n
		}
	}
	return p, rows.Err()
}

// AuditEntry is one audited action, on a consumer record or a relay record.
type AuditEntry struct {
	At     time.Time `json:"at"`
	Actor  string    `json:"actor"`
	Action string    `json:"action"`
	// Queue is the consumer name, or "relay:<stream>".
	Queue string `json:"queue"`
	// Record is the consumer record id, or the relay record's stream sequence.
	Record  int64           `json:"record"`
	EventID string          `json:"event_id,omitempty"`
	Reason  string          `json:"reason"`
	Detail  json.RawMessage `json:"detail,omitempty"`
}

// AuditFilter selects audit entries. Zero fields do not filter.
type AuditFilter struct {
	Consumer string
	Since    time.Duration
	Limit    int
}

// Audit returns the audited actions on consumer dead letters, oldest first;
// with a Limit, the latest Limit entries.
func (s *Store) Audit(ctx context.Context, f AuditFilter) ([]AuditEntry, error) {
	q := `SELECT at, actor, action, consumer, dead_letter_id, event_id, reason, detail FROM consumer_dlq_audit
		WHERE ($1 = '' OR consumer = $1) AND ($2::timestamptz IS NULL OR at >= $2) ORDER BY at DESC, id DESC`
	var since *time.Time
	if f.Since > 0 {
		t := s.now().Add(-f.Since)
		since = &t
	}
	if f.Limit > 0 {
		q += fmt.Sprintf(" LIMIT %d", f.Limit)
	}
	rows, err := s.db.Query(ctx, q, f.Consumer, since)
	if err != nil {
		return nil, fmt.Errorf("read audit: %w", err)
	}
	entries, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (AuditEntry, error) {
		var e AuditEntry
		var detail []byte
		err := r.Scan(&e.At, &e.Actor, &e.Action, &e.Queue, &e.Record, &e.EventID, &e.Reason, &detail)
		e.Detail = detail
		return e, err
	})
	if err != nil {
		return nil, fmt.Errorf("read audit: %w", err)
	}
	slices.Reverse(entries)
	return entries, nil
}
