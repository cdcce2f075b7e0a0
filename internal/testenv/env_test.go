package testenv

import (
	"context"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

func TestMain(m *testing.M) { os.Exit(Main(m)) }

func TestServersStart(t *testing.T) {
	env := Get(t)
	db := env.NewDatabase(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var level string
	if err := db.Pool.QueryRow(ctx, "SHOW wal_level").Scan(&level); err != nil {
		t.Fatal(err)
	}
	if level != "logical" && os.Getenv("OUTBOX_TEST_POSTGRES_URL") == "" {
		t.Fatalf("wal_level = %q, want logical", level)
	}
	nc, err := nats.Connect(env.NATS.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := js.AccountInfo(ctx); err != nil {
		t.Fatalf("jetstream not enabled: %v", err)
	}
}

// TestServerVersion checks that the server in use is the one
// OUTBOX_TEST_PG_VERSION asks for, so a lane never reports results for
// another version than it names.
func TestServerVersion(t *testing.T) {
	env := Get(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	num, err := env.PG.ServerVersionNum(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%s", env.PG.describeServer(ctx))
	want := os.Getenv(EnvPGVersion)
	if want == "" || os.Getenv("OUTBOX_TEST_POSTGRES_URL") != "" {
		return
	}
	if got := strconv.Itoa(num / 10000); got != want {
		t.Fatalf("server_version_num %d is PostgreSQL %s, but %s=%s", num, got, EnvPGVersion, want)
	}
	if env.PG.Major() != num/10000 {
		t.Fatalf("Major() = %d, server_version_num %d", env.PG.Major(), num)
	}
}

func TestURL(t *testing.T) {
	p := &Postgres{AdminURL: "postgres://u:pw@127.0.0.1:5432/postgres?sslmode=disable"}
	if got, want := p.URL("x"), "postgres://u:pw@127.0.0.1:5432/x?sslmode=disable"; got != want {
		t.Fatalf("URL = %q, want %q", got, want)
	}
	p = &Postgres{AdminURL: "postgres://u@h:1"}
	if got, want := p.URL("x"), "postgres://u@h:1/x"; got != want {
		t.Fatalf("URL = %q, want %q", got, want)
	}
}
