package relay

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/reconcile"
	"github.com/outbox-relay/outbox-relay/router"
)

// streamed is what a backfill skips: per table, the event ids the event
// stream already holds, and the ids of rows older than its first stored
// message after its limits removed messages from its head.
type streamed struct {
	ids map[string]map[string]struct{}
	// expired is how many of the ids are there because their rows are
	// older than the stream's head, not because the stream holds them.
	expired int
}

func (s streamed) has(table string, id []byte) bool {
	_, ok := s.ids[table][string(id)]
	return ok
}

// waiting is the SQL that selects the rows a backfill of one table
// publishes, and the table's occurred-at column if it has one.
type waiting struct {
	ident, where, timeCol, eventID string
}

// streamedIDs reads the event stream's headers and returns what the
// backfill must skip. A slot is created again after a teardown, a lost
// slot or a failover: the outbox then still holds rows relayed long ago,
// past the stream's duplicate window, and the relay never marks rows
// published. Publishing only what the stream lacks keeps the backfill from
// storing every one of them a second time.
//
// The scan starts at the oldest waiting row's occurred-at time less
// reconcile's clock-skew margin (an event is stored after its row
// committed), and at the stream's beginning when a table has no such
// column. A row dated more than the margin ahead of its commit is not
// found and published again: a duplicate, never a loss. Rows older than
// the stream's first stored message, once its limits (max_age, max_msgs)
// removed older ones, are skipped as reconcile reports them (expired):
// their events may have been applied and forgotten by consumers. Memory:
// one id per event of those tables stored since then, and per such row.
func streamedIDs(ctx context.Context, js jetstream.JetStream, tx pgx.Tx, cfg Config) (streamed, error) {
	out := streamed{ids: map[string]map[string]struct{}{}}
	for _, table := range cfg.Replication.Tables {
		out.ids[table] = map[string]struct{}{}
	}
	tables, from, some, err := oldestWaiting(ctx, tx, cfg)
	if err != nil || !some {
		return out, err // no waiting row: nothing to look up
	}
	// Every subject, as reconcile reads it: an event stored under an
	// earlier subject template is still in the stream. One without
	// Outbox-Table (a polling relay's, another producer's) is no row's.
	res, err := reconcile.ScanStream(ctx, js, cfg.Stream.Name, nil, reconcile.ScanFrom{Time: from}, func(ev *reconcile.StreamEvent) error {
		if ids, ok := out.ids[ev.Table]; ok { // no Outbox-Table: no row's event
			ids[ev.EventID] = struct{}{}
		}
		return nil
	})
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return out, nil
	}
	if err != nil {
		return out, fmt.Errorf("read the event ids already in stream %s: %w", cfg.Stream.Name, err)
	}
	// No clock-skew margin past the head: a row dated after the newest
	// event the limits may have removed is published (a duplicate at
	// worst), never skipped (a loss).
	before := res.ExpiredBefore(0)
	if before.IsZero() {
		return out, nil
	}
	err = markExpired(ctx, tx, cfg, tables, before, &out)
	return out, err
}

// oldestWaiting returns the waiting rows of each table and where the scan
// of the stream starts: the oldest waiting row's time less the clock-skew
// margin, or the stream's beginning (zero) when a table has no such column.
// some is false when no row waits.
func oldestWaiting(ctx context.Context, tx pgx.Tx, cfg Config) (tables map[string]waiting, from time.Time, some bool, err error) {
	tables = make(map[string]waiting, len(cfg.Replication.Tables))
	fromStart := false
	for _, table := range cfg.Replication.Tables {
		w, err := waitingRows(ctx, tx, table, tableConfig(cfg.Router, table))
		if err != nil {
			return nil, from, false, err
		}
		tables[table] = w
		if w.timeCol == "" {
			fromStart = true
			continue
		}
		var oldest *time.Time
		if err := tx.QueryRow(ctx, "SELECT min("+w.timeCol+") FROM "+w.ident+w.where).Scan(&oldest); err != nil {
			return nil, from, false, fmt.Errorf("read the oldest row of %s: %w", table, err)
		}
		if oldest != nil {
			some = true
			if from.IsZero() || oldest.Before(from) {
				from = *oldest
			}
		}
	}
	switch {
	case fromStart:
		return tables, time.Time{}, true, nil
	case !some:
		return tables, from, false, nil
	}
	return tables, from.Add(-reconcile.DefaultClockSkew), true, nil
}

// markExpired adds to out the rows older than before, the stream's first
// stored message: they are skipped, and counted as expired.
func markExpired(ctx context.Context, tx pgx.Tx, cfg Config, tables map[string]waiting, before time.Time, out *streamed) error {
	for table, w := range tables {
		if w.timeCol == "" {
			continue
		}
		cond := " WHERE "
		if w.where != "" {
			cond = w.where + " AND "
		}
		rows, err := tx.Query(ctx, "SELECT "+w.eventID+"::text FROM "+w.ident+cond+w.timeCol+" < $1", before)
		if err != nil {
			return fmt.Errorf("read the rows of %s older than stream %s: %w", table, cfg.Stream.Name, err)
		}
		for rows.Next() {
			var id *string // NULL: the router dead-letters the row
			if err := rows.Scan(&id); err != nil {
				rows.Close()
				return fmt.Errorf("read the rows of %s older than stream %s: %w", table, cfg.Stream.Name, err)
			}
			if id == nil {
				continue
			}
			if _, ok := out.ids[table][*id]; !ok {
				out.ids[table][*id] = struct{}{}
				out.expired++
			}
		}
		if err := rows.Err(); err != nil {
			return fmt.Errorf("read the rows of %s older than stream %s: %w", table, cfg.Stream.Name, err)
		}
	}
	return nil
}

// waitingRows returns the SQL selecting the rows a backfill of table
// publishes (publish_state = 'PENDING' where the column exists) and its
// occurred-at and event id columns.
func waitingRows(ctx context.Context, tx pgx.Tx, table string, tc router.TableConfig) (waiting, error) {
	schema, name, _ := strings.Cut(table, ".")
	w := waiting{ident: pgx.Identifier{schema, name}.Sanitize()}
	col := or(tc.Columns.OccurredAt, router.DefaultOccurredAtColumn)
	idCol := or(tc.Columns.EventID, router.DefaultEventIDColumn)
	// The catalog first: an error on a missing column would abort the
	// snapshot's transaction.
	var hasTime, hasState, hasID bool
	if err := tx.QueryRow(ctx, `SELECT
  EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = $1::regclass AND attname = $2 AND NOT attisdropped AND format_type(atttypid, atttypmod) LIKE 'timestamp%'),
  EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = $1::regclass AND attname = $3 AND NOT attisdropped),
  EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = $1::regclass AND attname = $4 AND NOT attisdropped)`,
		w.ident, col, pendingColumn, idCol).Scan(&hasTime, &hasState, &hasID); err != nil {
		return w, fmt.Errorf("read columns of %s: %w", table, err)
	}
	if hasState {
		w.where = " WHERE " + pgx.Identifier{pendingColumn}.Sanitize() + " = 'PENDING'"
	}
	if hasTime && hasID {
		w.timeCol, w.eventID = pgx.Identifier{col}.Sanitize(), pgx.Identifier{idCol}.Sanitize()
	}
	return w, nil
}
