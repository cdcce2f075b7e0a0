package outbox

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

func TestMain(m *testing.M) { os.Exit(testenv.Main(m)) }

func TestInsertCommitsWithTheTransaction(t *testing.T) {
	t.Parallel()
	db := testenv.Get(t).NewDatabase(t)
	db.ExecFile(t, filepath.Join(testenv.RepoRoot(t), "sql", "outbox.sql"))
	ctx := context.Background()
	w, err := NewWriter(Config{})
	testenv.Must(t, err, "new writer")

	insert := func(ev Event, commit bool) uuid.UUID {
		tx, err := db.Pool.Begin(ctx)
		testenv.Must(t, err, "begin")
		defer func() { _ = tx.Rollback(ctx) }()
		id, err := w.Insert(ctx, tx, ev)
		testenv.Must(t, err, "insert")
		if commit {
			testenv.Must(t, tx.Commit(ctx), "commit")
		}
		return id
	}
	at := time.Date(2025, 1, 2, 3, 4, 5, 123456000, time.UTC)
	id1 := insert(Event{AggregateType: "registration", AggregateID: "r1", AggregateVersion: 2, Type: "RegistrationConfirmed",
		Payload: map[string]any{"registrationId": "r1", "version": 2}, OccurredAt: at}, true)
	id2 := insert(Event{AggregateID: "r1", AggregateVersion: 3, Type: "RegistrationCancelled", Payload: json.RawMessage(`{}`)}, true)
	rolledBack := insert(Event{AggregateID: "r1", AggregateVersion: 4, Type: "X", Payload: []byte(`1`)}, false)

	if id1.Version() != 7 || id2.Version() != 7 {
		t.Fatalf("generated ids %s %s are not UUIDv7", id1, id2)
	}
	if id1.String() >= id2.String() {
		t.Fatalf("UUIDv7 ids are not time-ordered: %s then %s", id1, id2)
	}
	var (
		aggType, aggID, typ, payload, state string
		version                             int64
		occurred                            time.Time
	)
	err = db.Pool.QueryRow(ctx, `SELECT aggregate_type, aggregate_id, aggregate_version, event_type, payload::text, occurred_at, publish_state
		FROM outbox WHERE event_id = $1`, id1).Scan(&aggType, &aggID, &version, &typ, &payload, &occurred, &state)
	testenv.Must(t, err, "read row")
	if aggType != "registration" || aggID != "r1" || version != 2 || typ != "RegistrationConfirmed" ||
		payload != `{"version": 2, "registrationId": "r1"}` || !occurred.Equal(at) || state != "PENDING" {
		t.Fatalf("row: %q %q %d %q %s %s %q", aggType, aggID, version, typ, payload, occurred, state)
	}
	if err := db.Pool.QueryRow(ctx, `SELECT aggregate_type FROM outbox WHERE event_id = $1`, id2).Scan(&aggType); err != nil || aggType != "" {
		t.Fatalf("default aggregate type %q, %v", aggType, err)
	}
	var n int
	testenv.Must(t, db.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE event_id = $1`, rolledBack).Scan(&n), "count")
	if n != 0 {
		t.Fatal("a rolled-back event is in the outbox")
	}

	// A given id is kept; the table's unique constraint rejects its reuse.
	given := uuid.MustParse("0190a6e5-0000-7000-8000-000000000001")
	if got := insert(Event{ID: given, AggregateID: "r2", AggregateVersion: 1, Type: "T", Payload: json.RawMessage(`{}`)}, true); got != given {
		t.Fatalf("id %s, want the given %s", got, given)
	}
}

func TestInsertIntoCustomTable(t *testing.T) {
	t.Parallel()
	db := testenv.Get(t).NewDatabase(t)
	ctx := context.Background()
	_, err := db.Pool.Exec(ctx, `CREATE SCHEMA events; CREATE TABLE events."Outbox" (
		id text PRIMARY KEY, agg text NOT NULL, ver bigint NOT NULL, kind text NOT NULL, body jsonb NOT NULL)`)
	testenv.Must(t, err, "create table")
	w, err := NewWriter(Config{Table: "events.Outbox", Columns: Columns{EventID: "id", AggregateType: Omit,
		AggregateID: "agg", AggregateVersion: "ver", EventType: "kind", Payload: "body", OccurredAt: Omit}})
	testenv.Must(t, err, "new writer")
	tx, err := db.Pool.Begin(ctx)
	testenv.Must(t, err, "begin")
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := w.Insert(ctx, tx, Event{AggregateID: "a", Type: "T", Payload: 1, OccurredAt: time.Now()}); !errors.Is(err, ErrInvalidEvent) {
		t.Fatalf("OccurredAt without a column: err %v", err)
	}
	if _, err := w.Insert(ctx, tx, Event{AggregateType: "x", AggregateID: "a", Type: "T", Payload: 1}); !errors.Is(err, ErrInvalidEvent) {
		t.Fatalf("AggregateType without a column: err %v", err)
	}
	id, err := w.Insert(ctx, tx, Event{AggregateID: "a", AggregateVersion: 1, Type: "T", Payload: 1})
	testenv.Must(t, err, "insert")
	testenv.Must(t, tx.Commit(ctx), "commit")
	var kind string
	testenv.Must(t, db.Pool.QueryRow(ctx, `SELECT kind FROM events."Outbox" WHERE id = $1`, id.String()).Scan(&kind), "read")
	if kind != "T" {
		t.Fatalf("kind %q", kind)
	}
}

func TestEmitMessageIsDecodedOnlyOnCommit(t *testing.T) {
	t.Parallel()
	db := testenv.Get(t).NewDatabase(t)
	ctx := context.Background()
	slot := testenv.UniqueName("slot")
	_, err := db.Pool.Exec(ctx, `SELECT pg_create_logical_replication_slot($1, 'test_decoding')`, slot)
	testenv.Must(t, err, "create slot")

	emit := func(ev Event, commit bool) uuid.UUID {
		tx, err := db.Pool.Begin(ctx)
		testenv.Must(t, err, "begin")
		defer func() { _ = tx.Rollback(ctx) }()
		// The test cluster commits asynchronously, and logical decoding
		// reads only flushed WAL: flush this commit.
		_, err = tx.Exec(ctx, "SET LOCAL synchronous_commit = on")
		testenv.Must(t, err, "synchronous commit")
		id, err := EmitMessage(ctx, tx, "", ev)
		testenv.Must(t, err, "emit")
		if commit {
			testenv.Must(t, tx.Commit(ctx), "commit")
		}
		return id
	}
	at := time.Date(2025, 1, 2, 3, 4, 5, 6000, time.UTC)
	_ = emit(Event{AggregateID: "gone", Type: "T", Payload: json.RawMessage(`{}`)}, false)
	id := emit(Event{AggregateType: "registration", AggregateID: "r1", AggregateVersion: 7, Type: "RegistrationConfirmed",
		Payload: json.RawMessage(`{"registrationId":"r1","version":7}`), OccurredAt: at}, true)

	rows, err := db.Pool.Query(ctx, `SELECT data FROM pg_logical_slot_get_changes($1, NULL, NULL)`, slot)
	testenv.Must(t, err, "read slot")
	datas, err := pgx.CollectRows(rows, pgx.RowTo[string])
	testenv.Must(t, err, "collect")
	var contents []string
	for _, d := range datas {
		// test_decoding: "message: transactional: 1 prefix: outbox, sz: N content:{...}"
		if i := strings.Index(d, "content:"); strings.HasPrefix(d, "message:") && i >= 0 {
			if !strings.Contains(d, "transactional: 1 prefix: outbox,") {
				t.Fatalf("message not transactional with prefix outbox: %s", d)
			}
			contents = append(contents, d[i+len("content:"):])
		}
	}
	if len(contents) != 1 {
		t.Fatalf("decoded %d messages, want 1 (the rolled-back one must not appear): %q", len(contents), datas)
	}
	env, err := ParseEnvelope([]byte(contents[0]))
	testenv.Must(t, err, "parse envelope")
	want := Envelope{EventID: id.String(), AggregateType: "registration", AggregateID: "r1", AggregateVersion: 7,
		EventType: "RegistrationConfirmed", Payload: json.RawMessage(`{"registrationId":"r1","version":7}`), OccurredAt: at}
	if env.EventID != want.EventID || env.AggregateType != want.AggregateType || env.AggregateID != want.AggregateID ||
		env.AggregateVersion != want.AggregateVersion || env.EventType != want.EventType ||
		string(env.Payload) != string(want.Payload) || !env.OccurredAt.Equal(at) {
		t.Fatalf("envelope %+v, want %+v", env, want)
	}
}

func TestValidation(t *testing.T) {
	ok := Event{AggregateID: "a", AggregateVersion: 1, Type: "T", Payload: json.RawMessage(`{}`)}
	for _, tc := range []struct {
		name  string
		mod   func(*Event)
		field string
	}{
		{"valid", func(*Event) {}, ""},
		{"version zero", func(e *Event) { e.AggregateVersion = 0 }, ""},
		{"marshalled payload", func(e *Event) { e.Payload = struct{ A int }{1} }, ""},
		{"no type", func(e *Event) { e.Type = "" }, "Type"},
		{"no aggregate id", func(e *Event) { e.AggregateID = "" }, "AggregateID"},
		{"negative version", func(e *Event) { e.AggregateVersion = -1 }, "AggregateVersion"},
		{"nil payload", func(e *Event) { e.Payload = nil }, "Payload"},
		{"invalid json", func(e *Event) { e.Payload = []byte(`{`) }, "Payload"},
		{"unencodable", func(e *Event) { e.Payload = make(chan int) }, "Payload"},
		{"nul in payload", func(e *Event) { e.Payload = json.RawMessage(`"a\u0000"`) }, "Payload"},
		{"newline in type", func(e *Event) { e.Type = "A\nB" }, "Type"},
		{"nul in aggregate type", func(e *Event) { e.AggregateType = "a\x00" }, "AggregateType"},
		{"invalid utf-8", func(e *Event) { e.AggregateID = "\xff" }, "AggregateID"},
	} {
		ev := ok
		tc.mod(&ev)
		_, err := prepare(&ev)
		var fe *FieldError
		switch {
		case tc.field == "" && err != nil:
			t.Errorf("%s: unexpected error %v", tc.name, err)
		case tc.field != "" && (!errors.As(err, &fe) || fe.Field != tc.field || !errors.Is(err, ErrInvalidEvent)):
			t.Errorf("%s: err %v, want a FieldError for %s", tc.name, err, tc.field)
		}
	}
	for _, cfg := range []Config{{Table: "a.b.c"}, {Table: ".x"}, {Columns: Columns{EventID: Omit}}} {
		if _, err := NewWriter(cfg); !errors.Is(err, ErrInvalidConfig) {
			t.Errorf("NewWriter(%+v): err %v, want ErrInvalidConfig", cfg, err)
		}
	}
}

func TestParseEnvelope(t *testing.T) {
	const valid = `{"event_id":"e","aggregate_type":"t","aggregate_id":"","aggregate_version":9007199254740993,"event_type":"T","payload":null,"occurred_at":"2025-01-02T03:04:05Z","future":1}`
	env, err := ParseEnvelope([]byte(valid))
	testenv.Must(t, err, "parse")
	if env.AggregateVersion != 9007199254740993 || env.AggregateID != "" || string(env.Payload) != "null" {
		t.Fatalf("parsed %+v", env)
	}
	for _, tc := range []struct{ in, field string }{
		{`[]`, ""},
		{`{}`, "event_id"},
		{`{"event_id":"e"}`, "aggregate_id"},
		{`{"event_id":"e","aggregate_id":"a"}`, "aggregate_version"},
		{`{"event_id":"e","aggregate_id":"a","aggregate_version":1.5,"event_type":"T","payload":1,"occurred_at":"2025-01-02T03:04:05Z"}`, "aggregate_version"},
		{`{"event_id":"e","aggregate_id":"a","aggregate_version":1}`, "event_type"},
		{`{"event_id":"e","aggregate_id":"a","aggregate_version":1,"event_type":"T"}`, "payload"},
		{`{"event_id":"e","aggregate_id":"a","aggregate_version":1,"event_type":"T","payload":1}`, "occurred_at"},
		{`{"event_id":"e","aggregate_id":"a","aggregate_version":1,"event_type":"T","payload":1,"occurred_at":"yesterday"}`, "occurred_at"},
		{`{"event_id":1}`, ""},
		{valid + `{}`, ""},
	} {
		_, err := ParseEnvelope([]byte(tc.in))
		var ee *EnvelopeError
		if !errors.As(err, &ee) || ee.Field != tc.field || !errors.Is(err, ErrInvalidEnvelope) {
			t.Errorf("ParseEnvelope(%s): err %v, want field %q", tc.in, err, tc.field)
		}
	}
}

// FuzzParseEnvelope: untrusted content never panics, and what parses
// survives a round trip through json.Marshal.
func FuzzParseEnvelope(f *testing.F) {
	f.Add([]byte(`{"event_id":"e","aggregate_id":"a","aggregate_version":1,"event_type":"T","payload":{"x":[1,2]},"occurred_at":"2025-01-02T03:04:05.5Z"}`))
	f.Add([]byte(`{"event_id":"e","aggregate_version":-9223372036854775808}`))
	f.Add([]byte(`null`))
	f.Fuzz(func(t *testing.T, data []byte) {
		env, err := ParseEnvelope(data)
		if err != nil {
			return
		}
		b, err := json.Marshal(env)
		if err != nil {
			t.Fatalf("marshal %+v: %v", env, err)
		}
		again, err := ParseEnvelope(b)
		if err != nil {
			t.Fatalf("round trip of %s: %v", b, err)
		}
		if again.EventID != env.EventID || again.AggregateVersion != env.AggregateVersion || again.AggregateID != env.AggregateID ||
			again.EventType != env.EventType || !again.OccurredAt.Equal(env.OccurredAt) {
			t.Fatalf("round trip changed %+v to %+v", env, again)
		}
	})
}
