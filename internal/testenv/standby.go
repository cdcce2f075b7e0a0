package testenv

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
)

// StandbyOptions shape a physical standby made by [Postgres.StartStandby].
type StandbyOptions struct {
	// NoSlotSync leaves sync_replication_slots off on a PostgreSQL 17
	// standby (on by default from 17 on), so failover slots are not
	// synchronised to it.
	NoSlotSync bool
	// NoSynchronizedSlots leaves the primary's synchronized_standby_slots
	// empty (by default, on 17, it names the standby's physical slot, so
	// logical walsenders never send what the standby has not received).
	NoSynchronizedSlots bool
	// NoFeedback leaves hot_standby_feedback off (on by default).
	NoFeedback bool
	// Settings are postgresql.conf parameters of the standby.
	Settings map[string]string
}

// Standby is a physical standby of a private primary: a private cluster
// of its own (stop, start, promote) that streams the primary's WAL through
// a physical slot.
type Standby struct {
	*Postgres
	// PhysicalSlot is the primary's physical slot the standby streams from.
	PhysicalSlot string
	primary      *Postgres
}

// StartStandby makes a physical standby of the private primary p with
// pg_basebackup: a physical slot on p, hot_standby_feedback on, and, on
// PostgreSQL 17 and later, sync_replication_slots on the standby (its
// primary_conninfo names a database, which slot synchronisation needs) and
// synchronized_standby_slots on the primary naming the standby's slot.
// It returns once the standby streams from p. Close it with Close.
func (p *Postgres) StartStandby(o StandbyOptions) (*Standby, error) {
	if p.external {
		return nil, errors.New("a standby needs a private primary")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	slot := UniqueName("standby")
	if err := p.exec(ctx, "SELECT pg_create_physical_replication_slot($1, true)", slot); err != nil {
		return nil, fmt.Errorf("create physical slot %s on the primary: %w", slot, err)
	}
	base, err := os.MkdirTemp(p.server.tempBase(), "outbox-relay-standby-")
	if err != nil {
		return nil, err
	}
	s := &Standby{
		Postgres: &Postgres{
			server:  p.server,
			dataDir: filepath.Join(base, "data"),
			sockDir: filepath.Join(base, "sock"),
			logFile: filepath.Join(base, "postgres.log"),
			chownTo: p.chownTo, uid: p.uid, gid: p.gid,
		},
		PhysicalSlot: slot,
		primary:      p,
	}
	fail := func(err error) (*Standby, error) {
		s.Close()
		_ = p.exec(context.Background(), "SELECT pg_drop_replication_slot($1)", slot)
		return nil, err
	}
	if err := os.MkdirAll(s.sockDir, 0o700); err != nil {
		return fail(err)
	}
	if err := p.chown(base); err != nil {
		return fail(err)
	}
	conninfo := fmt.Sprintf("host=127.0.0.1 port=%d user=postgres dbname=postgres application_name=%s", p.port, slot)
	if out, err := s.run("pg_basebackup", "-D", s.dataDir, "-d", conninfo, "-X", "stream", "-S", slot, "--no-sync", "-c", "fast"); err != nil {
		return fail(fmt.Errorf("pg_basebackup: %w\n%s", err, out))
	}
	port, err := FreePort()
	if err != nil {
		return fail(err)
	}
	s.port = port
	settings := map[string]string{
		"port":                    strconv.Itoa(port),
		"unix_socket_directories": "'" + s.server.inside(s.sockDir) + "'",
		"primary_conninfo":        "'" + conninfo + "'",
		"primary_slot_name":       "'" + slot + "'",
		"hot_standby":             "on",
		"hot_standby_feedback":    onOff(!o.NoFeedback),
		// The primary's own choice must not follow its copy: a promoted
		// standby names no standby of its own.
		"synchronized_standby_slots": "''",
	}
	if p.server.major >= 17 {
		settings["sync_replication_slots"] = onOff(!o.NoSlotSync)
	} else {
		delete(settings, "synchronized_standby_slots")
	}
	for k, v := range o.Settings {
		settings[k] = v
	}
	if err := appendFile(filepath.Join(s.dataDir, "postgresql.conf"), confLines(settings)); err != nil {
		return fail(err)
	}
	if err := os.WriteFile(filepath.Join(s.dataDir, "standby.signal"), nil, 0o600); err != nil {
		return fail(err)
	}
	if err := p.chown(s.dataDir); err != nil {
		return fail(err)
	}
	s.AdminURL = fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", port)
	if err := s.Start(); err != nil {
		return fail(err)
	}
	if p.server.major >= 17 && !o.NoSynchronizedSlots {
		if err := p.SetSynchronizedStandbySlots(ctx, slot); err != nil {
			return fail(err)
		}
	}
	if err := s.WaitStreaming(ctx); err != nil {
		return fail(err)
	}
	return s, nil
}

// SetSynchronizedStandbySlots sets synchronized_standby_slots on the
// primary (slots "" clears it) and reloads the configuration.
func (p *Postgres) SetSynchronizedStandbySlots(ctx context.Context, slots string) error {
	if err := p.exec(ctx, "ALTER SYSTEM SET synchronized_standby_slots = "+quoteLiteral(slots)); err != nil {
		return fmt.Errorf("set synchronized_standby_slots: %w", err)
	}
	return p.exec(ctx, "SELECT pg_reload_conf()")
}

// WaitStreaming waits until the primary reports the standby's walreceiver
// streaming and the standby has replayed the primary's current WAL
// position.
func (s *Standby) WaitStreaming(ctx context.Context) error {
	var target string
	for {
		var state string
		err := s.primary.queryRow(ctx, "SELECT state FROM pg_stat_replication WHERE application_name = $1", []any{s.PhysicalSlot}, &state)
		if err == nil && state == "streaming" {
			break
		}
		if err := sleepCtx(ctx, 50*time.Millisecond); err != nil {
			return fmt.Errorf("standby %s never streamed (state %q): %w\n%s", s.PhysicalSlot, state, err, s.Log())
		}
	}
	if err := s.primary.queryRow(ctx, "SELECT pg_current_wal_flush_lsn()::text", nil, &target); err != nil {
		return err
	}
	return s.WaitReplayed(ctx, target)
}

// WaitReplayed waits until the standby has replayed WAL up to lsn.
func (s *Standby) WaitReplayed(ctx context.Context, lsn string) error {
	for {
		var ok bool
		err := s.queryRow(ctx, "SELECT pg_last_wal_replay_lsn() >= $1::pg_lsn", []any{lsn}, &ok)
		if err == nil && ok {
			return nil
		}
		if err := sleepCtx(ctx, 50*time.Millisecond); err != nil {
			return fmt.Errorf("standby did not replay up to %s: %w", lsn, err)
		}
	}
}

// Promote promotes the standby and waits until it accepts writes.
func (s *Standby) Promote() error {
	if out, err := s.run("pg_ctl", "-D", s.dataDir, "-w", "-t", "60", "promote"); err != nil {
		return fmt.Errorf("pg_ctl promote: %w\n%s", err, out)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for {
		var recovery bool
		if err := s.queryRow(ctx, "SELECT pg_is_in_recovery()", nil, &recovery); err == nil && !recovery {
			return nil
		}
		if err := sleepCtx(ctx, 20*time.Millisecond); err != nil {
			return fmt.Errorf("promoted standby still in recovery: %w", err)
		}
	}
}

// Exec runs one statement on the server's "postgres" database as the
// superuser.
func (p *Postgres) Exec(ctx context.Context, sql string, args ...any) error {
	return p.exec(ctx, sql, args...)
}

func (p *Postgres) exec(ctx context.Context, sql string, args ...any) error {
	conn, err := pgx.Connect(ctx, p.AdminURL)
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	_, err = conn.Exec(ctx, sql, args...)
	return err
}

func (p *Postgres) queryRow(ctx context.Context, sql string, args []any, dest ...any) error {
	qctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	conn, err := pgx.Connect(qctx, p.AdminURL)
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	return conn.QueryRow(qctx, sql, args...).Scan(dest...)
}

func sleepCtx(ctx context.Context, d time.Duration) error {
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(d):
		return nil
	}
}

func onOff(b bool) string {
	if b {
		return "on"
	}
	return "off"
}

func quoteLiteral(s string) string {
	return "'" + strings.ReplaceAll(s, "'", "''") + "'"
}
