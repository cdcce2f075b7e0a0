package replication_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/replication"
	"github.com/outbox-relay/outbox-relay/watermark"
)

// TestCheckFeatures: each feature the configuration asks for against each
// server it may meet; every refusal names the version needed or the
// setting to change.
func TestCheckFeatures(t *testing.T) {
	primary15 := replication.ServerInfo{VersionNum: 150018, WALLevel: "logical"}
	primary17 := replication.ServerInfo{VersionNum: 170012, WALLevel: "logical"}
	standby := func(v int, feedback bool) replication.ServerInfo {
		return replication.ServerInfo{VersionNum: v, WALLevel: "logical", InRecovery: true, HotStandbyFeedback: feedback}
	}
	for _, c := range []struct {
		name    string
		info    replication.ServerInfo
		cfg     replication.Config
		want    error
		mention []string
	}{
		{"15 plain", primary15, replication.Config{}, nil, nil},
		{"15 messages", primary15, replication.Config{Messages: true}, nil, nil},
		{"13 messages", replication.ServerInfo{VersionNum: 130016, WALLevel: "logical"}, replication.Config{Messages: true},
			replication.ErrVersionUnsupported, []string{"PostgreSQL 14", "13.16"}},
		{"failover slot on 15", primary15, replication.Config{FailoverSlot: true},
			replication.ErrFailoverUnsupported, []string{"PostgreSQL 17", "15.18", "sync_replication_slots", "postgres.failover_slot: false"}},
		{"failover slot on 17", primary17, replication.Config{FailoverSlot: true}, nil, nil},
		{"wal_level replica", replication.ServerInfo{VersionNum: 170012, WALLevel: "replica"}, replication.Config{},
			replication.ErrWalLevel, []string{"wal_level = logical", "restart"}},
		{"standby wal_level replica", replication.ServerInfo{VersionNum: 170012, WALLevel: "replica", InRecovery: true}, replication.Config{},
			replication.ErrWalLevel, []string{"wal_level = logical", "its primary"}},
		{"standby on 15", standby(150018, true), replication.Config{},
			replication.ErrStandbyDecoding, []string{"PostgreSQL 16", "15.18", "target_session_attrs=read-write"}},
		{"standby on 16 without feedback", standby(160004, false), replication.Config{},
			replication.ErrStandbyDecoding, []string{"hot_standby_feedback = on"}},
		{"standby on 16", standby(160004, true), replication.Config{}, nil, nil},
		{"failover slot on a standby", standby(170012, true), replication.Config{FailoverSlot: true},
			replication.ErrStandbyDecoding, []string{"postgres.failover_slot: false", "primary"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			err := c.info.CheckFeatures(c.cfg)
			if !errors.Is(err, c.want) || (c.want == nil) != (err == nil) {
				t.Fatalf("CheckFeatures = %v, want %v", err, c.want)
			}
			if err != nil && !replication.IsPermanent(err) {
				t.Errorf("%v is not permanent", err)
			}
			for _, m := range c.mention {
				if !strings.Contains(err.Error(), m) {
					t.Errorf("error %q does not mention %q", err, m)
				}
			}
		})
	}
}

// TestIsConnectFailure: the relay retries these within a second (a server
// down or not yet promoted); a wrong database or role waits for an operator.
func TestIsConnectFailure(t *testing.T) {
	env := testenv.Get(t)
	port, err := testenv.FreePort()
	testenv.Must(t, err, "free port")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for _, c := range []struct {
		name string
		url  string
		want bool
	}{
		{"nothing listens", fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable&connect_timeout=2", port), true},
		{"no such database", env.PG.URL(testenv.UniqueName("missing")), false},
		{"no such role", strings.Replace(env.PG.URL("postgres"), "postgres@", "nobody_"+testenv.UniqueName("r")+"@", 1), false},
	} {
		t.Run(c.name, func(t *testing.T) {
			cfg := replication.Config{URL: c.url, Slot: "s", Publication: "p"}
			_, err := replication.Open(ctx, cfg, watermark.NewTracker(0))
			if err == nil {
				t.Fatal("Open succeeded")
			}
			if got := replication.IsConnectFailure(err); got != c.want {
				t.Fatalf("IsConnectFailure(%v) = %v, want %v", err, got, c.want)
			}
		})
	}
}

// TestIsServerGone: a session its server ended (here terminated by an
// administrator, as a shutdown or a killed primary would) is retried within
// a second; a statement's own error is not.
func TestIsServerGone(t *testing.T) {
	env := testenv.Get(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, env.PG.URL("postgres"))
	testenv.Must(t, err, "connect")
	defer conn.Close(context.Background())
	admin, err := pgx.Connect(ctx, env.PG.URL("postgres"))
	testenv.Must(t, err, "connect admin")
	defer admin.Close(context.Background())

	var one int
	err = conn.QueryRow(ctx, "SELECT 1 FROM no_such_table").Scan(&one)
	if err == nil || replication.IsServerGone(err) {
		t.Fatalf("a statement's error %v: IsServerGone must be false", err)
	}
	_, err = admin.Exec(ctx, "SELECT pg_terminate_backend($1)", conn.PgConn().PID())
	testenv.Must(t, err, "terminate")
	err = conn.QueryRow(ctx, "SELECT 1").Scan(&one)
	if err == nil {
		t.Fatal("the terminated session still answers")
	}
	if err := fmt.Errorf("read the WAL position: %w", err); !replication.IsServerGone(err) {
		t.Fatalf("IsServerGone(%v) = false, want true", err)
	}
}
