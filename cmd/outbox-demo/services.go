package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// startServices starts the private PostgreSQL cluster and the embedded NATS
// server. Each is registered for cleanup as soon as it exists, so an
// interrupt in the middle still stops what was started.
func (d *demo) startServices(ctx context.Context) error {
	d.out.step("starting a private PostgreSQL cluster (initdb into a temporary directory)")
	pg, err := testenv.StartPostgres()
	if err != nil {
		return fmt.Errorf("start postgres: %w", err)
	}
	d.onCleanup(func() {
		pg.Close()
		d.out.detail("PostgreSQL stopped, data directory removed")
	})
	d.pg = pg
	if err := ctx.Err(); err != nil {
		return err
	}
	var version string
	if err := queryOnce(ctx, pg.AdminURL, "SHOW server_version", &version); err != nil {
		return err
	}
	d.out.detail("PostgreSQL %s on 127.0.0.1:%d, wal_level=logical", version, pg.Port())

	d.out.step("starting an embedded NATS server with JetStream")
	ns, err := testenv.StartNATS()
	if err != nil {
		return fmt.Errorf("start nats: %w", err)
	}
	d.onCleanup(func() {
		ns.Close()
		d.out.detail("NATS stopped, JetStream store removed")
	})
	d.nats = ns
	d.out.detail("NATS %s", ns.URL)
	return ctx.Err()
}

// createDatabase creates a database on the private cluster, connects to it
// and applies the given SQL files in order.
func (d *demo) createDatabase(ctx context.Context, name string, files ...string) (url string, pool *pgxpool.Pool, err error) {
	if err := d.pg.CreateDatabase(ctx, name); err != nil {
		return "", nil, fmt.Errorf("create database %s: %w", name, err)
	}
	url = d.pg.URL(name)
	pool, err = pgxpool.New(ctx, url)
	if err != nil {
		return "", nil, fmt.Errorf("connect to database %s: %w", name, err)
	}
	d.onCleanup(pool.Close)
	for _, f := range files {
		if err := execFile(ctx, pool, filepath.Join(d.sqlDir, f)); err != nil {
			return "", nil, err
		}
	}
	d.out.detail("database %s: applied %s", name, strings.Join(prefixAll("sql/", files), ", "))
	return url, pool, nil
}

func prefixAll(prefix string, s []string) []string {
	out := make([]string, len(s))
	for i, v := range s {
		out[i] = prefix + v
	}
	return out
}

// execFile runs a multi-statement SQL file. The simple protocol runs it in
// one round trip, as psql -f would (without psql's meta-commands).
func execFile(ctx context.Context, pool *pgxpool.Pool, path string) error {
	b, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return err
	}
	defer conn.Release()
	if _, err := conn.Conn().PgConn().Exec(ctx, string(b)).ReadAll(); err != nil {
		return fmt.Errorf("apply %s: %w", path, err)
	}
	return nil
}

func queryOnce(ctx context.Context, url, sql string, dst any) error {
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := pool.QueryRow(ctx, sql).Scan(dst); err != nil {
		return fmt.Errorf("%s: %w", sql, err)
	}
	return nil
}

// findSQLDir returns the sql/ directory of the module that contains the
// working directory: `go run ./cmd/outbox-demo` and `make demo` run from the
// module root, but a run from a subdirectory should work too.
func findSQLDir() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			sqlDir := filepath.Join(dir, "sql")
			if _, err := os.Stat(filepath.Join(sqlDir, "outbox.sql")); err != nil {
				return "", fmt.Errorf("%s has no sql/outbox.sql: run the demo from the outbox-relay checkout or pass -sql DIR", dir)
			}
			return sqlDir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("no go.mod above the working directory: run the demo from the outbox-relay checkout or pass -sql DIR")
		}
		dir = parent
	}
}
