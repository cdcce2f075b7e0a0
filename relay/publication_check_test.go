package relay_test

import (
	"context"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/relay"
)

// A publication check that cannot run (its connection reaches no server)
// stops confirming, and says so: not ready with the cause, until a check
// runs again. Before, only the confirming stopped: the relay stayed ready.
func TestRelayPublicationCheckCannotRun(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newFixture(t, "")
	f.Cfg.PublicationCheck = 200 * time.Millisecond
	f.Setup(ctx)
	u, err := url.Parse(f.Cfg.Replication.URL)
	if err != nil {
		t.Fatal(err)
	}
	p, err := testenv.StartProxy(u.Host)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	u.Host = p.Addr
	f.Cfg.Replication.URL = u.String()
	var ready atomic.Bool
	rl, _ := f.Start(ctx, relay.WithReadiness(ready.Store))
	f.NewWriter(5).Write(ctx, 10, 5)
	f.WaitCount(ctx, f.Stream, 10, 30*time.Second)
	if !testenv.WaitFor(10*time.Second, ready.Load) {
		t.Fatal("the relay did not turn ready")
	}
	// New connections reach nothing; the check's own is ended, so the
	// next check must connect again. The replication session lives on.
	// The check's connection is known by its last query, which is another
	// one while a check runs: ended again until the relay turns not ready.
	p.BlackholeNew(true)
	if !testenv.WaitFor(30*time.Second, func() bool {
		if _, err := f.DB.Pool.Exec(ctx, `SELECT pg_terminate_backend(pid) FROM pg_stat_activity
WHERE datname = current_database() AND backend_type = 'client backend' AND pid <> pg_backend_pid() AND query LIKE '%pg_publication_rel%'`); err != nil {
			t.Fatal(err)
		}
		return !ready.Load()
	}) {
		t.Fatal("the relay stayed ready while no publication check could run")
	}
	// On a loaded machine the replication session may time out too (its
	// reconnect is blackholed as well): the check's failure then shows
	// once the next check has timed out.
	if !testenv.WaitFor(30*time.Second, func() bool {
		return strings.Contains(rl.NotReadyReason(), "cannot be checked") && rl.PublicationCheckFailure() != nil && !ready.Load()
	}) {
		t.Fatalf("not ready for another reason: %q", rl.NotReadyReason())
	}
	p.BlackholeNew(false)
	if !testenv.WaitFor(30*time.Second, ready.Load) {
		t.Fatalf("not ready again after the checks could run: %q", rl.NotReadyReason())
	}
	if err := rl.PublicationCheckFailure(); err != nil {
		t.Fatalf("check failure still reported: %v", err)
	}
}
