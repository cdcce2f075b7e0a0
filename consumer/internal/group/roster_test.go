package group

import (
	"context"
	"errors"
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

// heard is a bucket entry as the roster's watch delivers it.
type heard struct {
	jetstream.KeyValueEntry
	key string
	rev uint64
}

func (h heard) Key() string                     { return h.key }
func (h heard) Value() []byte                   { return []byte("4") }
func (h heard) Revision() uint64                { return h.rev }
func (h heard) Operation() jetstream.KeyValueOp { return jetstream.KeyValuePut }

// TestRosterOwnHeard: when a member's heartbeats say its watch must start
// anew. A put's revision that goes back means a bucket created again by
// someone else, at once; a watch that has delivered none of the member's
// heartbeats for a member TTL and nothing at all for the last TTL, then
// (a NATS restart lost its consumer); a watch that delivers entries but
// none of the member's own, only after staleWatchTTLs member TTLs: on a starved
// machine a watch that works lags a TTL behind the puts, and was started
// anew for it before.
func TestRosterOwnHeard(t *testing.T) {
	const ttl = time.Second
	stale := staleWatchTTLs * ttl
	type beat struct {
		rev, opens, reconnects uint64
		at                     time.Duration // since the first beat
		// Before the next beat the watch delivers this heartbeat (own),
		// or an entry stored earlier (older).
		own, older bool
		want       error // of ownHeard
	}
	cases := []struct {
		name  string
		beats []beat
	}{
		{"watch delivers every beat", []beat{
			{rev: 10, opens: 1, own: true}, {rev: 12, opens: 1, at: ttl / 3, own: true},
			{rev: 15, opens: 1, at: 20 * ttl, own: true}, {rev: 16, opens: 1, at: 21 * ttl},
		}},
		{"watch more than a TTL behind, delivering older entries", []beat{
			{rev: 10, opens: 1, older: true}, {rev: 11, opens: 1, at: ttl / 2, older: true},
			{rev: 12, opens: 1, at: ttl, older: true}, {rev: 13, opens: 1, at: 3 * ttl / 2, older: true},
			{rev: 14, opens: 1, at: 2 * ttl, older: true}, {rev: 15, opens: 1, at: 5 * ttl / 2, older: true},
			{rev: 16, opens: 1, at: stale, own: true}, {rev: 17, opens: 1, at: stale + ttl},
		}},
		{"watch delivers nothing for a TTL", []beat{
			{rev: 10, opens: 1}, {rev: 11, opens: 1, at: ttl / 2}, {rev: 12, opens: 1, at: ttl + ttl/2, want: errWatchStale},
			{rev: 13, opens: 1, at: 2 * ttl, own: true}, {rev: 14, opens: 1, at: 3 * ttl},
		}},
		{"watch delivers a few entries, then nothing for a TTL", []beat{
			{rev: 10, opens: 1}, {rev: 11, opens: 1, at: ttl / 3, older: true}, {rev: 12, opens: 1, at: 2 * ttl / 3},
			{rev: 13, opens: 1, at: ttl}, {rev: 14, opens: 1, at: 3 * ttl / 2, want: errWatchStale},
		}},
		{"watch delivers older entries, none of the member's, past staleAfter", []beat{
			{rev: 10, opens: 1, older: true}, {rev: 11, opens: 1, at: ttl / 2, older: true},
			{rev: 12, opens: 1, at: ttl, older: true}, {rev: 13, opens: 1, at: 3 * ttl / 2, older: true},
			{rev: 14, opens: 1, at: 2 * ttl, older: true}, {rev: 15, opens: 1, at: 5 * ttl / 2, older: true},
			{rev: 16, opens: 1, at: stale, older: true}, {rev: 17, opens: 1, at: stale + ttl/2, want: errWatchStale},
			{rev: 18, opens: 1, at: stale + ttl, own: true}, {rev: 19, opens: 1, at: stale + 2*ttl},
		}},
		{"bucket created again by someone else", []beat{
			{rev: 2004, opens: 1, own: true}, {rev: 2007, opens: 1, at: ttl / 3, own: true},
			{rev: 2, opens: 1, at: 2 * ttl / 3, want: errBucketCreatedAgain},
			{rev: 5, opens: 1, at: ttl, own: true}, {rev: 8, opens: 1, at: 4 * ttl / 3},
		}},
		{"the same revision again", []beat{
			{rev: 3, opens: 1, own: true}, {rev: 3, opens: 1, at: ttl / 3, want: errBucketCreatedAgain},
		}},
		{"reconnected, and the watch delivers after", []beat{
			{rev: 10, opens: 1, own: true}, {rev: 11, opens: 1, reconnects: 1, at: ttl / 3, own: true},
			{rev: 12, opens: 1, reconnects: 1, at: 2 * ttl / 3, own: true}, {rev: 13, opens: 1, reconnects: 1, at: ttl},
		}},
		{"reconnected, and the watch delivers nothing after", []beat{
			{rev: 10, opens: 1, own: true}, {rev: 11, opens: 1, reconnects: 1, at: ttl / 3},
			{rev: 12, opens: 1, reconnects: 1, at: 2 * ttl / 3, want: errReconnected},
			{rev: 13, opens: 1, reconnects: 1, at: ttl, own: true}, {rev: 14, opens: 1, reconnects: 1, at: 4 * ttl / 3},
		}},
		{"a link that reconnects at every beat, the watch delivering", []beat{
			{rev: 10, opens: 1, own: true}, {rev: 11, opens: 1, reconnects: 1, at: ttl / 3, own: true},
			{rev: 12, opens: 1, reconnects: 2, at: 2 * ttl / 3, own: true}, {rev: 13, opens: 1, reconnects: 3, at: ttl, own: true},
			{rev: 14, opens: 1, reconnects: 4, at: 4 * ttl / 3, own: true}, {rev: 15, opens: 1, reconnects: 4, at: 5 * ttl / 3},
		}},
		{"a link that reconnects at every beat, the watch silent", []beat{
			{rev: 10, opens: 1, own: true}, {rev: 11, opens: 1, reconnects: 1, at: ttl / 3},
			{rev: 12, opens: 1, reconnects: 2, at: 2 * ttl / 3}, {rev: 13, opens: 1, reconnects: 3, at: ttl},
			{rev: 14, opens: 1, reconnects: 4, at: 4 * ttl / 3}, {rev: 15, opens: 1, reconnects: 5, at: 3 * ttl / 2, want: errWatchStale},
		}},
		{"bucket opened again by this member", []beat{
			{rev: 2004, opens: 1, own: true}, {rev: 1, opens: 2, at: ttl / 3},
			{rev: 3, opens: 2, at: 2 * ttl / 3, own: true}, {rev: 6, opens: 2, at: ttl},
		}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			r := newRoster("m")
			t0 := time.Now()
			for i, b := range c.beats {
				at := t0.Add(b.at)
				got := r.ownHeard(beatStored{rev: b.rev, opens: b.opens, reconnects: b.reconnects, sent: at.Add(-time.Millisecond), at: at}, ttl)
				if !errors.Is(got, b.want) || (b.want == nil) != (got == nil) {
					t.Fatalf("beat %d (revision %d at %s): ownHeard = %v, want %v", i, b.rev, b.at, got, b.want)
				}
				switch {
				case b.own:
					r.update(heard{key: "m", rev: b.rev}, ttl, at.Add(time.Millisecond))
				case b.older:
					r.update(heard{key: "other", rev: b.rev - 1}, ttl, at.Add(time.Millisecond))
				}
			}
		})
	}
}

// TestRosterReplayDoesNotRenew: a watch started anew replays the bucket's
// entries; a dead member's last heartbeat, still in the bucket until its
// TTL, must not make it live for another TTL at every restart (a flapping
// link restarted the watch at every reconnect, and kept a dead member's
// partitions unowned twice as long). A new revision renews it.
func TestRosterReplayDoesNotRenew(t *testing.T) {
	const ttl = time.Second
	r := newRoster("m")
	t0 := time.Now()
	r.update(heard{key: "dead", rev: 5}, ttl, t0)
	r.update(heard{key: "live", rev: 6}, ttl, t0)
	r.update(heard{key: "dead", rev: 5}, ttl, t0.Add(9*ttl/10)) // a replay
	r.update(heard{key: "live", rev: 9}, ttl, t0.Add(9*ttl/10)) // a heartbeat
	live := func(at time.Duration) []string {
		var ids []string
		for _, m := range r.live(t0.Add(at)) {
			ids = append(ids, m.id)
		}
		return ids
	}
	if got := live(ttl / 2); len(got) != 2 {
		t.Fatalf("live at half a TTL: %v, want both", got)
	}
	if got := live(11 * ttl / 10); len(got) != 1 || got[0] != "live" {
		t.Fatalf("live a TTL after the dead member's last heartbeat, replayed since: %v, want [live]", got)
	}
	r.update(heard{key: "dead", rev: 5}, ttl, t0.Add(12*ttl/10)) // replayed again, just after it expired
	if got := live(13 * ttl / 10); len(got) != 1 || got[0] != "live" {
		t.Fatalf("after a replay of an expired entry: %v, want [live]", got)
	}
	r.update(heard{key: "dead", rev: 20}, ttl, t0.Add(14*ttl/10)) // back, with a new heartbeat
	if got := live(15 * ttl / 10); len(got) != 2 {
		t.Fatalf("after a new heartbeat: %v, want both", got)
	}
}
