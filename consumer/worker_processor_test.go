package consumer

import (
	"bytes"
	"context"
	"fmt"
	"maps"
	"runtime"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"
	"go.uber.org/zap/zaptest/observer"

	"github.com/outbox-relay/outbox-relay/contract"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// The tests here hold worker.run to what it promises since each worker
// has one processor goroutine for its life: the handler runs on it (not
// on a goroutine per message, whose stack grew again through pgx every
// time), a handler's panic does not end it, and a Run cancelled while a
// handler hangs, alone or in a batch, in a plain durable or a group member
// handing its partitions off, waits for the handler and then leaves no
// goroutine behind and no message unsettled.

// runLabel is the goroutine-profile label of a labelled Run: every
// goroutine Run starts inherits it (runtime/pprof), so the profile tells
// which of them are left, whatever else runs in the test binary.
const runLabel = "consumer_run"

// runLabelled runs c until ctx ends on a goroutine labelled label; Run's
// result comes on the channel.
func runLabelled(ctx context.Context, c *Consumer, label string) <-chan error {
	done := make(chan error, 1)
	go pprof.Do(ctx, pprof.Labels(runLabel, label), func(ctx context.Context) { done <- c.Run(ctx) })
	return done
}

// labelled counts the live goroutines labelled label and returns their
// stacks.
func labelled(label string) (int, string) {
	var b bytes.Buffer
	_ = pprof.Lookup("goroutine").WriteTo(&b, 1)
	want := fmt.Sprintf("# labels: {%q:%q}", runLabel, label)
	n, stacks := 0, ""
	for _, rec := range strings.Split(b.String(), "\n\n") {
		if !strings.Contains(rec, want) {
			continue
		}
		for _, line := range strings.Split(rec, "\n") {
			if k, _, ok := strings.Cut(line, " @ "); ok {
				c, _ := strconv.Atoi(k)
				n += c
				break
			}
		}
		stacks += rec + "\n\n"
	}
	return n, stacks
}

// checkNoneLeft checks that no goroutine labelled label outlives its Run.
// A goroutine that has returned is gone moments later: a short deadline.
func checkNoneLeft(t *testing.T, label string) {
	t.Helper()
	var stacks string
	if !testenv.WaitFor(5*time.Second, func() bool {
		var n int
		n, stacks = labelled(label)
		return n == 0
	}) {
		t.Errorf("goroutines started by Run (%s) still running after it returned:\n%s", label, stacks)
	}
}

// goroutineID is the calling goroutine's id, from its stack's header line.
func goroutineID() uint64 {
	var buf [64]byte
	n := runtime.Stack(buf[:], false)
	id, _ := strconv.ParseUint(strings.Fields(string(buf[:n]))[1], 10, 64)
	return id
}

// events are versions 1 to versions of aggregates agg0 to agg<aggs-1>, a
// version of each at a time, with ids uuidN(first), uuidN(first+1), ….
func events(first, aggs, versions int) []event {
	evs := make([]event, 0, aggs*versions)
	for i := range aggs * versions {
		evs = append(evs, event{ID: uuidN(first + i), AggID: fmt.Sprintf("agg%d", i%aggs), Version: int64(i/aggs + 1)})
	}
	return evs
}

// waitAppliedBy waits until the consumer name has applied n events
// (waitApplied for any consumer, not the group grp only).
func (f *fixture) waitAppliedBy(name string, n int) {
	f.t.Helper()
	f.waitFor(fmt.Sprintf("%d events applied", n), 60*time.Second, func() bool {
		return queryInt(f.t, f.pool, `SELECT count(*) FROM applied WHERE consumer = $1`, name) >= int64(n)
	})
}

// gidHandler records each application and the goroutines the handler ran
// on; its first call of the event panics panics.
type gidHandler struct {
	*recorder
	panics   string
	panicked atomic.Int32 // by Handle
	mu       sync.Mutex
	gids     map[uint64]int
}

func (h *gidHandler) note() {
	h.mu.Lock()
	h.gids[goroutineID()]++
	h.mu.Unlock()
}

func (h *gidHandler) Handle(ctx context.Context, tx pgx.Tx, m *Message) error {
	h.note()
	if err := h.recorder.Handle(ctx, tx, m); err != nil {
		return err
	}
	if m.ID == h.panics && h.callCount(m.ID) == 1 {
		h.panicked.Add(1)
		panic("handler bug")
	}
	return nil
}

func (h *gidHandler) goroutines() map[uint64]int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return maps.Clone(h.gids)
}

// gidBatchHandler is gidHandler with a HandleBatch that panics the first
// time: the batch is then applied one message at a time with Handle.
type gidBatchHandler struct {
	*gidHandler
	batches atomic.Int32
}

func (h *gidBatchHandler) HandleBatch(ctx context.Context, tx pgx.Tx, ms []*Message) error {
	h.note()
	if h.batches.Add(1) == 1 {
		panic("batch handler bug")
	}
	for _, m := range ms {
		if err := insertApplied(ctx, tx, h.name, m); err != nil {
			return err
		}
	}
	return nil
}

// One worker runs every handler call on one goroutine, its processor,
// through a handler's panic (recovered in the step) and a batch handler's
// (the batch falls back to one message at a time): a panic that escaped the
// processor would crash the process, and one swallowed without a result
// would leave the worker waiting for good.
func TestWorkerProcessorOutlivesMessagesAndPanics(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		batch int
		bh    bool
	}{{"per message", 1, false}, {"batch", 8, false}, {"batch handler", 8, true}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			f := newFixture(t)
			name := "proc" + strconv.Itoa(tc.batch)
			if tc.bh {
				name += "bh"
			}
			gh := &gidHandler{recorder: newRecorder(name), panics: uuidN(607), gids: map[uint64]int{}}
			var h Handler = gh
			if tc.bh {
				h = &gidBatchHandler{gidHandler: gh}
			}
			cfg := f.baseConfig(name)
			cfg.Workers = 1
			cfg.BatchSize = tc.batch
			const aggs, versions = 5, 6
			f.publish(events(600, aggs, versions)...)
			f.start(cfg, h)
			f.waitAppliedBy(name, aggs*versions)
			f.waitSettled(name, 10*time.Second)
			f.checkApplied(name, aggs, versions)
			if tc.bh {
				// Handle sees the event only if it is in a batch that falls
				// back (the one whose HandleBatch panicked) or is taken alone.
				if n := h.(*gidBatchHandler).batches.Load(); n < 2 {
					t.Errorf("HandleBatch called %d times, want calls after its panic", n)
				}
			} else if n := gh.panicked.Load(); n != 1 {
				t.Errorf("Handle panicked %d times, want 1", n)
			}
			if g := gh.goroutines(); len(g) != 1 {
				t.Errorf("one worker's handler calls ran on %d goroutines (calls by goroutine: %v), want its one processor", len(g), g)
			}
		})
	}
}

// hangingHandler records each application; the first call of the event
// hang blocks until release is closed, whatever its context says, and
// then returns nil, as a handler that ignores its context does.
type hangingHandler struct {
	*recorder
	hang     string
	entered  chan string // the run label of the call that hangs
	release  chan struct{}
	once     sync.Once
	returned atomic.Bool
	mu       sync.Mutex
	byTx     map[pgx.Tx][]string // the events handled in each transaction
	hangTx   pgx.Tx
}

func newHangingHandler(name, hang string) *hangingHandler {
	return &hangingHandler{recorder: newRecorder(name), hang: hang, entered: make(chan string, 1), release: make(chan struct{}),
		byTx: map[pgx.Tx][]string{}}
}

func (h *hangingHandler) Handle(ctx context.Context, tx pgx.Tx, m *Message) error {
	if err := h.recorder.Handle(ctx, tx, m); err != nil {
		return err
	}
	h.mu.Lock()
	h.byTx[tx] = append(h.byTx[tx], m.ID)
	h.mu.Unlock()
	if m.ID == h.hang && h.callCount(m.ID) == 1 {
		h.mu.Lock()
		h.hangTx = tx
		h.mu.Unlock()
		label, _ := pprof.Label(ctx, runLabel)
		h.entered <- label
		<-h.release
		h.returned.Store(true)
	}
	return nil
}

// inFlight is the events handled in the hanging call's transaction: the
// message or batch in flight while it hung.
func (h *hangingHandler) inFlight() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return slices.Clone(h.byTx[h.hangTx])
}

// waitEntered waits for the hanging call and returns its run label.
func (h *hangingHandler) waitEntered(t *testing.T) string {
	t.Helper()
	select {
	case label := <-h.entered:
		return label
	case <-time.After(30 * time.Second):
		t.Fatal("the hanging event was not handled within 30 s")
		return ""
	}
}

// free lets the hanging call return.
func (h *hangingHandler) free() { h.once.Do(func() { close(h.release) }) }

// releaseLater lets the hanging call return after d. The delay is the
// stimulus, not a synchronisation: a Run that did not wait for the
// handler would have returned well before it.
func (h *hangingHandler) releaseLater(d time.Duration) { time.AfterFunc(d, h.free) }

// waitRun waits for the result of a cancelled Run and checks it is a clean
// shutdown that came after the hanging handler h (if any) returned.
func waitRun(t *testing.T, done <-chan error, h *hangingHandler) {
	t.Helper()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("Run: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("Run did not return within 30 s of its cancel")
	}
	if h != nil && !h.returned.Load() {
		t.Error("Run returned while its handler was still running")
	}
}

// checkGivenBack checks that each of the events ids (a stopped run's
// message or batch in flight) that the consumer name did not record comes
// back at once, well within ackWait: the run settled it or gave it back
// (nak) although it finished after the stop. Deliveries still in the
// client's pull buffer at the stop, or held behind a failed message, come
// back only after ack_wait; they are not asked about. What comes back is
// given back again for the next run.
func (f *fixture) checkGivenBack(name string, ackWait time.Duration, ids []string) {
	f.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	want := map[string]bool{}
	for _, id := range ids {
		if queryInt(f.t, f.pool, `SELECT count(*) FROM consumed_message WHERE consumer = $1 AND event_id = $2`, name, id) == 0 {
			want[id] = true
		}
	}
	if len(want) == 0 {
		f.t.Errorf("the stopped run recorded all %d events in flight: nothing was given back, the check proves nothing", len(ids))
	}
	jc, err := f.js.Consumer(ctx, f.stream, name)
	testenv.Must(f.t, err, "look up durable")
	deadline := time.Now().Add(ackWait / 3)
	for len(want) > 0 && time.Now().Before(deadline) {
		b, err := jc.Fetch(100, jetstream.FetchMaxWait(min(time.Until(deadline), time.Second)))
		testenv.Must(f.t, err, "fetch")
		for m := range b.Messages() {
			delete(want, m.Headers().Get(contract.EventID))
			_ = m.Nak()
		}
	}
	if len(want) > 0 {
		f.t.Errorf("events in flight at the stop left unsettled, not back within %s (ack wait %s): %v",
			ackWait/3, ackWait, slices.Sorted(maps.Keys(want)))
	}
}

// A Run cancelled while its handler hangs past HandlerTimeout, with the
// message alone or in a batch, returns once the handler has, with every
// goroutine it started ended; what it held comes back, and the next run
// applies every event once.
func TestRunCancelledWhileHandlerHangs(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		batch int
	}{{"one message", 1}, {"batch", 16}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			f := newFixture(t)
			name := "hang" + strconv.Itoa(tc.batch)
			h := newHangingHandler(name, uuidN(710)) // evs[10]
			t.Cleanup(h.free)
			cfg := f.baseConfig(name)
			cfg.Workers = 2
			cfg.BatchSize = tc.batch
			cfg.HandlerTimeout = 500 * time.Millisecond
			cfg.AckWait = 10 * time.Second // what is left unsettled comes back only after it
			const aggs, versions = 8, 5
			evs := events(700, aggs, versions)
			f.publish(evs...)
			c, err := New(f.pool, f.js, cfg, h, WithLogger(zaptest.NewLogger(t)), WithRegisterer(f.reg))
			testenv.Must(t, err, "new consumer")
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			label := t.Name()
			done := runLabelled(ctx, c, label)
			h.waitEntered(t)
			cancel()
			h.releaseLater(2 * cfg.HandlerTimeout)
			waitRun(t, done, h)
			checkNoneLeft(t, label)
			// Alone, the hanging message failed (it returned after
			// HandlerTimeout); in a batch, the batch overran and went back
			// unattempted.
			f.checkGivenBack(name, cfg.AckWait, h.inFlight())

			f.start(cfg, h)
			f.waitAppliedBy(name, aggs*versions)
			f.waitSettled(name, 15*time.Second)
			f.checkApplied(name, aggs, versions)
		})
	}
}

// A group member whose handler hangs while a member joins (it hands some
// partitions off, draining them) and which is then stopped: its Run
// returns once the handler has, leaving no goroutine, and the others apply
// every event once and in order.
func TestGroupMemberStoppedDuringHandOffWithHandlerInFlight(t *testing.T) {
	f := newFixture(t)
	f.partitionedStream(4)
	cfg := groupConfig(f, 4)
	cfg.Workers = 2
	cfg.BatchSize = 8
	const aggs, versions = 12, 6
	h := newHangingHandler("grp", uuidN(800+aggs*2+3)) // version 3 of agg3
	members := map[string]context.CancelFunc{}
	runs := map[string]<-chan error{}
	regs := map[string]*prometheus.Registry{}
	start := func(member string) {
		g := *cfg.Group
		g.Member = member
		mcfg := cfg
		mcfg.Group = &g
		regs[member] = prometheus.NewRegistry()
		c, err := New(f.pool, f.js, mcfg, h, WithLogger(zaptest.NewLogger(t).Named(member)), WithRegisterer(regs[member]))
		testenv.Must(t, err, "new member")
		ctx, cancel := context.WithCancel(context.Background())
		members[member], runs[member] = cancel, runLabelled(ctx, c, "member-"+member)
	}
	t.Cleanup(func() {
		for m, cancel := range members {
			cancel()
			if err := <-runs[m]; err != nil {
				t.Errorf("member %s: Run: %v", m, err)
			}
		}
	})
	t.Cleanup(h.free) // before the members are stopped: a failed test leaves no handler hanging
	start("a")
	start("b")
	f.waitMembers("grp", 2)
	f.publish(events(800, aggs, versions)...)
	in := h.waitEntered(t)
	member := strings.TrimPrefix(in, "member-")
	if members[member] == nil {
		t.Fatalf("the hanging call ran under label %q, no member's", in)
	}
	start("c") // a rebalance: the hanging member gives partitions up
	f.waitMembers("grp", 3)
	members[member]()
	h.releaseLater(2 * cfg.HandlerTimeout)
	done := runs[member]
	delete(members, member)
	waitRun(t, done, h)
	checkNoneLeft(t, in)

	f.waitAppliedBy("grp", aggs*versions)
	f.waitGroupSettled("grp", 4, 30*time.Second)
	f.checkApplied("grp", aggs, versions)
	// Stopped before its first assignment, a member's Run is an error
	// (TestGroupRunCancelledBeforeAssignment); on a loaded machine the
	// others can apply everything before c is given a partition.
	f.waitOwns(regs["c"], func(n float64) bool { return n > 0 })
}

// A Run cancelled while a message's dedup insert waits for a zombie (a
// transaction of the consumer's role left open on the row) and then while
// its processor hunts the zombie: Run returns once the hunt has ended (the
// zombie is too young to end: the attempt is in doubt), leaving no
// goroutine, the probe's included; the message comes back, and once the
// zombie is gone the next run applies every event once.
func TestRunCancelledDuringZombieHunt(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	const name = "huntstop"
	cfg := f.baseConfig(name)
	cfg.Workers, cfg.BatchSize = 2, 1
	cfg.HandlerTimeout = time.Second
	cfg.AckWait = 10 * time.Second // the zombie stays younger than it: found, not ended
	const aggs, versions = 4, 3
	evs := events(900, aggs, versions)
	ctx := context.Background()
	z, err := openZombie(ctx, f.db.URL, name, evs[5].ID)
	testenv.Must(t, err, "open zombie")
	t.Cleanup(func() { z.Close(context.Background()) })
	f.publish(evs...)
	c, err := New(f.pool, f.js, cfg, newRecorder(name), WithLogger(zaptest.NewLogger(t)), WithRegisterer(f.reg))
	testenv.Must(t, err, "new consumer")
	rctx, cancel := context.WithCancel(ctx)
	defer cancel()
	label := t.Name()
	done := runLabelled(rctx, c, label)
	// The attempt's insert waits for the zombie in one transaction; after
	// its deadline the hunt's probe waits in another, begun later.
	waiter := func() (time.Time, bool) {
		var start time.Time
		err := f.pool.QueryRow(ctx, `SELECT max(xact_start) FROM pg_stat_activity
			WHERE wait_event_type = 'Lock' AND query LIKE '%INSERT INTO consumed_message%' AND pid <> $1`, z.PgConn().PID()).Scan(&start)
		return start, err == nil && !start.IsZero()
	}
	var first time.Time
	f.waitFor("the dedup insert waiting for the zombie", 30*time.Second, func() bool {
		var ok bool
		first, ok = waiter()
		return ok
	})
	f.waitFor("the zombie hunt's probe waiting", 30*time.Second, func() bool {
		s, ok := waiter()
		return ok && s.After(first)
	})
	cancel()
	waitRun(t, done, nil)
	checkNoneLeft(t, label)
	f.checkGivenBack(name, cfg.AckWait, []string{evs[5].ID}) // in doubt

	testenv.Must(t, z.Close(ctx), "end the zombie")
	f.start(cfg, newRecorder(name))
	f.waitAppliedBy(name, aggs*versions)
	f.waitSettled(name, 20*time.Second)
	f.checkApplied(name, aggs, versions)
}

// A retried message whose redelivery is being processed when its block's
// deadline passes is back, not late: the heartbeat extends the block
// without asking the source whether the message is gone, and says
// nothing. It used to look only in the queue: it asked, then warned
// "retried message not redelivered yet" (or, the message's transaction
// just committed, released its aggregate as "settled elsewhere").
func TestHeartbeatCountsTheRetriedMessageInFlight(t *testing.T) {
	core, logs := observer.New(zap.WarnLevel)
	c := &Consumer{cfg: Config{AckWait: 30 * time.Second, BatchSize: 1}, log: zap.New(core)}
	src := &askedSource{}
	w := newWorker(c, src, 0)
	head := &item{msg: progressMsg{}, key: "order/a"}
	head.m.StreamSeq = 5
	b := &block{head: 5, until: time.Now().Add(-time.Second)}
	w.blocked[head.key] = b
	w.inflight = []*item{head}

	w.heartbeat(t.Context())
	if src.asked > 0 || logs.Len() > 0 {
		t.Fatalf("the source was asked %d times and %d warnings were logged (%v): want neither while the head is processed",
			src.asked, logs.Len(), logs.All())
	}
	if !b.until.After(time.Now()) || w.blocked[head.key] != b {
		t.Fatalf("block until %v, still blocked %v: want it extended and kept", b.until, w.blocked[head.key] == b)
	}
}

// A retried message cannot come back (its feed waits for the workers
// before a reset), so its block goes overdue, and the heartbeat asks
// whether it is gone, of a server that does not answer for now. Meanwhile
// the worker settles its other messages. The look-up ran on the worker's
// goroutine: every heartbeat held the worker's messages up until its
// deadlines passed, seconds each under CPU load, and the feed waited for
// workers that settled a message every few seconds
// (TestBatchFailuresEndAsInPerMessageMode: the durable's ack floor below
// the retried message after 90 s). Here the server does not answer until
// the test ends.
func TestSlowLookUpDoesNotHoldUpTheWorker(t *testing.T) {
	met, err := newMetrics(prometheus.NewRegistry(), "slowlookup", "team-rewards")
	testenv.Must(t, err, "metrics")
	c := &Consumer{
		cfg:    Config{Name: "slowlookup", AckWait: 300 * time.Millisecond, HandlerTimeout: 100 * time.Millisecond, BatchSize: 1},
		log:    zaptest.NewLogger(t),
		met:    met,
		wanted: map[string]bool{"Wanted": true}, // the messages below are skipped: acknowledged without a transaction
	}
	src := &silentSource{asked: make(chan struct{}, 1)}
	w := newWorker(c, src, 0)
	w.blocked["h"] = &block{head: 1, until: time.Now().Add(-time.Second)} // overdue; no dedup row to look for
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- w.run(ctx) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("worker: %v", err)
		}
	}()
	select {
	case <-src.asked:
	case <-time.After(10 * time.Second):
		t.Fatalf("the heartbeat did not ask whether the overdue retried message is gone")
	}
	acked := make(chan uint64, 3)
	for seq := uint64(2); seq <= 4; seq++ {
		it := &item{msg: ackedMsg{acked: acked, seq: seq}, key: fmt.Sprintf("k%d", seq)}
		it.m.StreamSeq, it.m.Type = seq, "Other"
		w.in <- it
	}
	for range 3 {
		select {
		case <-acked:
		case <-time.After(10 * time.Second):
			t.Fatalf("the worker's messages were not settled while the heartbeat's look-up waited for the server")
		}
	}
}

// silentSource is a source whose server does not answer: gone waits until
// its ctx ends, and reports each question on asked.
type silentSource struct {
	source
	asked chan struct{}
}

func (s *silentSource) gone(ctx context.Context, _ []uint64) map[uint64]bool {
	select {
	case s.asked <- struct{}{}:
	default:
	}
	<-ctx.Done()
	return nil
}

// ackedMsg reports its acknowledgement.
type ackedMsg struct {
	progressMsg
	acked chan<- uint64
	seq   uint64
}

func (m ackedMsg) Ack() error {
	m.acked <- m.seq
	return nil
}

// Nak: a worker stopped before settling it gives it back.
func (ackedMsg) Nak() error { return nil }

// askedSource counts the heartbeat's questions; it knows nothing gone.
type askedSource struct {
	source
	asked int
}

func (s *askedSource) gone(context.Context, []uint64) map[uint64]bool {
	s.asked++
	return nil
}

// progressMsg is a delivery whose progress acks go nowhere.
type progressMsg struct{ jetstream.Msg }

func (progressMsg) InProgress() error { return nil }
