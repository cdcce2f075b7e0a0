package consumer

import (
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// Acceptance 4: PostgreSQL stopped for 10 s → the message is retried as
// transient, then applied once when the database is back.
func TestDatabaseOutageIsRetriedThenAppliedOnce(t *testing.T) {
	if testing.Short() {
		t.Skip("fault test")
	}
	t.Parallel()
	f, pg := privateFixture(t)
	r := newRecorder("outage")
	cfg := f.baseConfig("outage")
	cfg.RetryMax = time.Second
	cfg.HandlerTimeout = 2 * time.Second
	f.start(cfg, r)

	f.publish(event{ID: uuidN(1), AggID: "before", Version: 1})
	f.waitSettled("outage", 15*time.Second)

	testenv.Must(t, pg.Stop("fast"), "stop postgres")
	stopped := time.Now()
	f.publish(event{ID: uuidN(2), AggID: "during", Version: 1})
	vec := mustVec(t, f)
	f.waitFor("transient retries", 10*time.Second, func() bool {
		return metricValue(t, vec.retries.WithLabelValues("outage", "transient")) >= 2
	})
	// The outage itself is the scenario: keep the server down for 10 s.
	time.Sleep(10*time.Second - time.Since(stopped))
	testenv.Must(t, pg.Start(), "start postgres")

	f.waitFor("event applied after the outage", 20*time.Second, func() bool {
		return queryIntOK(f, `SELECT count(*) FROM applied WHERE event_id = $1`, uuidN(2)) == 1
	})
	f.waitSettled("outage", 15*time.Second)
	if n := queryInt(t, f.pool, `SELECT count(*) FROM applied WHERE event_id = $1`, uuidN(2)); n != 1 {
		t.Fatalf("applied %d times, want 1", n)
	}
	if n := queryInt(t, f.pool, `SELECT count(*) FROM consumer_dead_letter`); n != 0 {
		t.Fatalf("%d dead letters: a database outage must not dead-letter", n)
	}
	if n := r.callCount(uuidN(2)); n != 1 {
		t.Fatalf("handler called %d times, want 1 (the database was down before it)", n)
	}
	t.Logf("transient retries during the outage: %v", metricValue(t, vec.retries.WithLabelValues("outage", "transient")))
}

// queryIntOK is queryInt for a database that may be unavailable: -1 on error.
func queryIntOK(f *fixture, sql string, args ...any) int64 {
	var n int64
	if err := f.pool.QueryRow(f.t.Context(), sql, args...).Scan(&n); err != nil {
		return -1
	}
	return n
}

// privateFixture is a fixture on a database of a PostgreSQL server of the
// test's own, which it may stop and start.
func privateFixture(t *testing.T) (*fixture, *testenv.Postgres) {
	t.Helper()
	pg, err := testenv.StartPostgres()
	testenv.Must(t, err, "start private postgres")
	t.Cleanup(pg.Close) // runs after the database's own cleanup drops it
	db := testenv.NewDatabaseOn(t, pg)
	return newFixtureOn(t, db, testenv.Get(t).NATS.URL), pg
}
