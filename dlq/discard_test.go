package dlq

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"

	"github.com/outbox-relay/outbox-relay/consumer"
	"github.com/outbox-relay/outbox-relay/contract"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// Issue 15, case 6: with VersionCheck, discarding a dead letter moves the
// aggregate past the discarded version in the audited transaction and
// records the event in the dedup table. The position used to stay before
// the discarded version for good: every later version became a gap.
func TestDiscardMovesVersionCheckPastTheDiscardedVersion(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	ctx := context.Background()
	_, err := f.pool.Exec(ctx, `CREATE TABLE credit (event_id text, account text, version bigint, n bigserial)`)
	testenv.Must(t, err, "create table")
	var mu sync.Mutex
	calls := map[string]int{}
	broken := map[string]bool{"e-a-2": true, "e-d-1": true}
	h := consumer.HandlerFunc(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		mu.Lock()
		calls[m.ID]++
		mu.Unlock()
		if broken[m.ID] {
			return consumer.Permanent(fmt.Errorf("cannot credit %s", m.ID))
		}
		_, err := tx.Exec(ctx, `INSERT INTO credit (event_id, account, version) VALUES ($1, $2, $3)`, m.ID, m.AggregateID, m.AggregateVersion)
		return err
	})
	f.run(consumer.Config{Name: "vc", VersionCheck: true, InitialVersion: 1, GapWait: 6 * time.Second, GapRecheck: 100 * time.Millisecond}, h)
	store := NewStore(f.pool)
	discard := func(eventID string) {
		t.Helper()
		var id int64
		waitFor(t, "dead letter of "+eventID, func() bool {
			return f.pool.QueryRow(ctx, `SELECT id FROM consumer_dead_letter WHERE consumer = 'vc' AND event_id = $1`, eventID).Scan(&id) == nil
		})
		_, err := store.Discard(ctx, Action{Actor: "op", Reason: "never credit"}, Filter{IDs: []int64{id}})
		testenv.Must(t, err, "discard %s", eventID)
	}
	versions := func(agg string) string {
		rows, err := f.pool.Query(ctx, `SELECT version FROM credit WHERE account = $1 ORDER BY n`, agg)
		testenv.Must(t, err, "credits")
		vs, err := pgx.CollectRows(rows, pgx.RowTo[int64])
		testenv.Must(t, err, "credits")
		return fmt.Sprint(vs)
	}

	// The reproduction: discard v2, then v3 and v4 arrive.
	f.publish("e-a-1", "a", 1)
	f.publish("e-a-2", "a", 2)
	discard("e-a-2")
	if v := queryInt(t, f.pool, `SELECT version FROM consumer_aggregate_position WHERE consumer = 'vc' AND aggregate_id = 'a'`); v != 2 {
		t.Fatalf("position after the discard: %d, want 2", v)
	}
	var outcome string
	testenv.Must(t, f.pool.QueryRow(ctx, `SELECT outcome FROM consumed_message WHERE consumer = 'vc' AND event_id = 'e-a-2'`).Scan(&outcome), "dedup row")
	if outcome != "discarded" {
		t.Fatalf("dedup outcome %q, want discarded", outcome)
	}
	f.publish("e-a-3", "a", 3)
	f.publish("e-a-4", "a", 4)
	waitFor(t, "versions 3 and 4", func() bool { return versions("a") == "[1 3 4]" })

	// A redelivery of the discarded event is a duplicate.
	m := nats.NewMsg(f.stream + ".account.a")
	m.Header.Set(contract.MsgID, "e-a-2/again")
	m.Header.Set(contract.EventID, "e-a-2")
	m.Header.Set(contract.EventType, "PointsEarned")
	m.Header.Set(contract.AggregateType, "account")
	m.Header.Set(contract.AggregateID, "a")
	m.Header.Set(contract.AggregateVersion, strconv.Itoa(2))
	m.Data = []byte(`{"account": "a", "version": 2}`)
	_, err = f.js.PublishMsg(ctx, m)
	testenv.Must(t, err, "republish")

	// The consumer skips a discarded version the position never stood
	// before: d's version 1 (InitialVersion) is discarded before d has a
	// position.
	f.publish("e-d-1", "d", 1)
	discard("e-d-1")
	f.publish("e-d-2", "d", 2)
	waitFor(t, "d's version 2", func() bool { return versions("d") == "[2]" })
	waitFor(t, "the redelivery settled", func() bool {
		c, err := f.js.Consumer(ctx, f.stream, "vc")
		if err != nil {
			return false
		}
		info, err := c.Info(ctx)
		return err == nil && info.NumAckPending == 0 && info.NumPending == 0
	})
	mu.Lock()
	defer mu.Unlock()
	if calls["e-a-2"] != 1 {
		t.Fatalf("discarded event handled %d times, want 1 (its redelivery is a duplicate)", calls["e-a-2"])
	}
	if n := queryInt(t, f.pool, `SELECT count(*) FROM consumer_dead_letter WHERE consumer = 'vc' AND status = 'open'`); n != 0 {
		t.Fatalf("%d open dead letters, want 0", n)
	}
	var detail string
	testenv.Must(t, f.pool.QueryRow(ctx, `SELECT detail::text FROM consumer_dlq_audit WHERE event_id = 'e-a-2'`).Scan(&detail), "audit")
	if want := `"position_moved_to": 2`; !strings.Contains(detail, want) {
		t.Fatalf("audit detail %s lacks %s", detail, want)
	}
}
