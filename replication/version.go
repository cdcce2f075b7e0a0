package replication

import (
	"context"
	"fmt"
	"strconv"

	"github.com/jackc/pgx/v5"
)

// Server versions (server_version_num) where the features the relay can
// use appeared.
const (
	// VersionMessages: pgoutput's messages option (pg_logical_emit_message).
	VersionMessages = 140000
	// VersionStandbyDecoding: logical decoding on a hot standby.
	VersionStandbyDecoding = 160000
	// VersionFailoverSlots: failover slots, sync_replication_slots and
	// synchronized_standby_slots.
	VersionFailoverSlots = 170000
)

// ServerInfo is what the relay reads about a server before it uses it.
type ServerInfo struct {
	// VersionNum is server_version_num, e.g. 170012.
	VersionNum int
	// InRecovery is true on a standby.
	InRecovery bool
	// WALLevel is the server's own wal_level.
	WALLevel string
	// HotStandbyFeedback is the hot_standby_feedback setting (it matters
	// on a standby).
	HotStandbyFeedback bool
	// PrimarySlotName is primary_slot_name (on a standby).
	PrimarySlotName string
}

// Major returns the major version, e.g. 17.
func (s ServerInfo) Major() int { return s.VersionNum / 10000 }

// ReadServerInfo reads the server's version and the settings the relay's
// features depend on.
func ReadServerInfo(ctx context.Context, conn *pgx.Conn) (ServerInfo, error) {
	var s ServerInfo
	var feedback string
	err := conn.QueryRow(ctx, `SELECT current_setting('server_version_num')::int, pg_is_in_recovery(),
       current_setting('wal_level'), current_setting('hot_standby_feedback'),
       current_setting('primary_slot_name')`).Scan(&s.VersionNum, &s.InRecovery, &s.WALLevel, &feedback, &s.PrimarySlotName)
	if err != nil {
		return s, fmt.Errorf("read server version and settings: %w", err)
	}
	s.HotStandbyFeedback = feedback == "on"
	return s, nil
}

// CheckFeatures reports, as an ActionableError naming the version needed
// and the setting to change, the first feature cfg asks for that the
// server lacks: a failover slot (17), decoding on a standby (16, with
// hot_standby_feedback), pg_logical_emit_message records (14), and in every
// case wal_level = logical.
func (s ServerInfo) CheckFeatures(cfg Config) error {
	if s.WALLevel != "logical" {
		where := "in postgresql.conf (or ALTER SYSTEM SET wal_level = logical) and restart PostgreSQL"
		if s.InRecovery {
			where = "on this standby and on its primary, and restart them"
		}
		return actionable(ErrWalLevel, "set wal_level = logical "+where, "wal_level is %q", s.WALLevel)
	}
	if cfg.FailoverSlot && s.VersionNum < VersionFailoverSlots {
		return actionable(ErrFailoverUnsupported,
			"upgrade to PostgreSQL 17 (and set sync_replication_slots = on on the standbys), or set postgres.failover_slot: false and recover after a failover with setup and reconcile --repair (docs/operations.md)",
			"server is PostgreSQL %s (server_version_num %d)", versionString(s.VersionNum), s.VersionNum)
	}
	if cfg.Messages && s.VersionNum < VersionMessages {
		return actionable(ErrVersionUnsupported, "upgrade to PostgreSQL 14 or later, or remove the message prefixes from the configuration",
			"pgoutput sends pg_logical_emit_message records from PostgreSQL 14 on; server is PostgreSQL %s", versionString(s.VersionNum))
	}
	if !s.InRecovery {
		return nil
	}
	switch {
	case s.VersionNum < VersionStandbyDecoding:
		return actionable(ErrStandbyDecoding,
			"point postgres.url at the primary (list several hosts with target_session_attrs=read-write to follow a failover), or upgrade to PostgreSQL 16 or later to decode on a standby",
			"the server is a standby and PostgreSQL %s cannot decode logically on a standby (16 can)", versionString(s.VersionNum))
	case !s.HotStandbyFeedback:
		return actionable(ErrStandbyDecoding,
			"set hot_standby_feedback = on on the standby (and primary_slot_name to a physical slot on the primary), then reload it",
			"the server is a standby with hot_standby_feedback off: the primary's vacuum would remove catalog rows the slot needs and invalidate it")
	case cfg.FailoverSlot:
		return actionable(ErrStandbyDecoding,
			"set postgres.failover_slot: false for a relay that decodes on a standby (a standby's own slot cannot be a failover slot), or point postgres.url at the primary",
			"the server is a standby, and failover slots are created on the primary")
	}
	return nil
}

// versionString renders server_version_num as PostgreSQL prints it: 170012
// is "17.12", 90624 is "9.6.24".
func versionString(num int) string {
	if num >= 100000 {
		return strconv.Itoa(num/10000) + "." + strconv.Itoa(num%10000)
	}
	return fmt.Sprintf("%d.%d.%d", num/10000, num/100%100, num%100)
}

// checkFeatures reads the server's version and settings and checks them
// against cfg (see ServerInfo.CheckFeatures).
func checkFeatures(ctx context.Context, conn *pgx.Conn, cfg Config) (ServerInfo, error) {
	info, err := ReadServerInfo(ctx, conn)
	if err != nil {
		return info, err
	}
	return info, info.CheckFeatures(cfg)
}

// openChecks runs Open's checks on its plain connection: the server's
// version and settings against cfg, then the slot's row; a missing slot
// comes back as an error that says whether a failover explains it.
func openChecks(ctx context.Context, conn *pgx.Conn, cfg Config) (SlotStatus, error) {
	if _, err := checkFeatures(ctx, conn, cfg); err != nil {
		return SlotStatus{}, err
	}
	st, err := slotStatus(ctx, conn, cfg.Slot)
	if err == nil && !st.Exists {
		err = missingSlotError(ctx, conn, cfg.Slot)
	}
	return st, err
}
