package consumer

// Join's agreement check (groupCounts.had): heartbeat values that are no
// count, and a count looked up in a stream that is empty or purged
// (FirstSeq 0, or past its last sequence). Written first as a helper's
// attack, kept as tests.

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// TestGroupJoinOddCounts: a live member of the group's name whose
// heartbeat value is no count of the group (not a number, 0, negative,
// out of int range, above MaxPartitions, or a count the stream has no
// events under, the stream empty or purged) is refused with
// ErrGroupMismatch after about one member TTL: not at once, not never,
// and not with another error (a failed events look).
func TestGroupJoinOddCounts(t *testing.T) {
	cases := []struct {
		name, value, stream string
	}{
		{"not a number", "x", "empty"},
		{"empty value", "", "empty"},
		{"zero", "0", "empty"},
		{"negative", "-3", "empty"},
		{"beyond int", "99999999999999999999", "empty"},
		{"above MaxPartitions", "1025", "empty"},
		{"no events, stream empty", "3", "empty"},
		{"no events, stream with events", "3", "events"},
		{"no events, stream purged", "3", "purged"},
		{"one partition", "1", "events"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t)
			f.partitionedStream(4)
			cfg := groupConfig(f, 4)
			ttl := cfg.Group.MemberTTL
			switch tc.stream {
			case "events":
				f.publishVersions(3, 1, 1)
			case "purged":
				f.publishVersions(3, 1, 1)
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				s, err := f.js.Stream(ctx, f.stream)
				testenv.Must(t, err, "stream")
				testenv.Must(t, s.Purge(ctx), "purge")
				info, err := s.Info(ctx)
				testenv.Must(t, err, "stream info")
				cancel()
				t.Logf("purged: first %d, last %d", info.State.FirstSeq, info.State.LastSeq)
			}
			f.beatAs(ttl, "foreign", beatValue(tc.value))
			f.waitMembers("grp", 1)
			log, _ := observedLogger(t, "m")
			t0 := time.Now()
			done, _ := f.runJoiner(f.js, cfg, "m", 4, log)
			select {
			case err := <-done:
				d := time.Since(t0)
				if !errors.Is(err, ErrGroupMismatch) || !strings.Contains(err.Error(), "member foreign of group grp") {
					t.Errorf("Run after %s: %v, want ErrGroupMismatch naming member foreign", d, err)
				}
				if d < ttl*9/10 {
					t.Errorf("refused after %s, want about one member TTL (%s)", d, ttl)
				}
			case <-time.After(15 * ttl):
				t.Fatalf("a member with heartbeat value %q was not refused within %s", tc.value, 15*ttl)
			}
		})
	}
}

// TestGroupJoinWaitsOutUnavailableJetStream: a roster watch refused with
// an error nats.go itself treats as passing when it re-creates an ordered
// consumer (JetStream not enabled: no responders while a server restarts;
// "JetStream system temporarily unavailable" during a meta-leader
// election) for four member TTLs. Join counted it as a refusal and the
// member exited after about two TTLs, although the server answered again
// a moment later; it waits now (unavailable).
func TestGroupJoinWaitsOutUnavailableJetStream(t *testing.T) {
	f := newFixture(t)
	f.partitionedStream(4)
	cfg := groupConfig(f, 4)
	ttl := cfg.Group.MemberTTL
	var first atomic.Int64
	js := &faultJS{JetStream: f.js}
	js.watch = func(kv jetstream.KeyValue, ctx context.Context, opts ...jetstream.WatchOpt) (jetstream.KeyWatcher, error) {
		first.CompareAndSwap(0, time.Now().UnixNano())
		if time.Since(time.Unix(0, first.Load())) < 4*ttl {
			return nil, nats.ErrJetStreamNotEnabled
		}
		return kv.WatchAll(ctx, opts...)
	}
	f.publishVersions(4, 1, 1)
	log, _ := observedLogger(t, "m")
	done, _ := f.runJoiner(js, cfg, "m", 4, log)
	ok, exited := whileRunning(10*ttl, func() bool { return f.appliedCount() == 4 }, done)
	switch {
	case exited != nil:
		t.Errorf("the member exited while JetStream was unavailable for %s: %v", 4*ttl, exited)
	case !ok:
		t.Errorf("not consumed within %s", 10*ttl)
	}
}
