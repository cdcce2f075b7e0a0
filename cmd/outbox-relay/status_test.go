package main

import (
	"bytes"
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// passwordHBA trusts the harness's superuser and asks every other role for
// a password, without TLS: pgconn then reports its refused TLS attempt
// before the real cause.
const passwordHBA = `local all all trust
host all postgres 127.0.0.1/32 trust
host all all 127.0.0.1/32 scram-sha-256
`

// With a wrong password and NATS down, `status` says it could not tell,
// and why, instead of "exists false", "active false" and "messages 0 (last
// seq 0, , R0)"; the password refusal leads the message.
func TestStatusSaysWhatItCannotTell(t *testing.T) {
	t.Parallel()
	pg := passwordPostgres(t)
	ctx := context.Background()
	port, err := testenv.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	f := newOpsFixture(t)
	cfg := f.cfg
	// sslmode=prefer, the default: pgconn tries TLS first.
	cfg.Postgres.URL = strings.NewReplacer("postgres@", "status_user:wrong-password@", "sslmode=disable", "sslmode=prefer").Replace(pg.URL("postgres"))
	cfg.NATS.URL = fmt.Sprintf("nats://127.0.0.1:%d", port)
	cfg.HTTP.Listen = ""

	sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	rep := collectStatus(sctx, cfg)
	var out bytes.Buffer
	printStatus(&out, rep)
	text := out.String()
	t.Logf("status:\n%s", text)
	for _, wrong := range []string{"exists", "active", "messages", "records"} {
		if strings.Contains(text, "  "+wrong+" ") {
			t.Errorf("status claims %q although it could not tell", wrong)
		}
	}
	if strings.Count(text, "unknown") < 3 {
		t.Errorf("status does not say the slot, the stream and the dead letters are unknown")
	}
	if !strings.Contains(rep.PostgresError, "password authentication failed") || !strings.Contains(rep.PostgresError, "check the user and password in postgres.url") {
		t.Errorf("postgres error %q does not name the password", rep.PostgresError)
	}
	if strings.Contains(rep.PostgresError, "tls error") {
		t.Errorf("the postgres error names the refused TLS attempt, which is not the cause: %q", rep.PostgresError)
	}
	if rep.NATSError == "" || len(rep.Problems) != 2 {
		t.Errorf("nats error %q, problems %q", rep.NATSError, rep.Problems)
	}
}

// passwordPostgres starts a server that asks for passwords (passwordHBA),
// with the role status_user whose password is right-password.
func passwordPostgres(t *testing.T) *testenv.Postgres {
	t.Helper()
	testenv.Get(t) // skips under -short
	pg, err := testenv.StartPostgres()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pg.Close)
	if err := pg.SetHBA(passwordHBA); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, pg.AdminURL)
	if err != nil {
		t.Fatal(err)
	}
	_, err = conn.Exec(ctx, "CREATE ROLE status_user WITH LOGIN REPLICATION PASSWORD 'right-password'")
	conn.Close(ctx)
	if err != nil {
		t.Fatal(err)
	}
	return pg
}
