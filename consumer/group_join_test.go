package consumer

// A group member's join: beside members on other counts, across late
// answers, a refused or lost bucket. Written first as attacks on the join
// after a partition-count change (a helper's reproductions), kept as its
// tests.

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest"
	"go.uber.org/zap/zaptest/observer"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// faultJS is the fixture's JetStream with injected failures: watch, when
// set, replaces the member bucket's WatchAll; info the stream's Info; put
// the bucket's Put. Set them before the member starts.
type faultJS struct {
	jetstream.JetStream
	watch func(kv jetstream.KeyValue, ctx context.Context, opts ...jetstream.WatchOpt) (jetstream.KeyWatcher, error)
	info  func(s jetstream.Stream, ctx context.Context, opts ...jetstream.StreamInfoOpt) (*jetstream.StreamInfo, error)
	put   func(kv jetstream.KeyValue, ctx context.Context, key string, value []byte) (uint64, error)
	// opened counts the bucket's openings (CreateKeyValue).
	opened atomic.Int32
}

type faultKV struct {
	jetstream.KeyValue
	js *faultJS
}

func (k *faultKV) WatchAll(ctx context.Context, opts ...jetstream.WatchOpt) (jetstream.KeyWatcher, error) {
	if k.js.watch != nil {
		return k.js.watch(k.KeyValue, ctx, opts...)
	}
	return k.KeyValue.WatchAll(ctx, opts...)
}

func (k *faultKV) Put(ctx context.Context, key string, value []byte) (uint64, error) {
	if k.js.put != nil {
		return k.js.put(k.KeyValue, ctx, key, value)
	}
	return k.KeyValue.Put(ctx, key, value)
}

type faultStream struct {
	jetstream.Stream
	js *faultJS
}

func (s *faultStream) Info(ctx context.Context, opts ...jetstream.StreamInfoOpt) (*jetstream.StreamInfo, error) {
	if s.js.info != nil {
		return s.js.info(s.Stream, ctx, opts...)
	}
	return s.Stream.Info(ctx, opts...)
}

func (j *faultJS) Stream(ctx context.Context, name string) (jetstream.Stream, error) {
	s, err := j.JetStream.Stream(ctx, name)
	if err != nil {
		return s, err
	}
	return &faultStream{Stream: s, js: j}, nil
}

func (j *faultJS) CreateKeyValue(ctx context.Context, cfg jetstream.KeyValueConfig) (jetstream.KeyValue, error) {
	j.opened.Add(1)
	kv, err := j.JetStream.CreateKeyValue(ctx, cfg)
	if err != nil {
		return kv, err
	}
	return &faultKV{KeyValue: kv, js: j}, nil
}

func (j *faultJS) KeyValue(ctx context.Context, bucket string) (jetstream.KeyValue, error) {
	kv, err := j.JetStream.KeyValue(ctx, bucket)
	if err != nil {
		return kv, err
	}
	return &faultKV{KeyValue: kv, js: j}, nil
}

// observedLogger is a test logger whose entries (all levels) can also be read.
func observedLogger(t *testing.T, name string) (*zap.Logger, *observer.ObservedLogs) {
	core, logs := observer.New(zapcore.DebugLevel)
	base := zaptest.NewLogger(t).Named(name)
	return zap.New(zapcore.NewTee(base.Core(), core)).Named(name), logs
}

// runJoiner runs member (partitions) of cfg's group on js until the
// returned cancel, with opts after its own; done receives Run's error.
func (f *fixture) runJoiner(js jetstream.JetStream, cfg Config, member string, partitions int, log *zap.Logger, opts ...Option) (done chan error, cancel context.CancelFunc) {
	f.t.Helper()
	opts = append([]Option{WithLogger(log), WithRegisterer(prometheus.NewRegistry())}, opts...)
	c, err := New(f.pool, js, memberConfig(cfg, member, partitions), newRecorder("grp"), opts...)
	testenv.Must(f.t, err, "new member")
	ctx, cancel := context.WithCancel(context.Background())
	done = make(chan error, 1)
	returned := make(chan struct{})
	go func() { done <- c.Run(ctx); close(returned) }()
	f.t.Cleanup(func() {
		cancel()
		select {
		case <-returned:
		case <-time.After(30 * time.Second):
			f.t.Errorf("member %s: Run did not return 30 s after its ctx ended", member)
		}
	})
	return done, cancel
}

// whileRunning waits up to d for cond while no member's Run (dones)
// returns. exited is the error of a Run that returned, if one did.
func whileRunning(d time.Duration, cond func() bool, dones ...<-chan error) (ok bool, exited error) {
	ok = testenv.WaitFor(d, func() bool {
		for _, done := range dones {
			select {
			case err := <-done:
				exited = fmt.Errorf("Run returned: %w", err)
				return true
			default:
			}
		}
		return cond()
	})
	return ok && exited == nil, exited
}

// beatAs heartbeats member with value in the group bucket (created with
// TTL if missing) every 300 ms until the test ends or stop; value may be
// changed while it runs.
func (f *fixture) beatAs(ttl time.Duration, member string, value *atomic.Value) (stop func()) {
	f.t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	cctx, ccancel := context.WithTimeout(ctx, 10*time.Second)
	defer ccancel()
	kv, err := f.js.CreateKeyValue(cctx, jetstream.KeyValueConfig{Bucket: GroupBucket("grp"), TTL: ttl, History: 1, Storage: jetstream.FileStorage})
	if errors.Is(err, jetstream.ErrBucketExists) {
		kv, err = f.js.KeyValue(cctx, GroupBucket("grp"))
	}
	testenv.Must(f.t, err, "group bucket")
	var wg sync.WaitGroup
	wg.Go(func() {
		for ctx.Err() == nil {
			_, _ = kv.Put(ctx, member, []byte(value.Load().(string)))
			select {
			case <-ctx.Done():
			case <-time.After(300 * time.Millisecond):
			}
		}
	})
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			wg.Wait()
			dctx, dcancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer dcancel()
			_ = kv.Delete(dctx, member)
		})
	}
	f.t.Cleanup(stop)
	return stop
}

func beatValue(s string) *atomic.Value {
	var v atomic.Value
	v.Store(s)
	return &v
}

// TestGroupJoinWaitsOutLateAnswers: a member whose join meets only late
// answers (the roster's watch times out; beside a member of another count,
// the stream info that tells the group's counts times out) keeps waiting
// rather than exit on its own, says so once, and returns
// ErrSetUpCancelled wrapping context.Canceled when its ctx is cancelled.
// On a starved machine such answers come, late.
func TestGroupJoinWaitsOutLateAnswers(t *testing.T) {
	for _, mode := range []string{"watch times out", "stream info times out"} {
		t.Run(mode, func(t *testing.T) {
			f := newFixture(t)
			f.partitionedStream(4)
			cfg := groupConfig(f, 4)
			ttl := cfg.Group.MemberTTL
			js := &faultJS{JetStream: f.js}
			switch mode {
			case "watch times out":
				js.watch = func(jetstream.KeyValue, context.Context, ...jetstream.WatchOpt) (jetstream.KeyWatcher, error) {
					return nil, fmt.Errorf("watch: %w", nats.ErrTimeout)
				}
			case "stream info times out":
				// A member of another count makes agree read the counts.
				f.beatAs(ttl, "other", beatValue("8"))
				f.waitMembers("grp", 1)
				var calls atomic.Int32
				js.info = func(s jetstream.Stream, ctx context.Context, opts ...jetstream.StreamInfoOpt) (*jetstream.StreamInfo, error) {
					if calls.Add(1) == 1 { // setUp's
						return s.Info(ctx, opts...)
					}
					return nil, fmt.Errorf("stream info: %w", nats.ErrTimeout)
				}
			}
			log, logs := observedLogger(t, "m")
			done, cancel := f.runJoiner(js, cfg, "m", 4, log)
			f.waitFor("join's warning", 30*time.Second, func() bool {
				return logs.FilterMessageSnippet("join the group failed").Len() > 0
			})
			select {
			case err := <-done:
				t.Fatalf("Run returned on its own while join waited for late answers: %v", err)
			case <-time.After(3 * ttl):
			}
			if warns := logs.FilterMessageSnippet("join the group failed").FilterLevelExact(zapcore.WarnLevel).Len(); warns != 1 {
				t.Errorf("join logged %d warnings, want 1 (then quiet)", warns)
			}
			cancel()
			select {
			case err := <-done:
				if !errors.Is(err, errSetUpCancelled) || !errors.Is(err, context.Canceled) {
					t.Errorf("Run after cancel while joining: %v, want ErrSetUpCancelled wrapping context.Canceled", err)
				}
			case <-time.After(30 * time.Second):
				t.Fatalf("Run still running 30 s after cancel")
			}
		})
	}
}

// TestGroupJoinWatchRefused: a roster watch the server refuses (not a
// late answer: a user not allowed the bucket's API, say) ends the join
// after a member TTL with an error that names the refusal, as before the
// join waited out late answers; waiting for ever would hide it.
func TestGroupJoinWatchRefused(t *testing.T) {
	f := newFixture(t)
	f.partitionedStream(4)
	cfg := groupConfig(f, 4)
	ttl := cfg.Group.MemberTTL
	js := &faultJS{JetStream: f.js}
	js.watch = func(jetstream.KeyValue, context.Context, ...jetstream.WatchOpt) (jetstream.KeyWatcher, error) {
		return nil, errors.New("nats: permissions violation for subscription to \"$JS.API.CONSUMER.CREATE\"")
	}
	log, _ := observedLogger(t, "m")
	done, _ := f.runJoiner(js, cfg, "m", 4, log)
	select {
	case err := <-done:
		if err == nil || !strings.Contains(err.Error(), "permissions violation") || errors.Is(err, errSetUpCancelled) {
			t.Errorf("Run: %v, want the roster's failure naming the refused watch", err)
		}
	case <-time.After(10 * ttl):
		t.Fatalf("a member whose roster watch is refused still runs after %s", 10*ttl)
	}
}

// TestGroupJoinRecreatesBucketLostBeforeWatch: the member bucket is
// lost (deleted by an operator, or a NATS restart lost a memory bucket of
// an earlier version) after the member opened it and before its roster
// watch read it. A member that has joined re-creates it at its next
// heartbeat; one that has not heartbeats yet, so its watch must re-create
// it, and the member consume. Without that, a join that waits for the
// roster waited for ever: neither consuming nor exiting.
func TestGroupJoinRecreatesBucketLostBeforeWatch(t *testing.T) {
	f := newFixture(t)
	f.partitionedStream(4)
	cfg := groupConfig(f, 4)
	ttl := cfg.Group.MemberTTL
	const aggs = 5
	f.publishVersions(aggs, 1, 1)
	var lost atomic.Bool
	js := &faultJS{JetStream: f.js}
	js.watch = func(kv jetstream.KeyValue, ctx context.Context, opts ...jetstream.WatchOpt) (jetstream.KeyWatcher, error) {
		if lost.CompareAndSwap(false, true) {
			dctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			err := f.js.DeleteKeyValue(dctx, GroupBucket("grp"))
			cancel()
			if err != nil {
				t.Errorf("delete the bucket: %v", err)
			}
		}
		return kv.WatchAll(ctx, opts...)
	}
	log, logs := observedLogger(t, "m")
	done, _ := f.runJoiner(js, cfg, "m", 4, log)
	applied := func() int64 {
		return queryInt(t, f.pool, `SELECT count(*) FROM applied WHERE consumer = 'grp'`)
	}
	ok, exited := whileRunning(10*ttl, func() bool { return applied() == aggs }, done)
	switch {
	case exited != nil:
		t.Errorf("the member exited after its bucket was lost before the roster read it: %v", exited)
	case !ok:
		warn := logs.FilterMessageSnippet("failed; retrying quietly")
		var lines []string
		for _, e := range warn.All() {
			lines = append(lines, fmt.Sprintf("%s: %v", e.Message, e.ContextMap()["error"]))
		}
		t.Errorf("%s after the bucket was lost before the roster read it, the member has not consumed (%d of %d applied, bucket re-created: %v); its warnings: %s",
			10*ttl, applied(), aggs, f.bucketExists(), strings.Join(lines, "; "))
	}
}

func (f *fixture) bucketExists() bool {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	_, err := f.js.KeyValue(ctx, GroupBucket("grp"))
	return err == nil
}

// TestGroupJoinForeignMemberRefused: a live member of the same group name
// on a count that is neither the stream's nor one of the group's
// generations (another group of the same name) is still refused, after
// about one member TTL, with ErrGroupMismatch naming the fix; also beside
// a member on an older count of the group, which is accepted and logged
// once, not at every try.
func TestGroupJoinForeignMemberRefused(t *testing.T) {
	for _, withLag := range []bool{false, true} {
		t.Run(fmt.Sprintf("withLag=%v", withLag), func(t *testing.T) {
			f, cfg, rec := newUnversionedGroup(t, 4)
			ttl := cfg.Group.MemberTTL
			partitions := 4
			if withLag {
				// Generation 4 stays (no member ran since), the stream is on 8.
				f.changeWhileStopped(cfg, rec, 5, 8)
				partitions = 8
				// Sorted before foreign: agree accepts it before it meets foreign.
				f.beatAs(ttl, "a-lag", beatValue("4"))
			}
			f.beatAs(ttl, "foreign", beatValue("3"))
			if withLag {
				f.waitMembers("grp", 2)
			} else {
				f.waitMembers("grp", 1)
			}
			log, logs := observedLogger(t, "m")
			t0 := time.Now()
			done, _ := f.runJoiner(f.js, cfg, "m", partitions, log)
			select {
			case err := <-done:
				d := time.Since(t0)
				t.Logf("Run after %s: %v", d.Round(time.Millisecond), err)
				if !errors.Is(err, ErrGroupMismatch) || !strings.Contains(err.Error(), "member foreign of group grp runs with 3 partitions") ||
					!strings.Contains(err.Error(), "two groups cannot share the name grp; give one another Name") {
					t.Errorf("Run: %v, want ErrGroupMismatch naming member foreign, its count and the fix", err)
				}
				if d < ttl*9/10 {
					t.Errorf("refused after %s, want about one member TTL (%s) of waiting", d, ttl)
				}
			case <-time.After(30 * ttl):
				t.Fatalf("a member of another group (count 3) was not refused within %s", 30*ttl)
			}
			want := 0
			if withLag {
				want = 1
			}
			if n := logs.FilterMessageSnippet("a member still uses another partition count of this group").Len(); n != want {
				t.Errorf("%d Info lines on the member still on an older count, want %d", n, want)
			}
		})
	}
}

// TestGroupJoinBesideLagAfterOldGenerationRemoved: after 4 → 8, a member
// whose step has not read the change yet (on a starved machine, many
// seconds late: its heartbeat goroutine still beats 4) stays alive while
// the others drain and remove the 4-partition durables. docs/consumer.md
// says a member reporting an older count of the group is one whose next
// step has not read a count change yet, "however late that step comes":
// the new member joins beside it. With generation 4 removed, 4 is no
// longer a count of the group's durables, but the stream holds events
// stored under it: before that look, the new member refused it as another
// group's after a TTL.
func TestGroupJoinBesideLagAfterOldGenerationRemoved(t *testing.T) {
	f, cfg, rec := newUnversionedGroup(t, 4)
	ttl := cfg.Group.MemberTTL
	const aggs = 10
	f.changeWhileStopped(cfg, rec, aggs, 8) // version 2 under 8
	f.runMember(memberConfig(cfg, "a", 8), rec, "a")
	f.waitApplied(aggs * 2)
	f.waitFor("the 4-partition durables removed", 30*time.Second, func() bool {
		for p := range 4 {
			if !f.durableGone(PartitionDurable("grp", 4, p)) {
				return false
			}
		}
		return true
	})
	stopLag := f.beatAs(ttl, "lag", beatValue("4")) // its step is late: still on 4
	f.waitMembers("grp", 2)
	log, _ := observedLogger(t, "new")
	done, _ := f.runJoiner(f.js, cfg, "new", 8, log)
	select {
	case err := <-done:
		t.Errorf("the new member beside a member still on 4 (generation 4 drained and removed): Run returned %v, want it to join", err)
	case <-time.After(3 * ttl):
	}
	stopLag()
	f.publishVersions(aggs, 3, 3)
	f.waitApplied(aggs * 3)
	f.checkApplied("grp", aggs, 3)
}

// TestGroupJoinGraceAfterTransientWait: join gives a member of a count not
// the group's one member TTL to move on, counted from the first mismatch:
// when it counted from join's start, a roster watch refused for longer
// than that left no grace, and the first disagreement was refused at once.
// Here the other member moves to the group's count half a TTL after the
// roster is read.
func TestGroupJoinGraceAfterTransientWait(t *testing.T) {
	f := newFixture(t)
	f.partitionedStream(4)
	cfg := groupConfig(f, 4)
	ttl := cfg.Group.MemberTTL
	value := beatValue("2") // a member on a count of no durables: in a moment it reads 4
	f.beatAs(ttl, "other", value)
	f.waitMembers("grp", 1)
	var first atomic.Int64 // unix ns of the member's first watch
	var readyAt atomic.Int64
	var once sync.Once
	ready := make(chan struct{})
	js := &faultJS{JetStream: f.js}
	js.watch = func(kv jetstream.KeyValue, ctx context.Context, opts ...jetstream.WatchOpt) (jetstream.KeyWatcher, error) {
		first.CompareAndSwap(0, time.Now().UnixNano())
		if time.Since(time.Unix(0, first.Load())) < ttl*3/2 {
			return nil, errors.New("watch refused for a while")
		}
		w, err := kv.WatchAll(ctx, opts...)
		if err == nil {
			once.Do(func() { readyAt.Store(time.Now().UnixNano()); close(ready) })
		}
		return w, err
	}
	go func() {
		select {
		case <-ready:
		case <-time.After(time.Minute):
			return
		}
		time.Sleep(ttl / 2)
		value.Store("4")
	}()
	log, _ := observedLogger(t, "m")
	done, _ := f.runJoiner(js, cfg, "m", 4, log)
	select {
	case err := <-done:
		if at := readyAt.Load(); at != 0 {
			t.Logf("refused %s after the roster's watch was opened, %s after the first watch", time.Since(time.Unix(0, at)).Round(time.Millisecond), time.Since(time.Unix(0, first.Load())).Round(time.Millisecond))
		}
		t.Errorf("Run returned %v, want the member to give the other one a member TTL after the roster was read, see it move to 4, and join", err)
	case <-time.After(3*ttl + ttl*3/2):
	}
}

// TestGroupHeartbeatTimeoutKeepsBucket: heartbeats that time out (a
// starved server answers late) say nothing of the bucket. The member used
// to open it again at each one, which restarted its roster watch: on a
// starved server a consumer's creation added to every late heartbeat
// (seen in internal/grouptest at nice 10 beside six busy loops: "the group
// bucket was opened again"). A lost bucket is still re-created
// (TestGroupJoinRecreatesBucketLostBeforeWatch, and the heartbeat's own
// reopening on a no-stream answer).
func TestGroupHeartbeatTimeoutKeepsBucket(t *testing.T) {
	f := newFixture(t)
	f.partitionedStream(4)
	cfg := groupConfig(f, 4)
	var timeouts atomic.Int32
	js := &faultJS{JetStream: f.js}
	js.put = func(kv jetstream.KeyValue, ctx context.Context, key string, value []byte) (uint64, error) {
		if timeouts.Load() > 0 {
			timeouts.Add(-1)
			return 0, fmt.Errorf("put %s: %w", key, nats.ErrTimeout)
		}
		return kv.Put(ctx, key, value)
	}
	log, _ := observedLogger(t, "m")
	done, _ := f.runJoiner(js, cfg, "m", 4, log)
	f.waitMembers("grp", 1)
	opened := js.opened.Load()
	timeouts.Store(2) // two heartbeats in a row: within the TTL
	f.waitFor("the late heartbeats", 30*time.Second, func() bool { return timeouts.Load() == 0 })
	f.publishVersions(5, 1, 1)
	f.waitApplied(5)
	if n := js.opened.Load() - opened; n != 0 {
		t.Errorf("the bucket was opened %d more times after heartbeats timed out, want 0", n)
	}
	select {
	case err := <-done:
		t.Fatalf("Run returned: %v", err)
	default:
	}
}
