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

// streamed is the event ids, per table, that the event stream already
// holds when a backfill starts.
type streamed map[string]map[string]struct{}

func (s streamed) has(table string, id []byte) bool {
	_, ok := s[table][string(id)]
	return ok
}

// streamedIDs reads the event stream's headers and returns the ids of the
// backfilled tables' events it holds. A slot is created again after a
// teardown, a lost slot or a failover: the outbox then still holds rows
// relayed long ago, past the stream's duplicate window, and the relay never
// marks rows published. Publishing only what the stream lacks keeps the
// backfill from storing every one of them a second time.
//
// The scan starts at the oldest waiting row's occurred-at time less
// reconcile's clock-skew margin (an event is stored after its row
// committed), and at the stream's beginning when a table has no such
// column. A row dated more than the margin ahead of its commit is not
// found and published again: a duplicate, never a loss. Memory: one id
// per event of those tables stored since then.
func streamedIDs(ctx context.Context, js jetstream.JetStream, tx pgx.Tx, cfg Config) (streamed, error) {
	out := streamed{}
	var from time.Time
	fromStart := false
	for _, table := range cfg.Replication.Tables {
		out[table] = map[string]struct{}{}
		oldest, ok, err := oldestWaiting(ctx, tx, table, tableConfig(cfg.Router, table))
		switch {
		case err != nil:
			return nil, err
		case !ok:
			fromStart = true
		case !oldest.IsZero() && (from.IsZero() || oldest.Before(from)):
			from = oldest
		}
	}
	switch {
	case fromStart:
		from = time.Time{}
	case from.IsZero():
		return out, nil // no waiting row: nothing to look up
	default:
		from = from.Add(-reconcile.DefaultClockSkew)
	}
	_, err := reconcile.ScanStream(ctx, js, cfg.Stream.Name, cfg.Router.SubjectFilters(), reconcile.ScanFrom{Time: from}, func(ev *reconcile.StreamEvent) error {
		if ids, ok := out[ev.Table]; ok {
			ids[ev.EventID] = struct{}{}
		}
		return nil
	})
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		err = nil
	}
	if err != nil {
		return nil, fmt.Errorf("read the event ids already in stream %s: %w", cfg.Stream.Name, err)
	}
	return out, nil
}

// oldestWaiting returns the oldest occurred-at time of the rows a backfill
// of table publishes (zero when there are none); ok is false when the
// table has no occurred-at column.
func oldestWaiting(ctx context.Context, tx pgx.Tx, table string, tc router.TableConfig) (oldest time.Time, ok bool, err error) {
	schema, name, _ := strings.Cut(table, ".")
	ident := pgx.Identifier{schema, name}.Sanitize()
	col := or(tc.Columns.OccurredAt, router.DefaultOccurredAtColumn)
	// The catalog first: an error on a missing column would abort the
	// snapshot's transaction.
	var hasTime, hasState bool
	if err := tx.QueryRow(ctx, `SELECT
  EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = $1::regclass AND attname = $2 AND NOT attisdropped AND format_type(atttypid, atttypmod) LIKE 'timestamp%'),
  EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = $1::regclass AND attname = $3 AND NOT attisdropped)`,
		ident, col, pendingColumn).Scan(&hasTime, &hasState); err != nil {
		return time.Time{}, false, fmt.Errorf("read columns of %s: %w", table, err)
	}
	if !hasTime {
		return time.Time{}, false, nil
	}
	q := "SELECT min(" + pgx.Identifier{col}.Sanitize() + ") FROM " + ident
	if hasState {
		q += " WHERE " + pgx.Identifier{pendingColumn}.Sanitize() + " = 'PENDING'"
	}
	var t *time.Time
	if err := tx.QueryRow(ctx, q).Scan(&t); err != nil {
		return time.Time{}, false, fmt.Errorf("read the oldest row of %s: %w", table, err)
	}
	if t == nil {
		return time.Time{}, true, nil
	}
	return *t, true, nil
}
