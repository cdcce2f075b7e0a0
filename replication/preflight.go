package replication

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"
)

// Preflight checks, changing nothing, what Setup would otherwise find only
// after `setup` had created the streams or recorded a backfill: that the
// server accepts the connection, wal_level and the role's REPLICATION
// attribute, the configured features, that every table exists, that the
// publication carries the tables or this role can create or extend it,
// and that an existing slot is the relay's and not lost. It fails with the
// error Setup would fail with.
func Preflight(ctx context.Context, cfg Config) error {
	conn, err := connectServerChecked(ctx, &cfg)
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	info, err := checkFeatures(ctx, conn, cfg)
	if err != nil {
		return err
	}
	quoted, err := quotedTables(ctx, conn, cfg)
	if err != nil {
		return err
	}
	if info.InRecovery {
		// The publication is the primary's; setupOnStandby names it.
		return standbyPublication(ctx, conn, cfg)
	}
	if err := publicationWritable(ctx, conn, cfg, quoted); err != nil {
		return err
	}
	if cfg.FailoverSlot {
		if err := checkFailoverSupport(ctx, conn); err != nil {
			return err
		}
	}
	st, err := slotStatus(ctx, conn, cfg.Slot)
	if err != nil || !st.Exists {
		return err
	}
	if err := checkSlotOwner(ctx, conn, cfg.Slot, st, "choose another slot name in the configuration"); err != nil {
		return err
	}
	if st.WALStatus == "lost" {
		return slotLostError(cfg.Slot)
	}
	return nil
}

// standbyPublication checks, on a standby, the publication that only the
// primary can create or extend.
func standbyPublication(ctx context.Context, conn *pgx.Conn, cfg Config) error {
	err := ensurePublication(ctx, conn, cfg, &SetupReport{}, false)
	var ae *ActionableError
	if errors.As(err, &ae) && (errors.Is(err, ErrPublicationMissing) || errors.Is(err, ErrPublicationMismatch)) {
		ae.Hint = "run `outbox-relay setup` against the primary once: a standby cannot create a publication, and the primary's replicates to it"
	}
	return err
}

// publicationWritable fails as ensurePublication would when it has to
// create the publication, or add a table to it, and this role may not:
// CREATE PUBLICATION needs CREATE on the database and the tables' owner,
// ALTER PUBLICATION … ADD TABLE the publication's and the table's owner
// (pg_has_role is true for a superuser).
func publicationWritable(ctx context.Context, conn *pgx.Conn, cfg Config, quoted []string) error {
	var ownsPub *bool
	err := conn.QueryRow(ctx, "SELECT pg_has_role(pubowner, 'USAGE') FROM pg_publication WHERE pubname = $1", cfg.Publication).Scan(&ownsPub)
	if err != nil && !errors.Is(err, pgx.ErrNoRows) {
		return fmt.Errorf("look up publication %q: %w", cfg.Publication, err)
	}
	name := pgx.Identifier{cfg.Publication}.Sanitize()
	if ownsPub == nil {
		var mayCreate bool
		if err := conn.QueryRow(ctx, "SELECT has_database_privilege(current_database(), 'CREATE')").Scan(&mayCreate); err != nil {
			return fmt.Errorf("read the role's privileges: %w", err)
		}
		why := "permission denied for database"
		for i := 0; mayCreate && i < len(quoted); i++ {
			if mayCreate, err = ownsTable(ctx, conn, quoted[i]); err != nil {
				return err
			}
			why = "must be owner of table " + cfg.Tables[i]
		}
		if !mayCreate {
			return createPublicationRefused(cfg, createPublicationSQL(name, quoted), why)
		}
		return nil
	}
	for i, t := range cfg.Tables {
		in, err := inPublication(ctx, conn, cfg.Publication, splitQualified(t), quoted[i])
		if err != nil || in {
			if err != nil {
				return err
			}
			continue
		}
		owns, err := ownsTable(ctx, conn, quoted[i])
		if err != nil {
			return err
		}
		switch {
		case !*ownsPub:
			return addTableRefused(cfg, t, addTableSQL(name, quoted[i]), "must be owner of publication "+cfg.Publication)
		case !owns:
			return addTableRefused(cfg, t, addTableSQL(name, quoted[i]), "must be owner of table "+t)
		}
	}
	return nil
}

func ownsTable(ctx context.Context, conn *pgx.Conn, quoted string) (bool, error) {
	var owns bool
	if err := conn.QueryRow(ctx, "SELECT pg_has_role(relowner, 'USAGE') FROM pg_class WHERE oid = to_regclass($1)", quoted).Scan(&owns); err != nil {
		return false, fmt.Errorf("look up the owner of %s: %w", quoted, err)
	}
	return owns, nil
}

// inPublication reports whether the table is a member of the publication.
// A partitioned table published by partition is listed by its partitions
// in pg_publication_tables, and is a member all the same.
func inPublication(ctx context.Context, conn *pgx.Conn, pub string, ident pgx.Identifier, quoted string) (bool, error) {
	var in bool
	if err := conn.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_publication_tables WHERE pubname = $1 AND schemaname = $2 AND tablename = $3)
	OR EXISTS (SELECT 1 FROM pg_publication_rel r JOIN pg_publication p ON p.oid = r.prpubid WHERE p.pubname = $1 AND r.prrelid = to_regclass($4))`,
		pub, ident[0], ident[1], quoted).Scan(&in); err != nil {
		return false, fmt.Errorf("look up publication tables: %w", err)
	}
	return in, nil
}

func tableMissingError(t string) error {
	return actionable(ErrTableMissing, "create it (see sql/outbox.sql) or fix the table name in the configuration", "table %s", t)
}

// createPublicationSQL creates the publication through the root: a
// partitioned outbox's rows keep its name.
func createPublicationSQL(name string, quoted []string) string {
	return fmt.Sprintf("CREATE PUBLICATION %s FOR TABLE %s WITH (publish = 'insert', publish_via_partition_root = true)", name, strings.Join(quoted, ", "))
}

func addTableSQL(name, quoted string) string {
	return fmt.Sprintf("ALTER PUBLICATION %s ADD TABLE %s", name, quoted)
}

func createPublicationRefused(cfg Config, sql, why string) error {
	return actionable(ErrPublicationMissing,
		fmt.Sprintf("creating it needs the tables' owner and CREATE on the database: as the owner run sql/publication.sql, or %s (docs/faults.md, \"Least privilege: PostgreSQL\", lists every statement the owner runs); then run setup again as this role", sql),
		"publication %q does not exist and %s", cfg.Publication, why)
}

func addTableRefused(cfg Config, table, alter, why string) error {
	return actionable(ErrPublicationMismatch,
		fmt.Sprintf("run as the owner of the publication and of the table: %s; and grant the relay's role SELECT on it; then run setup again", alter),
		"publication %q does not include table %s, and %s", cfg.Publication, table, why)
}

// connectServerChecked sets cfg's defaults, connects and checks wal_level
// and the role's REPLICATION attribute.
func connectServerChecked(ctx context.Context, cfg *Config) (*pgx.Conn, error) {
	if err := cfg.setDefaults(); err != nil {
		return nil, err
	}
	conn, err := connectSQL(ctx, cfg.URL)
	if err != nil {
		return nil, err
	}
	if err := checkServer(ctx, conn); err != nil {
		conn.Close(context.Background())
		return nil, err
	}
	return conn, nil
}

// quotedTables returns the configured tables' quoted names, failing with
// ErrTableMissing for one that does not exist.
func quotedTables(ctx context.Context, conn *pgx.Conn, cfg Config) ([]string, error) {
	var quoted []string
	for _, t := range cfg.Tables {
		ident := splitQualified(t)
		var ok bool
		if err := conn.QueryRow(ctx, "SELECT to_regclass($1) IS NOT NULL", ident.Sanitize()).Scan(&ok); err != nil {
			return nil, fmt.Errorf("look up table %s: %w", t, err)
		}
		if !ok {
			return nil, tableMissingError(t)
		}
		quoted = append(quoted, ident.Sanitize())
	}
	return quoted, nil
}
