package main

import (
	"bytes"
	"context"
	"fmt"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/replication"
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

// Issue 27: a healthy standby showed only "ready false"; "confirmable LSN"
// trailed the slot's confirmed_flush_lsn, so an idle relay looked behind;
// the failover heading printed with an empty value.
func TestStatusPresentsTheRelayAndFailover(t *testing.T) {
	t.Parallel()
	base := statusReport{Slot: "s", SlotExists: true, ConfirmedFlushLSN: "0/3000000", Stream: "S", StreamStorage: "File", DeadLetterStream: "D"}
	for _, tc := range []struct {
		name    string
		relay   relayFigures
		fo      *replication.FailoverReport
		want    []string
		wantNot []string
	}{
		{"standby", relayFigures{Standby: true, LastRelayedCommit: "0/0"}, &replication.FailoverReport{},
			[]string{"state  standby, healthy, waiting for the slot", "failover  no standby: no failover possible"},
			[]string{"ready", "confirmable", "last relayed commit"}},
		{"idle streaming relay", relayFigures{Ready: true, LastRelayedCommit: "0/2000000"}, &replication.FailoverReport{Standbys: 1},
			[]string{"state  streaming", "last relayed commit  0/2000000, acknowledged and confirmed (the slot's confirmed_flush_lsn is at or past it)", "failover  safe now (1 standbys)"},
			[]string{"confirmable"}},
		{"acked, not yet confirmed", relayFigures{Ready: true, LastRelayedCommit: "0/4000000"}, &replication.FailoverReport{Standbys: 1, Problems: []string{"x"}},
			[]string{"0/4000000, acknowledged; the slot confirms it at the next status update", "failover  not safe now (1 standbys)"}, nil},
		{"fresh session", relayFigures{Ready: true, LastRelayedCommit: "0/0"}, nil,
			[]string{"last relayed commit  none yet"}, []string{"failover"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := base
			tc.relay.URL = "http://127.0.0.1:9188/metrics"
			r.Relay, r.Failover = &tc.relay, tc.fo
			var out bytes.Buffer
			printStatus(&out, r)
			text := regexp.MustCompile(` {2,}`).ReplaceAllString(out.String(), "  ")
			for _, w := range tc.want {
				if !strings.Contains(text, w) {
					t.Errorf("status lacks %q:\n%s", w, out.String())
				}
			}
			for _, w := range tc.wantNot {
				if strings.Contains(text, w) {
					t.Errorf("status says %q:\n%s", w, out.String())
				}
			}
			if regexp.MustCompile(`(?m)^\S+\s*$`).MatchString(out.String()) {
				t.Errorf("a heading prints with an empty value:\n%s", out.String())
			}
		})
	}
}

// Issue 27: on PostgreSQL 15 with a physical standby status exited 1 for
// good; a risk no setting removes is a warning with the runbook. On 17 a
// misconfiguration stays a problem.
func TestFailoverFindings(t *testing.T) {
	t.Parallel()
	p, w := failoverFindings(replication.FailoverReport{PrimaryVersion: 150018, Standbys: 1, Problems: []string{"PostgreSQL 15 has no failover slots"}})
	if len(p) != 0 || len(w) != 1 || !strings.Contains(w[0], "#primary-failover-on-postgresql-16-or-older") {
		t.Errorf("PostgreSQL 15: problems %q, warnings %q; want one warning with the runbook", p, w)
	}
	p, w = failoverFindings(replication.FailoverReport{PrimaryVersion: 170012, Standbys: 1, Problems: []string{"sync_replication_slots is off"}})
	if len(p) != 1 || len(w) != 0 {
		t.Errorf("PostgreSQL 17: problems %q, warnings %q; want one problem", p, w)
	}
}

// Issue 27: with wal_level = replica, run named the setting and status
// said only "slot does not exist: run `outbox-relay setup`", which setup
// then refuses.
func TestStatusNamesWalLevel(t *testing.T) {
	t.Parallel()
	testenv.Get(t)
	pg, err := testenv.StartPostgres(testenv.WithSetting("wal_level", "replica"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pg.Close)
	f := newOpsFixture(t)
	cfg := f.cfg
	cfg.Postgres.URL, cfg.HTTP.Listen = pg.URL("postgres"), ""
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	rep := collectStatus(ctx, cfg)
	if !strings.Contains(strings.Join(rep.Problems, "\n"), "wal_level is \"replica\"") {
		t.Errorf("status problems do not name wal_level:\n%s", strings.Join(rep.Problems, "\n"))
	}
}
