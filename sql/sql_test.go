package sql_test

import (
	"context"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

func TestMain(m *testing.M) { os.Exit(testenv.Main(m)) }

// confirmSQL returns the example CTE of example_registration.sql with the
// seed's named parameters replaced by $1 (registration_id), $2
// (expected_version) and $3 (event_id): the test runs the documented text
// itself, so the file and the test cannot drift apart.
func confirmSQL(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(testenv.RepoRoot(t), "sql", "example_registration.sql"))
	if err != nil {
		t.Fatal(err)
	}
	_, rest, ok := strings.Cut(string(b), "-- BEGIN EXAMPLE confirm_registration\n")
	example, _, ok2 := strings.Cut(rest, "-- END EXAMPLE")
	if !ok || !ok2 {
		t.Fatal("example_registration.sql: BEGIN/END EXAMPLE markers not found")
	}
	var lines []string
	for _, l := range strings.Split(strings.TrimSpace(example), "\n") {
		l = strings.TrimPrefix(strings.TrimPrefix(l, "--"), " ")
		lines = append(lines, l)
	}
	q := strings.TrimSuffix(strings.TrimSpace(strings.Join(lines, "\n")), ";")
	q = strings.NewReplacer(":registration_id", "$1", ":expected_version", "$2", ":event_id", "$3").Replace(q)
	if p := regexp.MustCompile(`(^|[^:]):[a-z_]+`).FindString(q); p != "" {
		t.Fatalf("unreplaced parameter %q in\n%s", p, q)
	}
	return q
}

// newDB creates a database with the outbox and registration tables.
func newDB(t *testing.T) *testenv.Database {
	t.Helper()
	env := testenv.Get(t)
	db := env.NewDatabase(t)
	root := testenv.RepoRoot(t)
	db.ExecFile(t, filepath.Join(root, "sql", "outbox.sql"))
	db.ExecFile(t, filepath.Join(root, "sql", "example_registration.sql"))
	return db
}

type registration struct {
	status  string
	version int64
}

func getRegistration(ctx context.Context, t *testing.T, db *testenv.Database, id uuid.UUID) registration {
	t.Helper()
	var r registration
	err := db.Pool.QueryRow(ctx, `SELECT status, version FROM registration WHERE id = $1`, id).Scan(&r.status, &r.version)
	testenv.Must(t, err, "read registration")
	return r
}

// confirm runs the example in its own transaction, as the seed does, and
// returns the rows it returned.
func confirm(ctx context.Context, t *testing.T, db *testenv.Database, id uuid.UUID, expected int64, eventID uuid.UUID) (events []uuid.UUID, versions []int64) {
	t.Helper()
	q := confirmSQL(t)
	err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		rows, err := tx.Query(ctx, q, id, expected, eventID)
		if err != nil {
			return err
		}
		defer rows.Close()
		for rows.Next() {
			var e uuid.UUID
			var v int64
			if err := rows.Scan(&e, &v); err != nil {
				return err
			}
			events, versions = append(events, e), append(versions, v)
		}
		return rows.Err()
	})
	testenv.Must(t, err, "run the confirm CTE")
	return events, versions
}

func TestConfirmRegistration(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	db := newDB(t)
	id, eventID := uuid.New(), uuid.New()
	_, err := db.Pool.Exec(ctx, `INSERT INTO registration (id, status, version) VALUES ($1, 'PENDING_PAYMENT', 3)`, id)
	testenv.Must(t, err, "insert registration")

	events, versions := confirm(ctx, t, db, id, 3, eventID)
	if len(events) != 1 || events[0] != eventID || versions[0] != 4 {
		t.Fatalf("CTE returned events %v versions %v, want [%s] [4]", events, versions, eventID)
	}
	if r := getRegistration(ctx, t, db, id); r != (registration{"CONFIRMED", 4}) {
		t.Fatalf("registration = %+v", r)
	}

	var (
		n                              int
		aggType, aggID, evType, pstate string
		aggVersion, payloadVersion     int64
		payloadID                      string
		occurred                       time.Time
	)
	err = db.Pool.QueryRow(ctx, `
		SELECT count(*) OVER (), aggregate_type, aggregate_id, aggregate_version, event_type, publish_state,
		       payload->>'registrationId', (payload->>'version')::bigint, occurred_at
		FROM outbox`).Scan(&n, &aggType, &aggID, &aggVersion, &evType, &pstate, &payloadID, &payloadVersion, &occurred)
	testenv.Must(t, err, "read outbox")
	if n != 1 || aggID != id.String() || aggVersion != 4 || evType != "RegistrationConfirmed" || pstate != "PENDING" ||
		payloadID != id.String() || payloadVersion != 4 || aggType != "registration" || time.Since(occurred) > time.Minute {
		t.Fatalf("outbox row: n=%d type=%q id=%q version=%d event=%q state=%q payload id=%q version=%d occurred=%v",
			n, aggType, aggID, aggVersion, evType, pstate, payloadID, payloadVersion, occurred)
	}

	// Confirming again with the old version is a no-op: the row is no longer
	// PENDING_PAYMENT at version 3.
	if events, _ := confirm(ctx, t, db, id, 3, uuid.New()); len(events) != 0 {
		t.Fatalf("second confirm returned %v", events)
	}
	testenv.Must(t, db.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox`).Scan(&n), "count outbox")
	if n != 1 {
		t.Fatalf("outbox has %d rows after the second confirm, want 1", n)
	}
}

func TestConfirmRegistrationZeroRows(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	db := newDB(t)
	tests := []struct {
		name     string
		status   string
		version  int64
		expected int64
		otherID  bool // confirm an id that does not exist
	}{
		{name: "wrong expected version", status: "PENDING_PAYMENT", version: 3, expected: 2},
		{name: "already confirmed", status: "CONFIRMED", version: 3, expected: 3},
		{name: "unknown registration", status: "PENDING_PAYMENT", version: 3, expected: 3, otherID: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			id := uuid.New()
			_, err := db.Pool.Exec(ctx, `INSERT INTO registration (id, status, version) VALUES ($1, $2, $3)`, id, tt.status, tt.version)
			testenv.Must(t, err, "insert registration")
			target := id
			if tt.otherID {
				target = uuid.New()
			}
			events, _ := confirm(ctx, t, db, target, tt.expected, uuid.New())
			if len(events) != 0 {
				t.Fatalf("CTE returned %v, want no rows", events)
			}
			if r := getRegistration(ctx, t, db, id); r != (registration{tt.status, tt.version}) {
				t.Fatalf("registration changed to %+v", r)
			}
			var n int
			testenv.Must(t, db.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox`).Scan(&n), "count outbox")
			if n != 0 {
				t.Fatalf("outbox has %d rows, want none", n)
			}
		})
	}
}
