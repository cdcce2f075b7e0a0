package replication

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// SetupReport lists what Setup did, in order, for people to read.
type SetupReport struct {
	Actions []string
}

func (r *SetupReport) add(format string, args ...any) {
	r.Actions = append(r.Actions, fmt.Sprintf(format, args...))
}

// SlotStatus is a row of pg_replication_slots.
type SlotStatus struct {
	Exists    bool
	Plugin    string
	Database  string
	Active    bool
	ActivePID int32
	// WALStatus is reserved, extended, unreserved or lost.
	WALStatus         string
	ConfirmedFlushLSN LSN
	RestartLSN        LSN
	// RetainedBytes is pg_current_wal_lsn() - restart_lsn: the WAL the slot
	// keeps on the server's disk.
	RetainedBytes int64
	// LagBytes is pg_current_wal_lsn() - confirmed_flush_lsn.
	LagBytes int64
}

// Setup creates the publication and the slot if they do not exist and checks
// that the server can run the relay. It is idempotent: a second call reports
// that everything already exists.
func Setup(ctx context.Context, cfg Config) (*SetupReport, error) {
	if err := cfg.setDefaults(); err != nil {
		return nil, err
	}
	conn, err := connectSQL(ctx, cfg.URL)
	if err != nil {
		return nil, err
	}
	defer conn.Close(ctx)
	rep := &SetupReport{}
	if err := checkServer(ctx, conn); err != nil {
		return nil, err
	}
	if info, err := checkFeatures(ctx, conn, cfg); err != nil {
		return nil, err
	} else if info.InRecovery {
		return rep, setupOnStandby(ctx, conn, cfg, rep)
	}
	if err := ensurePublication(ctx, conn, cfg, rep, true); err != nil {
		return nil, err
	}
	if err := checkPublication(ctx, conn, cfg); err != nil {
		return nil, err
	}
	if err := ensureMessagePublication(ctx, conn, cfg, rep); err != nil {
		return nil, err
	}
	if err := ensureSlot(ctx, conn, cfg, rep, true); err != nil {
		return nil, err
	}
	return rep, nil
}

// ReadServer reads, on a connection of its own, the server's version and
// the settings the relay's features depend on: `setup` asks it whether the
// server is a standby, where nothing can be written.
func ReadServer(ctx context.Context, cfg Config) (ServerInfo, error) {
	conn, err := connectServerChecked(ctx, &cfg)
	if err != nil {
		return ServerInfo{}, err
	}
	defer conn.Close(ctx)
	return ReadServerInfo(ctx, conn)
}

// Check verifies, without changing anything, that the server, publication
// and slot are ready for streaming.
func Check(ctx context.Context, cfg Config) error {
	conn, err := connectServerChecked(ctx, &cfg)
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	if _, err := checkFeatures(ctx, conn, cfg); err != nil {
		return err
	}
	if err := ensurePublication(ctx, conn, cfg, &SetupReport{}, false); err != nil {
		return err
	}
	if err := checkPublication(ctx, conn, cfg); err != nil {
		return err
	}
	return ensureSlot(ctx, conn, cfg, &SetupReport{}, false)
}

// DropSlot drops the slot. The publication is left alone: it holds no WAL.
func DropSlot(ctx context.Context, cfg Config) (bool, error) {
	if err := cfg.setDefaults(); err != nil {
		return false, err
	}
	conn, err := connectSQL(ctx, cfg.URL)
	if err != nil {
		return false, err
	}
	defer conn.Close(ctx)
	st, err := slotStatus(ctx, conn, cfg.Slot)
	if err != nil {
		return false, err
	}
	if !st.Exists {
		return false, nil
	}
	// A slot of the same name that setup would refuse is not the relay's:
	// it belongs to another database's relay, or to another tool.
	if err := checkSlotOwner(ctx, conn, cfg.Slot, st, "it is not this relay's slot: leave it to its owner, or check postgres.url and postgres.slot"); err != nil {
		return false, err
	}
	if st, err = awaitRelease(ctx, conn, cfg.Slot, st); err != nil {
		return false, err
	}
	if st.Active {
		return false, slotInUse(cfg.Slot, st.ActivePID)
	}
	if _, err := conn.Exec(ctx, "SELECT pg_drop_replication_slot($1)", cfg.Slot); err != nil {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == pgerrcode.ObjectInUse {
			// A relay started between the look and the drop.
			return false, slotInUse(cfg.Slot, 0)
		}
		return false, fmt.Errorf("drop slot %q: %w", cfg.Slot, err)
	}
	// A record of an interrupted backfill belonged to the dropped slot; a
	// slot created later without a backfill must not be refused for it.
	return true, forgetBackfill(ctx, conn, cfg)
}

// SlotReleaseGrace is how long a look at an active slot waits for it to be
// released before it says the slot is in use. A relay that has just stopped
// has closed its replication connection, but its walsender exits in its own
// time and keeps the slot active until then: on a loaded server, after a
// `teardown` run right after the stop has looked. A relay still streaming
// holds the slot past the grace.
const SlotReleaseGrace = 5 * time.Second

// slotReleasePoll is how often an active slot is looked at again.
const slotReleasePoll = 50 * time.Millisecond

// awaitRelease reads the slot's status again while st says it is active,
// until it is released or SlotReleaseGrace has passed, and returns the last
// status read.
func awaitRelease(ctx context.Context, conn *pgx.Conn, slot string, st SlotStatus) (SlotStatus, error) {
	giveUp := time.Now().Add(SlotReleaseGrace)
	for st.Active && time.Now().Before(giveUp) {
		t := time.NewTimer(slotReleasePoll)
		select {
		case <-ctx.Done():
			t.Stop()
			return st, ctx.Err()
		case <-t.C:
		}
		var err error
		if st, err = slotStatus(ctx, conn, slot); err != nil {
			return st, err
		}
	}
	return st, nil
}

// slotInUse is the refusal to drop a slot a relay streams from (pid 0: not
// known).
func slotInUse(slot string, pid int32) error {
	const fix = "stop the relay before dropping its slot"
	if pid == 0 {
		return actionable(ErrSlotInUse, fix, "slot %q is streaming to a relay", slot)
	}
	return actionable(ErrSlotInUse, fix, "slot %q is streaming to pid %d (still after %s)", slot, pid, SlotReleaseGrace)
}

// ReleasedStatus is Status, except that an active slot is read again until
// it is released or SlotReleaseGrace has passed: an answer for a command
// that must not act while a relay streams, run right after one stopped.
func ReleasedStatus(ctx context.Context, url, slot string) (SlotStatus, error) {
	conn, err := connectSQL(ctx, url)
	if err != nil {
		return SlotStatus{}, err
	}
	defer conn.Close(ctx)
	st, err := slotStatus(ctx, conn, slot)
	if err != nil {
		return st, err
	}
	return awaitRelease(ctx, conn, slot, st)
}

// checkSlotOwner fails with ErrSlotMismatch, naming the slot's owner, when
// the existing slot st is not a pgoutput slot of the connection's database
// (a physical slot has neither).
func checkSlotOwner(ctx context.Context, conn *pgx.Conn, slot string, st SlotStatus, fix string) error {
	var db string
	if err := conn.QueryRow(ctx, "SELECT current_database()").Scan(&db); err != nil {
		return fmt.Errorf("read the current database: %w", err)
	}
	if st.Plugin == "pgoutput" && st.Database == db {
		return nil
	}
	if st.Plugin == "" {
		return actionable(ErrSlotMismatch, fix, "slot %q is a physical slot (a standby's or a backup tool's), not a logical pgoutput slot of database %q", slot, db)
	}
	return actionable(ErrSlotMismatch, fix, "slot %q uses plugin %q in database %q, want pgoutput in %q", slot, st.Plugin, st.Database, db)
}

// Status reads the slot's row of pg_replication_slots.
func Status(ctx context.Context, url, slot string) (SlotStatus, error) {
	conn, err := connectSQL(ctx, url)
	if err != nil {
		return SlotStatus{}, err
	}
	defer conn.Close(ctx)
	return slotStatus(ctx, conn, slot)
}

func connectSQL(ctx context.Context, url string) (*pgx.Conn, error) {
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		return nil, fmt.Errorf("parse postgres URL: %w", redactErr(err))
	}
	delete(cfg.RuntimeParams, "replication")
	// As on the replication connection: nothing read here may depend on
	// the database's or role's DateStyle and TimeZone.
	cfg.RuntimeParams["DateStyle"], cfg.RuntimeParams["TimeZone"] = "ISO", "UTC"
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("connect to postgres %s: %w", describe(cfg.Config), err)
	}
	return conn, nil
}

func describe(c pgconn.Config) string {
	return fmt.Sprintf("%s@%s:%d/%s", c.User, c.Host, c.Port, c.Database)
}

func checkServer(ctx context.Context, conn *pgx.Conn) error {
	var level string
	if err := conn.QueryRow(ctx, "SHOW wal_level").Scan(&level); err != nil {
		return fmt.Errorf("read wal_level: %w", err)
	}
	if level != "logical" {
		return actionable(ErrWalLevel, "set wal_level = logical in postgresql.conf (or ALTER SYSTEM SET wal_level = logical) and restart PostgreSQL", "wal_level is %q", level)
	}
	var canReplicate bool
	if err := conn.QueryRow(ctx, "SELECT rolreplication OR rolsuper FROM pg_roles WHERE rolname = current_user").Scan(&canReplicate); err != nil {
		return fmt.Errorf("read role attributes: %w", err)
	}
	if !canReplicate {
		var user string
		_ = conn.QueryRow(ctx, "SELECT current_user").Scan(&user)
		return actionable(ErrNoReplicationRole, fmt.Sprintf("run ALTER ROLE %s WITH REPLICATION as a superuser", pgx.Identifier{user}.Sanitize()), "role %q", user)
	}
	return nil
}

// publicationExists reports whether publication name exists.
func publicationExists(ctx context.Context, conn *pgx.Conn, name string) (bool, error) {
	var exists bool
	err := conn.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = $1)", name).Scan(&exists)
	if err != nil {
		return false, fmt.Errorf("look up publication %q: %w", name, err)
	}
	return exists, nil
}

// createdMeanwhile reports a CREATE PUBLICATION refused because another
// session created the publication after our look-up (the catalog's
// unique index answers first when both commit at once).
func createdMeanwhile(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && (pgErr.Code == pgerrcode.DuplicateObject || pgErr.Code == pgerrcode.UniqueViolation)
}

func ensurePublication(ctx context.Context, conn *pgx.Conn, cfg Config, rep *SetupReport, create bool) error {
	quoted, err := quotedTables(ctx, conn, cfg)
	if err != nil {
		return err
	}
	// Its operations and options are checkPublication's to judge.
	exists, err := publicationExists(ctx, conn, cfg.Publication)
	if err != nil {
		return err
	}
	name := pgx.Identifier{cfg.Publication}.Sanitize()
	if !exists {
		if !create {
			return actionable(ErrPublicationMissing, "run `outbox-relay setup`", "publication %q", cfg.Publication)
		}
		sql := createPublicationSQL(name, quoted)
		_, err := conn.Exec(ctx, sql)
		var pgErr *pgconn.PgError
		switch {
		case createdMeanwhile(err):
			// Another instance created it between our look-up and now.
			return ensurePublication(ctx, conn, cfg, rep, create)
		case errors.As(err, &pgErr) && pgErr.Code == pgerrcode.InsufficientPrivilege:
			return createPublicationRefused(cfg, sql, pgErr.Message)
		case err != nil:
			return fmt.Errorf("create publication %q: %w", cfg.Publication, err)
		}
		rep.add("created publication %s for %s (publish = 'insert')", cfg.Publication, strings.Join(cfg.Tables, ", "))
		return nil
	}
	for i, t := range cfg.Tables {
		in, err := inPublication(ctx, conn, cfg.Publication, splitQualified(t), quoted[i])
		if err != nil {
			return err
		}
		if in {
			continue
		}
		if !create {
			// The publication exists: "does not exist" would send the
			// operator looking for the wrong thing.
			return actionable(ErrPublicationMismatch, "run `outbox-relay setup`", "publication %q does not include table %s", cfg.Publication, t)
		}
		alter := addTableSQL(name, quoted[i])
		if _, err := conn.Exec(ctx, alter); err != nil {
			var pgErr *pgconn.PgError
			if errors.As(err, &pgErr) && pgErr.Code == pgerrcode.InsufficientPrivilege {
				return addTableRefused(cfg, t, alter, pgErr.Message)
			}
			return fmt.Errorf("add %s to publication %q: %w", t, cfg.Publication, err)
		}
		rep.add("added table %s to publication %s", t, cfg.Publication)
	}
	if len(rep.Actions) == 0 {
		rep.add("publication %s already exists", cfg.Publication)
	}
	return nil
}

func ensureSlot(ctx context.Context, conn *pgx.Conn, cfg Config, rep *SetupReport, create bool) error {
	if cfg.FailoverSlot {
		if err := checkFailoverSupport(ctx, conn); err != nil {
			return err
		}
	}
	st, err := slotStatus(ctx, conn, cfg.Slot)
	if err != nil {
		return err
	}
	if !st.Exists {
		if !create {
			return actionable(ErrSlotMissing, "run `outbox-relay setup`", "slot %q", cfg.Slot)
		}
		create := "SELECT pg_create_logical_replication_slot($1, 'pgoutput')"
		if cfg.FailoverSlot {
			// pg_create_logical_replication_slot(name, plugin, temporary, twophase, failover)
			create = "SELECT pg_create_logical_replication_slot($1, 'pgoutput', false, false, true)"
		}
		_, err := conn.Exec(ctx, create, cfg.Slot)
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == pgerrcode.DuplicateObject {
			// Another instance created it between our look-up and now.
			return ensureSlot(ctx, conn, cfg, rep, false)
		}
		if err != nil {
			return fmt.Errorf("create slot %q: %w", cfg.Slot, err)
		}
		rep.add("created logical replication slot %s (pgoutput)", cfg.Slot)
		return nil
	}
	if err := checkSlotOwner(ctx, conn, cfg.Slot, st, "choose another slot name in the configuration"); err != nil {
		return err
	}
	if st.WALStatus == "lost" {
		return slotLostError(cfg.Slot)
	}
	rep.add("slot %s already exists (confirmed_flush_lsn %s)", cfg.Slot, st.ConfirmedFlushLSN)
	return nil
}

// TerminateOrphan ends the walsender pid if it still holds the slot. After
// the relay declared its own connection dead (ErrServerSilent), the server
// keeps that walsender, and the slot, until its wal_sender_timeout; ending
// it lets the relay resume at once. It reports whether a backend was ended.
func TerminateOrphan(ctx context.Context, url, slot string, pid uint32) (bool, error) {
	conn, err := connectSQL(ctx, url)
	if err != nil {
		return false, err
	}
	defer conn.Close(ctx)
	var ended bool
	err = conn.QueryRow(ctx, `SELECT coalesce(bool_or(pg_terminate_backend(active_pid)), false)
FROM pg_replication_slots WHERE slot_name = $1 AND active_pid = $2`, slot, int64(pid)).Scan(&ended)
	if err != nil {
		return false, fmt.Errorf("end orphaned walsender %d of slot %q: %w", pid, slot, err)
	}
	return ended, nil
}

// checkFailoverSupport fails unless the server has failover slots
// (PostgreSQL 17+).
func checkFailoverSupport(ctx context.Context, conn *pgx.Conn) error {
	var version int
	if err := conn.QueryRow(ctx, "SELECT current_setting('server_version_num')::int").Scan(&version); err != nil {
		return fmt.Errorf("read server version: %w", err)
	}
	if version < 170000 {
		return actionable(ErrFailoverUnsupported, "upgrade to PostgreSQL 17 (and set sync_replication_slots = on on the standbys), or set postgres.failover_slot: false and recover after a failover with reconciliation", "server version %d", version)
	}
	return nil
}

func slotLostError(slot string) error {
	return actionable(ErrSlotLost,
		"the WAL of events committed after the slot's confirmed position was removed, so they were never relayed; "+
			"stop the relays, run `outbox-relay teardown --yes` and `outbox-relay setup` to start a new slot, then "+
			"`outbox-relay reconcile --since <when the relay last published, minus a margin> --repair --include-pending --confirm-wait 0` "+
			"to republish the missing events, start the relay, and raise max_slot_wal_keep_size "+
			"(docs/operations.md, \"Recovering after a lost slot\")",
		"slot %q has wal_status = 'lost'", slot)
}

func slotStatus(ctx context.Context, conn *pgx.Conn, slot string) (SlotStatus, error) {
	var st SlotStatus
	var plugin, database, walStatus *string
	var pid *int32
	var confirmed, restart *string
	var retained, lag *int64
	err := conn.QueryRow(ctx, `
SELECT plugin, database, active, active_pid, wal_status,
       confirmed_flush_lsn::text, restart_lsn::text,
       (`+CurrentLSN+` - restart_lsn)::bigint,
       (`+CurrentLSN+` - confirmed_flush_lsn)::bigint
FROM pg_replication_slots WHERE slot_name = $1`, slot).Scan(&plugin, &database, &st.Active, &pid, &walStatus, &confirmed, &restart, &retained, &lag)
	if errors.Is(err, pgx.ErrNoRows) {
		return st, nil
	}
	if err != nil {
		return st, fmt.Errorf("read slot %q: %w", slot, err)
	}
	st.Exists = true
	st.Plugin, st.Database, st.WALStatus = deref(plugin), deref(database), deref(walStatus)
	if pid != nil {
		st.ActivePID = *pid
	}
	if confirmed != nil {
		st.ConfirmedFlushLSN, _ = parseLSN(*confirmed)
	}
	if restart != nil {
		st.RestartLSN, _ = parseLSN(*restart)
	}
	if retained != nil {
		st.RetainedBytes = *retained
	}
	if lag != nil {
		st.LagBytes = *lag
	}
	return st, nil
}

func deref(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}

// splitQualified splits "schema.table" (or "table", meaning public.table).
func splitQualified(t string) pgx.Identifier {
	if i := strings.IndexByte(t, '.'); i >= 0 {
		return pgx.Identifier{t[:i], t[i+1:]}
	}
	return pgx.Identifier{"public", t}
}
