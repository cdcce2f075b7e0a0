package relay_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/contract"
	"github.com/outbox-relay/outbox-relay/internal/relaytest"
	"github.com/outbox-relay/outbox-relay/router"
)

// Regression (issue 16, case 1): COPY writes many tuples in one WAL record,
// so its rows share one LSN. Their dead-letter records were all given the
// id dlq:<table>:<LSN>, and the dead-letter stream kept the first and
// dropped the rest as duplicates while the slot confirmed past them. Every
// row, refused by the router or by the broker, must have its own record.
func TestRelayDeadLettersEveryCopiedRow(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newFixture(t, "")
	f.relayTable(ctx, "loose_outbox", `event_id text, aggregate_id text, aggregate_version bigint, event_type text, payload text`)
	// The broker refuses messages over 4 KiB for good.
	f.Cfg.CreateStreams = false
	for _, c := range []jetstream.StreamConfig{
		{Name: f.Stream, Subjects: f.Cfg.Stream.Subjects, Duplicates: 2 * time.Minute, MaxMsgSize: 4096, AllowBatchPublish: true},
		{Name: f.DLQ, Subjects: f.Cfg.DeadLetterStream.Subjects, Duplicates: 2 * time.Minute},
	} {
		if _, err := f.JS.CreateStream(ctx, c); err != nil {
			t.Fatal(err)
		}
	}
	f.Setup(ctx)
	f.start(ctx)

	// A text COPY: five rows the router refuses with a readable event id,
	// five without one.
	var copyText strings.Builder
	for i := range 5 {
		fmt.Fprintf(&copyText, "copy-%d\tagg\t%d\tBad\\nType\t{}\n", i, i)
	}
	for i := range 5 {
		fmt.Fprintf(&copyText, "\\N\tagg\t%d\tT\t{}\n", 10+i)
	}
	conn, err := f.DB.Pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Conn().PgConn().CopyFrom(ctx, strings.NewReader(copyText.String()), "COPY loose_outbox FROM STDIN"); err != nil {
		t.Fatal(err)
	}
	conn.Release()
	// pgx CopyFrom (binary COPY): three rows without event id, and three the
	// broker refuses as too large whose event ids are too long to serve as
	// the record's id.
	var rows [][]any
	for i := range 3 {
		rows = append(rows, []any{nil, "agg", int64(20 + i), "T", "{}"})
	}
	for i := range 3 {
		id := fmt.Sprintf("%s-%d", strings.Repeat("l", 300), i)
		rows = append(rows, []any{id, "big", int64(i + 1), "T", `"` + strings.Repeat("x", 5000) + `"`})
	}
	if _, err := f.DB.Pool.CopyFrom(ctx, pgx.Identifier{"loose_outbox"}, []string{"event_id", "aggregate_id", "aggregate_version", "event_type", "payload"}, pgx.CopyFromRows(rows)); err != nil {
		t.Fatal(err)
	}
	if _, err := f.DB.Pool.Exec(ctx, `INSERT INTO loose_outbox VALUES ('ok-1', 'agg', 100, 'T', '{}')`); err != nil {
		t.Fatal(err)
	}
	f.WaitCount(ctx, f.Stream, 1, 30*time.Second)
	// The event after the copies is stored: every record before it was
	// settled, duplicate or not.
	f.waitConfirmed(ctx, 10*time.Second, nil)
	const want = 5 + 5 + 3 + 3
	dl := relaytest.ReadStream(ctx, t, f.JS, f.DLQ)
	ids := map[string]bool{}
	for _, m := range dl {
		ids[m.Headers[contract.MsgID][0]] = true
	}
	if len(dl) != want || len(ids) != want {
		t.Fatalf("%d dead-letter records with %d ids, want %d: %v", len(dl), len(ids), want, ids)
	}
}

// Regression (issue 16, case 2): a row whose header block exceeds
// JetStream's 64 KiB limit (a 70 KB event type, well within max_payload)
// was refused by the broker with an error taken as transient: in batches
// nothing after it was stored, per aggregate everything after it was
// stored but the watermark never passed it. It is dead-lettered, and the
// slot confirms past everything.
func TestRelayDeadLettersHugeHeaders(t *testing.T) {
	t.Parallel()
	for _, mode := range []string{"on", "off"} {
		t.Run("batch_publish "+mode, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			f := newFixture(t, "")
			f.Cfg.BatchPublish = mode
			f.Setup(ctx)
			f.start(ctx)
			if _, err := f.DB.Pool.Exec(ctx, `INSERT INTO outbox (event_id, aggregate_id, aggregate_version, event_type, payload)
				VALUES (gen_random_uuid(), 'huge', 1, repeat('x', 70000), '{}')`); err != nil {
				t.Fatal(err)
			}
			evs := relaytest.Write(ctx, t, f.DB.Pool, relaytest.Load{Events: 300, Aggregates: 10})
			f.WaitCount(ctx, f.Stream, uint64(len(evs)), 30*time.Second)
			f.WaitCount(ctx, f.DLQ, 1, 30*time.Second)
			dl := relaytest.ReadStream(ctx, t, f.JS, f.DLQ)
			if c := dl[0].Headers[contract.DLQReasonClass][0]; c != router.ClassHeaderTooLarge {
				t.Fatalf("reason class %q", c)
			}
			f.waitConfirmed(ctx, 10*time.Second, nil)
		})
	}
}
