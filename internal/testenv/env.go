package testenv

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// Env is the pair of servers shared by the tests of one package.
type Env struct {
	PG   *Postgres
	NATS *NATS
}

var (
	shared     *Env
	sharedErr  error
	sharedOnce sync.Once
	binDir     string
	binMu      sync.Mutex
	builtBins  = map[string]string{}
)

// Main runs the package's tests and then stops the shared servers, if any
// test started them. Use it from TestMain:
//
//	func TestMain(m *testing.M) { os.Exit(testenv.Main(m)) }
func Main(m *testing.M) int {
	code := m.Run()
	// Cleanup runs before os.Exit, which would skip deferred calls.
	if shared != nil {
		shared.PG.Close()
		shared.NATS.Close()
	}
	if binDir != "" {
		_ = os.RemoveAll(binDir)
	}
	return code
}

// Get returns the package's shared servers, starting them on first use. It
// skips the test under -short.
func Get(t testing.TB) *Env {
	t.Helper()
	if testing.Short() {
		t.Skip("integration test: needs PostgreSQL and NATS (skipped with -short)")
	}
	sharedOnce.Do(func() {
		var pg *Postgres
		if u := os.Getenv("OUTBOX_TEST_POSTGRES_URL"); u != "" {
			pg = externalPostgres(u)
		} else {
			pg, sharedErr = StartPostgres()
			if sharedErr != nil {
				return
			}
		}
		var nc *NATS
		if u := os.Getenv("OUTBOX_TEST_NATS_URL"); u != "" {
			nc = externalNATS(u)
		} else {
			nc, sharedErr = StartNATS()
			if sharedErr != nil {
				pg.Close()
				return
			}
		}
		shared = &Env{PG: pg, NATS: nc}
		// go test shows this line with -v and for failing packages: say
		// which server the results are about.
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		fmt.Fprintf(os.Stderr, "testenv: %s\n", pg.describeServer(ctx))
	})
	if sharedErr != nil {
		t.Fatalf("start test services: %v", sharedErr)
	}
	return shared
}

// UniqueName returns prefix followed by random hex, a valid lower-case SQL
// identifier and JetStream stream name that no other test uses.
func UniqueName(prefix string) string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return prefix + "_" + hex.EncodeToString(b[:])
}

// Database is a database created for one test.
type Database struct {
	Name string
	URL  string
	Pool *pgxpool.Pool
}

// NewDatabase creates a fresh database for the test and drops it, with its
// replication slots, when the test ends.
func (e *Env) NewDatabase(t testing.TB) *Database {
	t.Helper()
	return NewDatabaseOn(t, e.PG)
}

// NewDatabaseOn creates a fresh database on pg for the test and drops it when
// the test ends.
func NewDatabaseOn(t testing.TB, pg *Postgres) *Database {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	name := UniqueName("t")
	if err := pg.CreateDatabase(ctx, name); err != nil {
		t.Fatalf("create database: %v", err)
	}
	url := pg.URL(name)
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		t.Fatalf("connect to test database: %v", err)
	}
	t.Cleanup(func() {
		pool.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := pg.DropDatabase(ctx, name); err != nil {
			t.Logf("drop database %s: %v", name, err)
		}
	})
	return &Database{Name: name, URL: url, Pool: pool}
}

// ExecFile runs the SQL statements of a file (for example sql/outbox.sql)
// in the database.
func (d *Database) ExecFile(t testing.TB, path string) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("read %s: %v", path, err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := d.Pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	// The simple protocol runs a multi-statement file in one round trip.
	if _, err := conn.Conn().PgConn().Exec(ctx, string(b)).ReadAll(); err != nil {
		t.Fatalf("exec %s: %v", path, err)
	}
}

// RepoRoot returns the relay module's root directory (the one holding its
// go.mod), also from a nested module's test.
func RepoRoot(t testing.TB) string {
	t.Helper()
	dir, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	for {
		// The relay's module, not a nested one (deploy/otlptest) above
		// the test's directory.
		if b, err := os.ReadFile(filepath.Join(dir, "go.mod")); err == nil && bytes.HasPrefix(b, []byte("module github.com/outbox-relay/outbox-relay\n")) {
			return dir
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			t.Fatal("go.mod not found above the test's directory")
		}
		dir = parent
	}
}

// BuildBinary builds the main package pkg (for example
// "./cmd/outbox-relay") once per test binary and returns the executable's path.
// Fault tests run it as a separate process so they can kill it with SIGKILL.
func BuildBinary(t testing.TB, pkg string) string {
	t.Helper()
	binMu.Lock()
	defer binMu.Unlock()
	if p, ok := builtBins[pkg]; ok {
		return p
	}
	if binDir == "" {
		d, err := os.MkdirTemp("", "outbox-relay-bin-")
		if err != nil {
			t.Fatal(err)
		}
		binDir = d
	}
	out := filepath.Join(binDir, strings.NewReplacer("/", "_", ".", "_").Replace(pkg))
	cmd := exec.Command("go", "build", "-o", out, pkg)
	cmd.Dir = RepoRoot(t)
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build %s: %v\n%s", pkg, err, b)
	}
	builtBins[pkg] = out
	return out
}

// Must fails the test when err is not nil.
func Must(t testing.TB, err error, what string, args ...any) {
	t.Helper()
	if err != nil {
		t.Fatalf("%s: %v", fmt.Sprintf(what, args...), err)
	}
}

// Background runs fn on a goroutine until the test ends or the returned stop
// is called; stop cancels fn's context, waits for fn and returns its error
// (the same error on every call).
func Background(ctx context.Context, t testing.TB, fn func(context.Context) error) (stop func() error) {
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- fn(ctx) }()
	var once sync.Once
	var result error
	stop = func() error {
		once.Do(func() {
			cancel()
			result = <-done
		})
		return result
	}
	t.Cleanup(func() { _ = stop() })
	return stop
}
