package consumer

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// slowSetHandler takes per for each message it applies, alone or in a
// batch, and gives up at its deadline; it records the size of each batch
// it was given and whether the batch ran out of time.
type slowSetHandler struct {
	*recorder
	per     time.Duration
	mu      sync.Mutex
	batches []int // sizes, negative for a batch that overran
}

func (h *slowSetHandler) wait(ctx context.Context, n int) error {
	t := time.NewTimer(time.Duration(n) * h.per)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

func (h *slowSetHandler) Handle(ctx context.Context, tx pgx.Tx, m *Message) error {
	if err := h.wait(ctx, 1); err != nil {
		return err
	}
	return h.recorder.Handle(ctx, tx, m)
}

func (h *slowSetHandler) HandleBatch(ctx context.Context, tx pgx.Tx, ms []*Message) error {
	err := h.wait(ctx, len(ms))
	h.mu.Lock()
	n := len(ms)
	if err != nil {
		n = -n
	}
	h.batches = append(h.batches, n)
	h.mu.Unlock()
	if err != nil {
		return err
	}
	for _, m := range ms {
		if err := h.recorder.Handle(ctx, tx, m); err != nil {
			return err
		}
	}
	return nil
}

func (h *slowSetHandler) sizes() []int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]int(nil), h.batches...)
}

// Each message takes 100 ms, so a batch of 8 overruns HandlerTimeout
// (600 ms) whatever the machine's load, and one of 4 fits. An overrun
// batch is applied one message at a time, and used to be followed by
// another batch of 8 that overran again, for every 8 messages: the
// machine spent each deadline on work it threw away. After an overrun the
// next batches are halved, so the overruns stop at the size that fits;
// none is charged to a message (no retries, no dead letters).
func TestBatchOverrunShrinksNextBatches(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	const n = 64
	var evs []event
	for i := range n {
		evs = append(evs, event{ID: fmt.Sprintf("ov-%d", i), AggID: fmt.Sprintf("a%d", i%5), Version: int64(i/5 + 1)})
	}
	f.publish(evs...)
	h := &slowSetHandler{recorder: newRecorder("overrun"), per: 100 * time.Millisecond}
	cfg := f.baseConfig("overrun")
	cfg.Workers, cfg.BatchSize = 1, 8
	cfg.HandlerTimeout = 600 * time.Millisecond
	f.start(cfg, h)
	f.waitSettled("overrun", 90*time.Second)
	sizes := h.sizes()
	overruns := 0
	for _, s := range sizes {
		if s < 0 {
			overruns++
		}
	}
	// 8 → 4 fits; a loaded machine may halve once or twice more.
	if overruns > 3 {
		t.Fatalf("%d batches overran their deadline (batch sizes, negative when overrun: %v)", overruns, sizes)
	}
	if n := queryInt(t, f.pool, `SELECT count(*) FROM applied WHERE consumer = 'overrun'`); n != int64(len(evs)) {
		t.Fatalf("%d effects for %d events", n, len(evs))
	}
	if n := queryInt(t, f.pool, `SELECT count(*) FROM consumer_dead_letter WHERE consumer = 'overrun'`); n != 0 {
		t.Fatalf("%d dead letters", n)
	}
	vecs := mustVec(t, f)
	for _, class := range []Class{ClassUnknown, ClassTransient} {
		if got := metricValue(t, vecs.retries.WithLabelValues("overrun", string(class))); got != 0 {
			t.Fatalf("%v %s retries: an overrun was charged to a message", got, class)
		}
	}
}

// adapt halves the batch size after an overrun, down to one message, and
// grows it by one after a full batch that took under half the timeout.
func TestAdaptBatchSize(t *testing.T) {
	const timeout = time.Second
	for _, tc := range []struct {
		name    string
		size, n int
		solo    bool
		out     batchOutcome
		want    int
	}{
		{"overrun halves", 8, 8, false, batchOutcome{overran: true, took: timeout}, 4},
		{"overrun of a short batch halves it", 8, 6, false, batchOutcome{overran: true}, 3},
		{"never below one", 1, 1, false, batchOutcome{overran: true}, 1},
		{"a fast full batch grows", 4, 4, false, batchOutcome{took: timeout / 4}, 5},
		{"a slow full batch stays", 4, 4, false, batchOutcome{took: timeout * 3 / 4}, 4},
		{"a fast short batch stays", 4, 2, false, batchOutcome{took: timeout / 4}, 4},
		{"a fast lone message grows from one", 1, 1, false, batchOutcome{took: timeout / 4}, 2},
		{"messages taken alone after a fallback change nothing", 4, 1, true, batchOutcome{took: timeout / 4}, 4},
		{"not above BatchSize", 8, 8, false, batchOutcome{took: timeout / 4}, 8},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := &worker{c: &Consumer{cfg: Config{BatchSize: 8, HandlerTimeout: timeout}}, size: tc.size, tookSolo: tc.solo}
			w.adapt(tc.n, tc.out)
			if w.size != tc.want {
				t.Fatalf("size %d, want %d", w.size, tc.want)
			}
		})
	}
}
