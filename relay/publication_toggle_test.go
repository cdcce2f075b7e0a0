package relay_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/relaytest"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// Adversarial review of issue 25: the publication broken and fixed again
// within one check interval, so that only the Relation hook can notice,
// in each of the ways a DBA may do it.
func TestRelayPublicationQuickToggle(t *testing.T) {
	t.Parallel()
	for name, sqls := range map[string][2]string{
		"publish":   {`ALTER PUBLICATION %s SET (publish = 'update')`, `ALTER PUBLICATION %s SET (publish = 'insert')`},
		"set-table": {`ALTER PUBLICATION %s SET TABLE quick_other`, `ALTER PUBLICATION %s SET TABLE outbox`},
		"recreate":  {`DROP PUBLICATION %s`, `CREATE PUBLICATION %s FOR TABLE outbox WITH (publish = 'insert')`},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			f := newFixture(t, "")
			f.Cfg.PublicationCheck = time.Hour
			f.Cfg.Replication.StatusInterval = time.Second
			f.Cfg.Replication.ReceiveTimeout = 3 * time.Second
			f.Setup(ctx)
			if _, err := f.DB.Pool.Exec(ctx, "CREATE TABLE quick_other (id int)"); err != nil {
				t.Fatal(err)
			}
			f.Start(ctx)
			pub := `"` + f.Cfg.Replication.Publication + `"`
			exec := func(sql string) {
				t.Helper()
				if _, err := f.DB.Pool.Exec(ctx, strings.ReplaceAll(sql, "%s", pub)); err != nil {
					t.Fatalf("%s: %v", sql, err)
				}
			}
			w := f.NewWriter(5)
			all := w.Write(ctx, 50, 5)
			f.WaitCount(ctx, f.Stream, 50, 30*time.Second)
			exec(sqls[0])
			all = append(all, w.Write(ctx, 50, 5)...)
			exec(sqls[1])
			all = append(all, w.Write(ctx, 50, 5)...)
			testenv.WaitFor(30*time.Second, func() bool { return relaytest.StreamCount(ctx, f.JS, f.Stream) >= uint64(len(all)) })
			if rep := relaytest.Check(all, f.Read(ctx, f.Stream)); !rep.OK() {
				t.Fatalf("stream check: %s", rep)
			}
		})
	}
}
