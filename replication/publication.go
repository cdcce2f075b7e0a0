package replication

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/jackc/pgx/v5"
)

// PublicationProblem is one way the publication fails the relay, with the
// statement that fixes it.
type PublicationProblem struct {
	Table string // "" for the publication as a whole
	What  string
	Fix   string
}

// CheckPublication verifies that the publication carries what the relay
// needs, whatever created it: every configured table (a table missing from
// it is relayed as nothing, and the slot confirms past its inserts), only
// inserts (publishing updates or deletes makes PostgreSQL refuse every
// UPDATE and DELETE of a table without a replica identity, which breaks
// the application, cleanup and a cut-over), partitioned tables through
// their root (publish_via_partition_root: otherwise rows come under the
// partitions' names), and no row filter (rows it filters out are never
// relayed). It fails with ErrPublicationMissing, ErrTableMissing or
// ErrPublicationMismatch; the last lists every problem with the exact
// statement to run.
func CheckPublication(ctx context.Context, cfg Config) error {
	conn, err := connectChecked(ctx, &cfg)
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	return checkPublication(ctx, conn, cfg)
}

func checkPublication(ctx context.Context, conn *pgx.Conn, cfg Config) error {
	probs, err := publicationProblems(ctx, conn, cfg)
	if err != nil || len(probs) == 0 {
		return err
	}
	var what, fix []string
	for _, p := range probs {
		if p.Table != "" {
			what = append(what, p.Table+": "+p.What)
		} else {
			what = append(what, p.What)
		}
		if !slices.Contains(fix, p.Fix) {
			fix = append(fix, p.Fix)
		}
	}
	return actionable(ErrPublicationMismatch, "run as the publication's owner: "+strings.Join(fix, "; "),
		"publication %q: %s", cfg.Publication, strings.Join(what, "; "))
}

func publicationProblems(ctx context.Context, conn *pgx.Conn, cfg Config) ([]PublicationProblem, error) {
	var ins, upd, del, viaRoot bool
	err := conn.QueryRow(ctx, "SELECT pubinsert, pubupdate, pubdelete, pubviaroot FROM pg_publication WHERE pubname = $1", cfg.Publication).
		Scan(&ins, &upd, &del, &viaRoot)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, actionable(ErrPublicationMissing, "run `outbox-relay setup`", "publication %q", cfg.Publication)
	}
	if err != nil {
		return nil, fmt.Errorf("look up publication %q: %w", cfg.Publication, err)
	}
	var version int
	if err := conn.QueryRow(ctx, "SELECT current_setting('server_version_num')::int").Scan(&version); err != nil {
		return nil, fmt.Errorf("read server version: %w", err)
	}
	name := pgx.Identifier{cfg.Publication}.Sanitize()
	var probs []PublicationProblem
	if !ins || upd || del {
		var ops []string
		for _, o := range []struct {
			on   bool
			name string
		}{{ins, "insert"}, {upd, "update"}, {del, "delete"}} {
			if o.on {
				ops = append(ops, o.name)
			}
		}
		probs = append(probs, PublicationProblem{
			What: fmt.Sprintf("publishes %s; the relay needs inserts only (updates and deletes make PostgreSQL refuse UPDATE and DELETE on an outbox table without a replica identity)", orNone(ops)),
			Fix:  fmt.Sprintf("ALTER PUBLICATION %s SET (publish = 'insert')", name),
		})
	}
	for _, t := range cfg.Tables {
		ident := splitQualified(t)
		var kind *string
		if err := conn.QueryRow(ctx, "SELECT relkind::text FROM pg_class WHERE oid = to_regclass($1)", ident.Sanitize()).Scan(&kind); err != nil {
			return nil, fmt.Errorf("look up table %s: %w", t, err)
		}
		if kind == nil {
			return nil, actionable(ErrTableMissing, "create it (see sql/outbox.sql) or fix the table name in the configuration", "table %s", t)
		}
		partitioned := *kind == "p"
		if partitioned && !viaRoot {
			probs = append(probs, PublicationProblem{Table: t,
				What: "is partitioned and the publication sends its rows under the partitions' names",
				Fix:  fmt.Sprintf("ALTER PUBLICATION %s SET (publish_via_partition_root = true)", name)})
			continue // its membership shows only once rows come through the root
		}
		filter := "NULL::text"
		if version >= 150000 {
			filter = "rowfilter"
		}
		var in bool
		var rowFilter *string
		err := conn.QueryRow(ctx, "SELECT true, "+filter+" FROM pg_publication_tables WHERE pubname = $1 AND schemaname = $2 AND tablename = $3",
			cfg.Publication, ident[0], ident[1]).Scan(&in, &rowFilter)
		if err != nil && !errors.Is(err, pgx.ErrNoRows) {
			return nil, fmt.Errorf("look up publication tables: %w", err)
		}
		switch {
		case !in:
			probs = append(probs, PublicationProblem{Table: t,
				What: "is not in the publication: its inserts would never be relayed",
				Fix:  fmt.Sprintf("ALTER PUBLICATION %s ADD TABLE %s", name, ident.Sanitize())})
		case rowFilter != nil:
			probs = append(probs, PublicationProblem{Table: t,
				What: fmt.Sprintf("has the row filter WHERE %s: rows it leaves out would never be relayed", *rowFilter),
				Fix:  fmt.Sprintf("ALTER PUBLICATION %s DROP TABLE %s; ALTER PUBLICATION %s ADD TABLE %s", name, ident.Sanitize(), name, ident.Sanitize())})
		}
	}
	return probs, nil
}

func orNone(s []string) string {
	if len(s) == 0 {
		return "nothing"
	}
	return strings.Join(s, ", ")
}
