package faults

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// loadSpec is a steady write load: Writers concurrent writers, each owning
// a disjoint set of the Aggregates, writing transactions whose sizes cycle
// through TxRows, with Pause between transactions, until Events rows were
// attempted or the load is stopped.
type loadSpec struct {
	Writers    int
	Aggregates int
	TxRows     []int // default {1}
	Pause      time.Duration
	Events     int    // 0: until stopped
	Type       string // aggregate_type; default "registration"
}

// load is a running write load. It survives database restarts: a failed
// transaction is counted and skipped, its versions are never reused (so a
// commit whose outcome was lost in a crash cannot collide with a later
// one), and the writer carries on. What was committed is read back from the
// table at the end (committedRows), which is the ground truth.
type load struct {
	cancel    context.CancelFunc
	wg        sync.WaitGroup
	attempted atomic.Int64
	committed atomic.Int64 // commits the client saw succeed
	failed    atomic.Int64
	prefix    string
}

func startLoad(t *testing.T, pool *pgxpool.Pool, spec loadSpec) *load {
	t.Helper()
	if spec.Writers < 1 {
		spec.Writers = 1
	}
	if spec.Aggregates < spec.Writers {
		spec.Aggregates = spec.Writers
	}
	if len(spec.TxRows) == 0 {
		spec.TxRows = []int{1}
	}
	if spec.Type == "" {
		spec.Type = "registration"
	}
	ctx, cancel := context.WithCancel(context.Background())
	l := &load{cancel: cancel, prefix: uuid.NewString()[:8]}
	per := spec.Events / spec.Writers
	for w := 0; w < spec.Writers; w++ {
		quota := per
		if spec.Events > 0 && w == spec.Writers-1 {
			quota = spec.Events - per*(spec.Writers-1)
		}
		l.wg.Add(1)
		go func(w, quota int) {
			defer l.wg.Done()
			l.writer(ctx, pool, spec, w, quota)
		}(w, quota)
	}
	t.Cleanup(l.stop)
	return l
}

func (l *load) writer(ctx context.Context, pool *pgxpool.Pool, spec loadSpec, w, quota int) {
	rng := rand.New(rand.NewPCG(uint64(w), uint64(time.Now().UnixNano())))
	var aggs []string
	for a := w; a < spec.Aggregates; a += spec.Writers {
		aggs = append(aggs, fmt.Sprintf("%s-a%d", l.prefix, a))
	}
	versions := make(map[string]int64, len(aggs))
	written := 0
	for txi := 0; ctx.Err() == nil && (spec.Events == 0 || written < quota); txi++ {
		size := spec.TxRows[txi%len(spec.TxRows)]
		if spec.Events > 0 {
			size = min(size, quota-written)
		}
		batch := &pgx.Batch{}
		for i := 0; i < size; i++ {
			agg := aggs[rng.IntN(len(aggs))]
			versions[agg]++
			v := versions[agg]
			batch.Queue(`INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_version, event_type, payload) VALUES ($1, $2, $3, $4, 'RegistrationConfirmed', $5)`,
				uuid.NewString(), spec.Type, agg, v, fmt.Sprintf(`{"aggregate": %q, "version": %d, "note": "ünïcode ✓"}`, agg, v))
		}
		tctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		err := pgx.BeginFunc(tctx, pool, func(tx pgx.Tx) error { return tx.SendBatch(tctx, batch).Close() })
		cancel()
		l.attempted.Add(int64(size))
		written += size
		if err != nil {
			l.failed.Add(int64(size))
			// The database is restarting or the network is cut: back off
			// a little; the versions just used are never reused.
			select {
			case <-ctx.Done():
			case <-time.After(50 * time.Millisecond):
			}
			continue
		}
		l.committed.Add(int64(size))
		if spec.Pause > 0 {
			select {
			case <-ctx.Done():
			case <-time.After(spec.Pause):
			}
		}
	}
}

// stop ends the load and waits for the writers.
func (l *load) stop() {
	l.cancel()
	l.wg.Wait()
}

// wait waits for a load with an Events quota to finish.
func (l *load) wait() { l.wg.Wait() }
