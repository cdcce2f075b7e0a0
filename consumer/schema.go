package consumer

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5/pgconn"
)

// schemaProbes select every column the library uses, so a missing table or
// an outdated one fails at start-up instead of on the first message.
var schemaProbes = []struct{ table, query string }{
	{"consumed_message", `SELECT consumer, event_id, consumed_at, content_hash, event_type, aggregate_type,
		aggregate_id, aggregate_version, outcome, reason FROM consumed_message LIMIT 0`},
	{"consumer_aggregate_position", `SELECT consumer, aggregate_type, aggregate_id, version, event_id,
		content_hash, updated_at FROM consumer_aggregate_position LIMIT 0`},
	{"consumer_dead_letter", `SELECT id, consumer, owner, event_id, event_type, aggregate_type, aggregate_id,
		aggregate_version, subject, stream, stream_seq, deliveries, headers, payload, failure_class, reason,
		attempts, first_failed_at, last_failed_at, dead_lettered_at, status, replay_token, replay_requested_at,
		replay_requested_by, replay_count, replay_outcome, resolved_at, resolved_by, resolution_reason
		FROM consumer_dead_letter LIMIT 0`},
	{"consumer_dlq_audit", `SELECT id, at, actor, action, consumer, dead_letter_id, event_id, reason, detail
		FROM consumer_dlq_audit LIMIT 0`},
}

// CheckSchema verifies that db has the tables and columns of sql/consumer.sql.
// A missing table or column is reported as ErrSchemaMissing naming it.
func CheckSchema(ctx context.Context, db DB) error {
	for _, p := range schemaProbes {
		rows, err := db.Query(ctx, p.query)
		if err == nil {
			rows.Close()
			err = rows.Err()
		}
		if err == nil {
			continue
		}
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && (pgErr.Code == pgerrcode.UndefinedTable || pgErr.Code == pgerrcode.UndefinedColumn) {
			return fmt.Errorf("%w: table %s: %s; run sql/consumer.sql in the consumer's database", ErrSchemaMissing, p.table, pgErr.Message)
		}
		return fmt.Errorf("check table %s: %w", p.table, err)
	}
	return nil
}
