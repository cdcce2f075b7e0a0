package replication_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/replication"
)

// Regression (issue 16, case 6): a publication without the outbox table was
// relayed as nothing (the slot confirming past its inserts), and one
// publishing updates and deletes was accepted (every UPDATE of the outbox
// then failed). Each wrong publication is refused with the statement that
// fixes it, and the fix makes it right.
func TestCheckPublication(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, base := outboxDB(t, testenv.Get(t).PG)
	if _, err := db.Pool.Exec(ctx, `CREATE TABLE other (id int);
CREATE TABLE part_outbox (LIKE outbox) PARTITION BY HASH (aggregate_id);
CREATE TABLE part_outbox_0 PARTITION OF part_outbox FOR VALUES WITH (MODULUS 2, REMAINDER 0);
CREATE TABLE part_outbox_1 PARTITION OF part_outbox FOR VALUES WITH (MODULUS 2, REMAINDER 1)`); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name   string
		tables []string
		create string // %s: the publication
		want   error  // nil: right
		fix    string
	}{
		{"right", nil, "CREATE PUBLICATION %s FOR TABLE outbox WITH (publish = 'insert')", nil, ""},
		{"table missing", nil, "CREATE PUBLICATION %s FOR TABLE other WITH (publish = 'insert')", replication.ErrPublicationMismatch,
			`ALTER PUBLICATION %s ADD TABLE "public"."outbox"`},
		{"updates and deletes", nil, "CREATE PUBLICATION %s FOR TABLE outbox", replication.ErrPublicationMismatch,
			"ALTER PUBLICATION %s SET (publish = 'insert')"},
		{"no inserts", nil, "CREATE PUBLICATION %s FOR TABLE outbox WITH (publish = 'truncate')", replication.ErrPublicationMismatch,
			"ALTER PUBLICATION %s SET (publish = 'insert')"},
		{"row filter", nil, "CREATE PUBLICATION %s FOR TABLE outbox WHERE (aggregate_id <> 'x') WITH (publish = 'insert')", replication.ErrPublicationMismatch,
			`ALTER PUBLICATION %s DROP TABLE "public"."outbox"; ALTER PUBLICATION %s ADD TABLE "public"."outbox"`},
		{"all tables", nil, "CREATE PUBLICATION %s FOR ALL TABLES WITH (publish = 'insert')", nil, ""},
		{"partitioned, through its root", []string{"public.part_outbox"}, "CREATE PUBLICATION %s FOR TABLE part_outbox WITH (publish = 'insert', publish_via_partition_root = true)", nil, ""},
		{"partitioned, by partition", []string{"public.part_outbox"}, "CREATE PUBLICATION %s FOR TABLE part_outbox WITH (publish = 'insert')", replication.ErrPublicationMismatch,
			"ALTER PUBLICATION %s SET (publish_via_partition_root = true)"},
		{"missing", nil, "", replication.ErrPublicationMissing, "outbox-relay setup"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := base
			cfg.Publication = testenv.UniqueName("p")
			if tt.tables != nil {
				cfg.Tables = tt.tables
			}
			if tt.create != "" {
				if _, err := db.Pool.Exec(ctx, strings.ReplaceAll(tt.create, "%s", `"`+cfg.Publication+`"`)); err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { _, _ = db.Pool.Exec(context.Background(), `DROP PUBLICATION "`+cfg.Publication+`"`) })
			}
			err := replication.CheckPublication(ctx, cfg)
			if tt.want == nil {
				if err != nil {
					t.Fatalf("CheckPublication: %v", err)
				}
				return
			}
			fix := strings.ReplaceAll(tt.fix, "%s", `"`+cfg.Publication+`"`)
			if !errors.Is(err, tt.want) || !replication.IsPermanent(err) || !strings.Contains(err.Error(), fix) {
				t.Fatalf("CheckPublication: %v\nwant %v naming %s", err, tt.want, fix)
			}
			if tt.create == "" {
				return
			}
			// Setup refuses it too (it adds a missing table itself), and
			// the statement fixes it.
			_, err = replication.Setup(ctx, cfg)
			if tt.name == "table missing" {
				if err != nil {
					t.Fatalf("Setup: %v", err)
				}
				fix = ""
			} else if !errors.Is(err, tt.want) {
				t.Fatalf("Setup: %v, want %v", err, tt.want)
			}
			for _, stmt := range strings.Split(fix, "; ") {
				if stmt == "" {
					continue
				}
				if _, err := db.Pool.Exec(ctx, stmt); err != nil {
					t.Fatalf("%s: %v", stmt, err)
				}
			}
			if err := replication.CheckPublication(ctx, cfg); err != nil {
				t.Fatalf("after %s: %v", fix, err)
			}
		})
	}
}
