package replication

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
)

// OutboxWriter is a transaction that holds a write lock on an outbox table
// and may have written its commit record before a WAL position read
// earlier without being visible to a snapshot taken now.
type OutboxWriter struct {
	// PID is its backend's process id; 0 for a prepared transaction.
	PID int
	// GID names a prepared transaction ("" otherwise).
	GID string
	// State is its backend's pg_stat_activity state.
	State string
	// Since is when its transaction started.
	Since time.Time
}

func (o OutboxWriter) String() string {
	if o.PID == 0 {
		return fmt.Sprintf("prepared transaction %q (COMMIT PREPARED or ROLLBACK PREPARED it)", o.GID)
	}
	return fmt.Sprintf("pid %d (%s since %s)", o.PID, o.State, o.Since.UTC().Format(time.RFC3339))
}

// SettleBlockedError means SettleCommits gave up on writers of the outbox
// that stayed open.
type SettleBlockedError struct {
	Writers []OutboxWriter
	Err     error
}

func (e *SettleBlockedError) Error() string {
	names := make([]string, len(e.Writers))
	for i, w := range e.Writers {
		names[i] = w.String()
	}
	return fmt.Sprintf("wait for the transactions writing the outbox to end: %s still open: %v", strings.Join(names, ", "), e.Err)
}

func (e *SettleBlockedError) Unwrap() error { return e.Err }

// outboxWriters lists the lock holders that SettleCommits waits for: every
// transaction of this database holding a lock stronger than ACCESS SHARE
// on an outbox table, but this session's. A commit record is written while
// the transaction still holds its locks, and they are released only once
// it is visible. One idle in its transaction is waited for too: it may
// have written its rows during the gap, and pgoutput decodes a change with
// the catalog as of the change, so the slot skips a row written while the
// table was not published even when it commits later; only the fill, from
// the table once it is visible, publishes it. Transactions of other
// databases, or that never wrote an outbox table, cannot hold outbox rows.
const outboxWriters = `SELECT l.virtualtransaction, coalesce(a.pid, 0), coalesce(a.state, ''),
	coalesce(a.xact_start, p.prepared, now()), coalesce(p.gid, '')
FROM pg_locks l
LEFT JOIN pg_stat_activity a ON a.pid = l.pid
LEFT JOIN LATERAL (SELECT p.gid, p.prepared FROM pg_locks x JOIN pg_prepared_xacts p ON p.transaction = x.transactionid
	WHERE l.pid IS NULL AND x.pid IS NULL AND x.locktype = 'transactionid' AND x.virtualtransaction = l.virtualtransaction) p ON true
WHERE l.locktype = 'relation' AND l.granted AND l.mode <> 'AccessShareLock'
	AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
	AND l.relation IN (SELECT to_regclass(t) FROM unnest($1::text[]) t)
	AND l.pid IS DISTINCT FROM pg_backend_pid()`

// SettleCommits waits until every transaction that may have committed
// outbox rows before a WAL position read earlier is visible: a commit
// record is written before its transaction becomes visible, so that
// position may be past the commit of a transaction a snapshot taken now
// would not see. It waits only for the writers of the outbox tables
// (outboxWriters), never for an unrelated open transaction or one of
// another database. When ctx ends first it returns
// a *SettleBlockedError naming them.
func (w *PublicationWatch) SettleCommits(ctx context.Context) error {
	if err := w.connect(ctx); err != nil {
		return err
	}
	tables := make([]string, len(w.cfg.Tables))
	for i, t := range w.cfg.Tables {
		tables[i] = splitQualified(t).Sanitize()
	}
	first, err := w.outboxWriters(ctx, tables)
	if err != nil {
		return w.after(err)
	}
	for len(first) > 0 {
		select {
		case <-ctx.Done():
			return &SettleBlockedError{Writers: values(first), Err: ctx.Err()}
		case <-time.After(50 * time.Millisecond):
		}
		now, err := w.outboxWriters(ctx, tables)
		if err != nil {
			if ctx.Err() != nil {
				return &SettleBlockedError{Writers: values(first), Err: ctx.Err()}
			}
			return w.after(err)
		}
		for vxid := range first {
			if _, ok := now[vxid]; !ok {
				delete(first, vxid)
			}
		}
	}
	return nil
}

// outboxWriters reads the writers SettleCommits waits for, by virtual
// transaction id.
func (w *PublicationWatch) outboxWriters(ctx context.Context, tables []string) (map[string]OutboxWriter, error) {
	rows, err := w.conn.Query(ctx, outboxWriters, tables)
	if err != nil {
		return nil, fmt.Errorf("read the transactions writing the outbox: %w", err)
	}
	writers := map[string]OutboxWriter{}
	var vxid string
	var o OutboxWriter
	_, err = pgx.ForEachRow(rows, []any{&vxid, &o.PID, &o.State, &o.Since, &o.GID}, func() error {
		writers[vxid] = o
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("read the transactions writing the outbox: %w", err)
	}
	return writers, nil
}

func values(m map[string]OutboxWriter) []OutboxWriter {
	out := make([]OutboxWriter, 0, len(m))
	for _, o := range m {
		out = append(out, o)
	}
	return out
}
