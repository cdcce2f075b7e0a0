package group

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// TestRosterKeepsMembersThatHeartbeat: members heartbeating often while
// another member reads the group never drop out of its view. A listing
// made afresh at each step (listOnce, as members were read before) can
// miss a member whose put replaces its entry meanwhile; the roster's one
// watch sees every put.
func TestRosterKeepsMembersThatHeartbeat(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	bucket := "OUTBOX_GROUP_" + testenv.UniqueName("roster")
	kv, err := f.js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: bucket, TTL: 6 * time.Second, History: 1, Storage: jetstream.MemoryStorage})
	testenv.Must(t, err, "bucket")
	t.Cleanup(func() { _ = f.js.DeleteKeyValue(context.Background(), bucket) })
	g := &Member{kv: kv, ttl: 6 * time.Second, log: zap.NewNop(), roster: newRoster("")}
	ids := []string{"a", "b", "c"}
	for _, id := range ids {
		_, err := kv.Put(ctx, id, []byte("4"))
		testenv.Must(t, err, "put")
	}
	wctx, stop := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Go(func() { g.watchRoster(wctx) })
	for _, id := range ids {
		wg.Go(func() {
			for wctx.Err() == nil {
				_, _ = kv.Put(wctx, id, []byte("4"))
				time.Sleep(time.Millisecond)
			}
		})
	}
	var listMissed, rosterMissed, rounds int
	for end := time.Now().Add(3 * time.Second); time.Now().Before(end); rounds++ {
		if ms, err := g.members(ctx); err != nil || len(ms) != len(ids) {
			rosterMissed++
			t.Errorf("roster: %v, %v; want %v", ms, err, ids)
		}
		if n, err := listOnce(ctx, kv); err == nil && n != len(ids) {
			listMissed++
		}
	}
	stop()
	wg.Wait()
	t.Logf("%d rounds: a fresh listing missed a member %d times, the roster %d", rounds, listMissed, rosterMissed)

	// A member that leaves (deletes its entry) is gone at once; one that
	// stops heartbeating, once the TTL has passed.
	r := newRoster("")
	now := time.Now()
	r.update(entry{key: "a", value: "4", op: jetstream.KeyValuePut}, time.Second, now)
	r.update(entry{key: "b", value: "4", op: jetstream.KeyValuePut}, time.Second, now)
	r.update(entry{key: "c", value: "4", op: jetstream.KeyValuePut}, 3*time.Second, now)
	r.update(entry{key: "b", op: jetstream.KeyValueDelete}, time.Second, now)
	if got := fmt.Sprint(r.live(now.Add(500 * time.Millisecond))); got != "[{a 4} {c 4}]" {
		t.Errorf("after b left: %s", got)
	}
	if got := fmt.Sprint(r.live(now.Add(2 * time.Second))); got != "[{c 4}]" {
		t.Errorf("after a's TTL: %s", got)
	}
}

// listOnce counts the keys in the bucket with a watch of its own that
// ends at the initial values' end.
func listOnce(ctx context.Context, kv jetstream.KeyValue) (int, error) {
	w, err := kv.WatchAll(ctx, jetstream.IgnoreDeletes())
	if err != nil {
		return 0, err
	}
	defer func() { _ = w.Stop() }()
	n := 0
	for {
		select {
		case e := <-w.Updates():
			if e == nil {
				return n, nil
			}
			n++
		case <-ctx.Done():
			return 0, ctx.Err()
		}
	}
}

// entry is a jetstream.KeyValueEntry for roster updates.
type entry struct {
	key, value string
	op         jetstream.KeyValueOp
}

func (e entry) Bucket() string                  { return "" }
func (e entry) Key() string                     { return e.key }
func (e entry) Value() []byte                   { return []byte(e.value) }
func (e entry) Revision() uint64                { return 0 }
func (e entry) Created() time.Time              { return time.Time{} }
func (e entry) Delta() uint64                   { return 0 }
func (e entry) Operation() jetstream.KeyValueOp { return e.op }

// While the bucket cannot be watched, members gives up after the member
// TTL instead of holding the coordinator loop.
func TestMembersWaitsAtMostTheTTL(t *testing.T) {
	g := &Member{ttl: 50 * time.Millisecond, roster: newRoster("")}
	start := time.Now()
	if _, err := g.members(context.Background()); err != errRosterNotReady {
		t.Fatalf("members = %v, want errRosterNotReady", err)
	}
	if el := time.Since(start); el > 5*time.Second {
		t.Fatalf("members waited %s", el)
	}
}

// TestRosterNextExpiry: the coordinator wakes when the first member seen
// runs out of TTL, not a heartbeat interval later; an entry already past
// does not wake it (it would spin while steps fail before pruning it).
func TestRosterNextExpiry(t *testing.T) {
	now := time.Now()
	at := func(d time.Duration) rosterEntry { return rosterEntry{until: now.Add(d)} }
	cases := []struct {
		name string
		seen map[string]rosterEntry
		want time.Time
	}{
		{"none", nil, time.Time{}},
		{"first of three", map[string]rosterEntry{"a": at(5 * time.Second), "b": at(2 * time.Second), "c": at(9 * time.Second)}, now.Add(2 * time.Second)},
		{"past entries skipped", map[string]rosterEntry{"a": at(-time.Second), "b": at(3 * time.Second)}, now.Add(3 * time.Second)},
		{"all past", map[string]rosterEntry{"a": at(-time.Second)}, time.Time{}},
	}
	for _, tc := range cases {
		r := newRoster("")
		for id, e := range tc.seen {
			r.seen[id] = e
		}
		if got := r.nextExpiry(now); !got.Equal(tc.want) {
			t.Errorf("%s: nextExpiry %v, want %v", tc.name, got, tc.want)
		}
	}
}
