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

// migrations upgrade, in place, the tables of an earlier sql/consumer.sql
// (which contains the same steps). Each step's probe says whether it is still
// needed, so a current schema runs no DDL and needs no privilege beyond the
// library's own.
var migrations = []struct {
	what, needed string
	ddl          []string
}{
	{
		what: "dead-letter records keyed by event, not by stream sequence alone",
		needed: `SELECT to_regclass('consumer_dead_letter_event_key') IS NULL
			OR to_regclass('consumer_dead_letter_message_key') IS NOT NULL`,
		ddl: []string{
			`CREATE UNIQUE INDEX IF NOT EXISTS consumer_dead_letter_event_key
				ON consumer_dead_letter (consumer, stream, stream_seq, event_id, sha256(payload))
				WHERE status IN ('open', 'replaying')`,
			`DROP INDEX IF EXISTS consumer_dead_letter_message_key`,
		},
	},
	{
		what: "the 'discarded' dedup outcome (dlq discard)",
		needed: `SELECT NOT EXISTS (SELECT 1 FROM pg_constraint WHERE conrelid = 'consumed_message'::regclass
			AND conname = 'consumed_message_outcome_check' AND pg_get_constraintdef(oid) LIKE '%discarded%')`,
		ddl: []string{
			`ALTER TABLE consumed_message DROP CONSTRAINT IF EXISTS consumed_message_outcome_check`,
			// NOT VALID: existing rows passed the narrower check; a large
			// table is not scanned under the exclusive lock.
			`ALTER TABLE consumed_message ADD CONSTRAINT consumed_message_outcome_check
				CHECK (outcome IN ('applied', 'rejected', 'discarded')) NOT VALID`,
		},
	},
}

// Migrate applies the upgrade steps an older schema lacks (see
// sql/consumer.sql, which has the same steps); [Consumer.Run] calls it after
// [CheckSchema]. A step that needs privileges the connection lacks fails
// with ErrSchemaOutdated naming the fix.
func Migrate(ctx context.Context, db DB) error {
	for _, m := range migrations {
		var needed bool
		if err := db.QueryRow(ctx, m.needed).Scan(&needed); err != nil {
			return fmt.Errorf("check schema upgrade (%s): %w", m.what, err)
		}
		if !needed {
			continue
		}
		if err := migrateStep(ctx, db, m.needed, m.ddl); err != nil {
			var pgErr *pgconn.PgError
			if errors.As(err, &pgErr) && pgErr.Code == pgerrcode.InsufficientPrivilege {
				return fmt.Errorf("%w: %s: %s; run sql/consumer.sql as the owner of the consumer tables", ErrSchemaOutdated, m.what, pgErr.Message)
			}
			return fmt.Errorf("upgrade schema (%s): %w", m.what, err)
		}
	}
	return nil
}

// migrateStep runs one step's DDL in a transaction. Processes starting
// together serialise on an advisory lock and check again under it, so only
// the first one alters the tables.
func migrateStep(ctx context.Context, db DB, needed string, ddl []string) error {
	tx, err := db.Begin(ctx)
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock(hashtext('outbox-relay consumer schema'))`); err != nil {
		return err
	}
	var still bool
	if err := tx.QueryRow(ctx, needed).Scan(&still); err != nil || !still {
		return err
	}
	for _, stmt := range ddl {
		if _, err := tx.Exec(ctx, stmt); err != nil {
			return err
		}
	}
	return tx.Commit(ctx)
}
