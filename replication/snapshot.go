package replication

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// ErrSlotExists means CreateSlotWithSnapshot found the slot already there:
// the rows before it were handled when it was created.
var ErrSlotExists = errors.New("replication slot already exists")

// SnapshotSlot is a slot just created together with an exported snapshot:
// every transaction committed before the slot's consistent point is
// visible in the snapshot, every later one will be streamed from the slot.
// Reading the outbox in the snapshot and then streaming from the slot
// therefore sees each row exactly once, with no gap.
type SnapshotSlot struct {
	// Snapshot is the exported snapshot's name, for SET TRANSACTION SNAPSHOT.
	Snapshot string
	// ConsistentPoint is where streaming from the slot starts.
	ConsistentPoint LSN
	// Actions says what was created (or found), in order.
	Actions []string
	conn    *pgconn.PgConn
}

// CreateSlotWithSnapshot ensures the publication, then creates the slot on
// a replication connection with an exported snapshot. The snapshot stays
// valid until Close; import it into a REPEATABLE READ transaction before
// that.
func CreateSlotWithSnapshot(ctx context.Context, cfg Config) (*SnapshotSlot, error) {
	if err := cfg.setDefaults(); err != nil {
		return nil, err
	}
	sql, err := connectSQL(ctx, cfg.URL)
	if err != nil {
		return nil, err
	}
	defer sql.Close(ctx)
	if err := checkServer(ctx, sql); err != nil {
		return nil, err
	}
	rep := &SetupReport{}
	if err := ensurePublication(ctx, sql, cfg, rep, true); err != nil {
		return nil, err
	}
	if err := checkPublication(ctx, sql, cfg); err != nil {
		return nil, err
	}
	st, err := slotStatus(ctx, sql, cfg.Slot)
	if err != nil {
		return nil, err
	}
	if st.Exists {
		return nil, fmt.Errorf("%w: %q", ErrSlotExists, cfg.Slot)
	}
	opts := "SNAPSHOT 'export'"
	if cfg.FailoverSlot {
		if err := checkFailoverSupport(ctx, sql); err != nil {
			return nil, err
		}
		opts += ", FAILOVER"
	}
	pcfg, err := pgconn.ParseConfig(cfg.URL)
	if err != nil {
		return nil, fmt.Errorf("parse postgres URL: %w", redactErr(err))
	}
	pcfg.RuntimeParams["replication"] = "database"
	pcfg.RuntimeParams["application_name"] = cfg.ApplicationName + " (backfill)"
	conn, err := pgconn.ConnectConfig(ctx, pcfg)
	if err != nil {
		return nil, fmt.Errorf("connect for replication to %s: %w", describe(*pcfg), err)
	}
	cmd := fmt.Sprintf("CREATE_REPLICATION_SLOT %s LOGICAL pgoutput (%s)", pgx.Identifier{cfg.Slot}.Sanitize(), opts)
	res, err := pglogrepl.ParseCreateReplicationSlot(conn.Exec(ctx, cmd))
	if err != nil {
		conn.Close(context.Background())
		return nil, fmt.Errorf("create slot %q with an exported snapshot: %w", cfg.Slot, err)
	}
	lsn, err := pglogrepl.ParseLSN(res.ConsistentPoint)
	if err != nil {
		conn.Close(context.Background())
		return nil, fmt.Errorf("%w: consistent point %q: %v", ErrProtocol, res.ConsistentPoint, err)
	}
	rep.add("created logical replication slot %s (pgoutput) with an exported snapshot, consistent point %s", cfg.Slot, lsn)
	return &SnapshotSlot{Snapshot: res.SnapshotName, ConsistentPoint: lsn, Actions: rep.Actions, conn: conn}, nil
}

// Close ends the replication connection, which releases the snapshot. The
// slot stays.
func (s *SnapshotSlot) Close(ctx context.Context) error {
	return s.conn.Close(ctx)
}
