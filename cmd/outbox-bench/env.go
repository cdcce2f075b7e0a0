package main

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/replication"
)

// benchEnv is the pair of servers every measurement runs against: the
// private PostgreSQL cluster and embedded JetStream server of the test
// harness, or external servers named by flags.
type benchEnv struct {
	pg       *testenv.Postgres // nil for an external server
	nats     *testenv.NATS     // nil for an external server
	adminURL string
	natsURL  string
	nc       *nats.Conn
	js       jetstream.JetStream
	repo     string // module root, for sql/outbox.sql
	pgBin    string // PostgreSQL client binaries, for pg_recvlogical

	PGVersion   string
	NATSVersion string
	PGSettings  map[string]string
}

// benchPGSettings are the PostgreSQL settings of a private cluster on top of
// the harness's: commits are synchronous (the walsender only decodes flushed
// WAL, so an asynchronous commit would wait for the WAL writer and measure
// wal_writer_delay, not the relay), while fsync stays off so that the shared
// machine's disk does not decide the figures.
var benchPGSettings = map[string]string{
	"synchronous_commit": "on",
	"max_wal_size":       "4GB",
	"checkpoint_timeout": "30min",
}

func startEnv(ctx context.Context, pgURL, natsURL string) (*benchEnv, error) {
	repo, err := repoRoot()
	if err != nil {
		return nil, err
	}
	e := &benchEnv{repo: repo, adminURL: pgURL, natsURL: natsURL, PGSettings: map[string]string{}}
	if pgURL == "" {
		opts := make([]testenv.PostgresOption, 0, len(benchPGSettings))
		for k, v := range benchPGSettings {
			opts = append(opts, testenv.WithSetting(k, v))
		}
		pg, err := testenv.StartPostgres(opts...)
		if err != nil {
			return nil, err
		}
		e.pg = pg
		e.adminURL = pg.AdminURL
	}
	if bin, err := testenv.FindPGBin(); err == nil {
		e.pgBin = bin
	}
	if natsURL == "" {
		n, err := testenv.StartNATS()
		if err != nil {
			e.close()
			return nil, err
		}
		e.nats = n
		e.natsURL = n.URL
	}
	e.nc, err = nats.Connect(e.natsURL, nats.Name("outbox-bench"))
	if err != nil {
		e.close()
		return nil, fmt.Errorf("connect to nats: %w", err)
	}
	e.NATSVersion = e.nc.ConnectedServerVersion()
	e.js, err = jetstream.New(e.nc)
	if err != nil {
		e.close()
		return nil, err
	}
	conn, err := pgx.Connect(ctx, e.adminURL)
	if err != nil {
		e.close()
		return nil, fmt.Errorf("connect to postgres: %w", err)
	}
	defer conn.Close(ctx)
	if err := conn.QueryRow(ctx, "SHOW server_version").Scan(&e.PGVersion); err != nil {
		e.close()
		return nil, err
	}
	for _, name := range []string{"synchronous_commit", "fsync", "wal_level", "shared_buffers", "logical_decoding_work_mem"} {
		var v string
		if err := conn.QueryRow(ctx, "SELECT current_setting($1)", name).Scan(&v); err == nil {
			e.PGSettings[name] = v
		}
	}
	return e, nil
}

func (e *benchEnv) close() {
	if e.nc != nil {
		e.nc.Close()
	}
	if e.nats != nil {
		e.nats.Close()
	}
	if e.pg != nil {
		e.pg.Close()
	}
}

func repoRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("go.mod not found above the working directory: run outbox-bench from the repository")
		}
		dir = parent
	}
}

// benchDB is one scenario's database: the outbox table, the publication and
// one slot per reader, all created before any row is written so that every
// slot holds the same backlog.
type benchDB struct {
	env         *benchEnv
	name        string
	url         string
	pool        *pgxpool.Pool
	publication string
}

// loadProcedure writes outbox rows in transactions of perTx rows with
// COMMIT inside the procedure: no client round trip per transaction, so a
// 200,000-transaction backlog loads in seconds. Row g goes to aggregate
// g % aggs with version g / aggs + 1, so ranges of g never collide. With
// traced, each transaction's rows carry one sampled W3C traceparent, as
// rows written by outbox.Writer in a traced request (tracing.go).
const loadProcedure = `
CREATE PROCEDURE bench_load(first bigint, last bigint, per_tx int, aggs int, pad int, traced boolean DEFAULT false)
LANGUAGE plpgsql AS $$
DECLARE
  i bigint := first;
BEGIN
  WHILE i < last LOOP
    INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_version, event_type, payload, traceparent)
    SELECT gen_random_uuid(), 'order', 'agg-' || (g % aggs), g / aggs + 1, 'OrderPlaced',
           jsonb_build_object('seq', g, 'note', repeat('x', pad), 'customer', 'customer-' || (g % aggs), 'amount_cents', (g * 7919) % 100000),
           -- traced: one sampled writer span per transaction
           CASE WHEN traced THEN '00-' || md5('t' || i) || '-' || left(md5('s' || i), 16) || '-01' END
    FROM generate_series(i, least(i + per_tx, last) - 1) AS g;
    COMMIT;
    i := i + per_tx;
  END LOOP;
END $$;
`

func (e *benchEnv) newDB(ctx context.Context, slots ...string) (*benchDB, error) {
	name := testenv.UniqueName("bench")
	admin, err := pgx.Connect(ctx, e.adminURL)
	if err != nil {
		return nil, err
	}
	_, err = admin.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize())
	admin.Close(ctx)
	if err != nil {
		return nil, fmt.Errorf("create database: %w", err)
	}
	u, err := url.Parse(e.adminURL)
	if err != nil {
		return nil, fmt.Errorf("--postgres-url must be a postgres:// URL: %w", err)
	}
	u.Path = "/" + name
	db := &benchDB{env: e, name: name, url: u.String(), publication: "bench_pub"}
	cfg, err := pgxpool.ParseConfig(db.url)
	if err != nil {
		return nil, err
	}
	cfg.MaxConns = 16
	db.pool, err = pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, err
	}
	schema, err := os.ReadFile(filepath.Join(e.repo, "sql", "outbox.sql"))
	if err != nil {
		db.drop()
		return nil, err
	}
	for _, stmt := range []string{string(schema), loadProcedure} {
		if _, err := db.pool.Exec(ctx, stmt); err != nil {
			db.drop()
			return nil, fmt.Errorf("schema: %w", err)
		}
	}
	for i, slot := range slots {
		if i == 0 {
			// The relay's slot and the publication, created the way
			// `outbox-relay setup` creates them.
			_, err = replication.Setup(ctx, replication.Config{URL: db.url, Slot: slot, Publication: db.publication, Tables: []string{"public.outbox"}})
		} else {
			_, err = db.pool.Exec(ctx, "SELECT pg_create_logical_replication_slot($1, 'pgoutput')", slot)
		}
		if err != nil {
			db.drop()
			return nil, fmt.Errorf("slot %s: %w", slot, err)
		}
	}
	return db, nil
}

// load writes events rows in transactions of perTx rows from workers
// concurrent connections, starting at row number first.
func (db *benchDB) load(ctx context.Context, first, events int64, perTx, workers, aggs, pad int) (time.Duration, error) {
	start := time.Now()
	errs := make(chan error, workers)
	per := (events + int64(workers) - 1) / int64(workers)
	// Keep each worker's range a multiple of perTx so that every
	// transaction has exactly perTx rows.
	per = (per + int64(perTx) - 1) / int64(perTx) * int64(perTx)
	n := 0
	for lo := first; lo < first+events; lo += per {
		hi := min(lo+per, first+events)
		n++
		go func() {
			_, err := db.pool.Exec(ctx, "CALL bench_load($1, $2, $3, $4, $5)", lo, hi, perTx, aggs, pad)
			errs <- err
		}()
	}
	var err error
	for range n {
		err = errors.Join(err, <-errs)
	}
	return time.Since(start), err
}

// avgPayload returns the average payload text length of the loaded rows.
func (db *benchDB) avgPayload(ctx context.Context) (float64, error) {
	var avg float64
	err := db.pool.QueryRow(ctx, "SELECT coalesce(avg(octet_length(payload::text)), 0) FROM (SELECT payload FROM outbox LIMIT 10000) s").Scan(&avg)
	return avg, err
}

// postmasterPID returns the pid of the server's postmaster (the parent of
// every backend), or 0 when the server is not on this machine.
func (db *benchDB) postmasterPID(ctx context.Context) int {
	var pid int32
	if err := db.pool.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid); err != nil {
		return 0
	}
	ppid, err := procPPID(int(pid))
	if err != nil {
		return 0
	}
	return ppid
}

// walsenderPID returns the pid of the walsender streaming from slot, or 0.
func (db *benchDB) walsenderPID(ctx context.Context, slot string) int {
	var pid *int32
	if err := db.pool.QueryRow(ctx, "SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1", slot).Scan(&pid); err != nil || pid == nil {
		return 0
	}
	return int(*pid)
}

func (db *benchDB) drop() {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if db.pool != nil {
		db.pool.Close()
	}
	admin, err := pgx.Connect(ctx, db.env.adminURL)
	if err != nil {
		return
	}
	defer admin.Close(ctx)
	_, _ = admin.Exec(ctx, `SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE database = $1 AND active_pid IS NOT NULL`, db.name)
	// A terminated walsender releases its slot asynchronously.
	testenv.WaitFor(5*time.Second, func() bool {
		var n int
		_ = admin.QueryRow(ctx, "SELECT count(*) FROM pg_replication_slots WHERE database = $1 AND active", db.name).Scan(&n)
		return n == 0
	})
	_, _ = admin.Exec(ctx, `SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE database = $1 AND NOT active`, db.name)
	_, _ = admin.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{db.name}.Sanitize()+" WITH (FORCE)")
}

// streamName turns a scenario name into a JetStream stream name and a
// subject prefix.
func streamNames(scenario string) (stream, subject string) {
	s := testenv.UniqueName(strings.ReplaceAll(scenario, "-", "_"))
	return strings.ToUpper(s), strings.ToLower(s)
}
